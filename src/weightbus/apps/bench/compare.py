"""`weightbus bench` (no suite): every way to move the weights, same run, same weights.

For each size: write Llama-shaped bf16 weights as a Hugging Face checkpoint, start a real
engine from it (`weightbus serve --tp N --dtype bfloat16`), then time in interleaved rounds:

- the floor: one memcpy of the model's bytes into a preallocated buffer (all cores);
- the baselines a user would otherwise pick: safetensors saved to /dev/shm and reloaded by every
  rank (`hf_dir`, SGLang's `update_weights_from_disk`), one torch.distributed broadcast per
  tensor, tensors pickled through torch.multiprocessing queues;
- every weightbus transport (`disk`, `shm`, and `dist` once registered), verify on and off.

Adding a row is one line in `cases()`. Reports median seconds, GB/s, the ratio to the floor,
speed-ups over each baseline and the extra peak RSS of the publisher and the receiving processes;
writes JSON and, when matplotlib is installed (`weightbus[bench]`), a PNG.
"""

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file

from weightbus.apps.bench.baselines import BroadcastCase, PickleCase
from weightbus.apps.bench.llama_weights import hf_config, llama_shape, llama_weights
from weightbus.apps.bench.memory import child_pids, reset_peak, rss_bytes
from weightbus.apps.launch import start_engine, stop_engine
from weightbus.apps.tables import print_table
from weightbus.core.publisher import Publisher
from weightbus.core.transport import transport_names
from weightbus.core.units import byte_size_arg, format_bytes

BASELINES = ("safetensors", "broadcast", "pickle")
# weightbus rows: (label, transport, sink options); rows appear for registered transports
WEIGHTBUS_PATHS = (
    ("disk", "disk", {}),
    ("shm direct", "shm", {}),  # straight into the ranks' shared-memory parameters
    ("shm slots", "shm", {"direct": False}),
    # dist has its own suite (`weightbus bench dist`, against raw gloo broadcasts): its bucket
    # buffers on top of every other case's memory do not fit a 24 GiB host at 1 GiB
)
QUICK_SIZES = "16MiB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="1GiB", help="comma-separated model sizes (1GiB)")
    parser.add_argument("--tp", type=int, default=2, help="TP size of the engine (2)")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds (median of N)")
    parser.add_argument("--bucket-bytes", type=byte_size_arg, default="256MiB")
    parser.add_argument("--json", default="bench.json", help="results file (bench.json)")
    parser.add_argument(
        "--plot", default="bench.png", help="plot file (bench.png; needs matplotlib)"
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"CI smoke run: --sizes {QUICK_SIZES} --repeat 1"
    )


class Case(Protocol):
    """One way to move the weights; `run` is timed, `prepare` (before each run) is not."""

    name: str
    kind: str  # "floor", a name in BASELINES, or "weightbus"

    def pids(self) -> list[int]: ...
    def prepare(self) -> None: ...
    def run(self) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Setup:
    """What cases are built from: the weights and the engine serving them."""

    weights: list[tuple[str, torch.Tensor]]
    size: int
    model_bytes: int
    url: str
    engine_pids: list[int]
    tp: int
    bucket_bytes: int


class FloorCase:
    """One memcpy of the model's bytes into a preallocated buffer, all cores."""

    name = "floor: memcpy into preallocated"
    kind = "floor"

    def __init__(self, setup: Setup) -> None:
        self.source = torch.empty(setup.model_bytes, dtype=torch.uint8).fill_(1)
        self.target = torch.empty(setup.model_bytes, dtype=torch.uint8)

    def pids(self) -> list[int]:
        return []

    def prepare(self) -> None:
        """Nothing to prepare."""

    def run(self) -> None:
        self.target.copy_(self.source)

    def close(self) -> None:
        """Nothing to free (the buffers go with the case)."""


class PushCase:
    """A `Publisher.push` into the engine: in place, each push a new version."""

    def __init__(
        self,
        setup: Setup,
        transport: str,
        verify: str,
        name: str,
        kind: str,
        *,
        options: dict | None = None,
    ) -> None:
        self.name, self.kind = name, kind
        self.setup = setup
        self.verify = verify
        self.count = 0
        self.publisher = Publisher(
            [setup.url],
            transport=transport,
            bucket_bytes=setup.bucket_bytes,
            timeout_s=600,
            transport_options=options,
        )
        if transport == "dist":
            self.publisher.init_weights_group("127.0.0.1")

    def pids(self) -> list[int]:
        return self.setup.engine_pids

    def prepare(self) -> None:
        """Nothing: the publisher reads the trainer's tensors."""

    def run(self) -> None:
        self.count += 1
        self.publisher.push(
            self.setup.weights,
            version=f"{self.kind}-{self.publisher.transport}-{self.verify}-{self.count}",
            atomic=False,
            pause_mode="in_place",
            verify=self.verify,
        )

    def close(self) -> None:
        self.publisher.close()


def cases() -> list[tuple[str, Callable[[Setup], Case]]]:
    """The table of cases: (name, factory). One line per row."""
    table: list[tuple[str, Callable[[Setup], Case]]] = [
        ("floor", FloorCase),
        (
            "safetensors",
            lambda s: PushCase(s, "hf_dir", "none", "safetensors /dev/shm + reload", "safetensors"),
        ),
        ("broadcast", lambda s: BroadcastCase(s.weights, s.size, s.tp)),
        ("pickle", lambda s: PickleCase(s.weights, s.size, s.tp)),
    ]
    for label, transport, options in WEIGHTBUS_PATHS:
        if transport not in transport_names():
            continue
        for verify in ("full", "none"):
            name = f"weightbus {label} verify={verify}"
            table.append(
                (
                    name,
                    lambda s, t=transport, v=verify, n=name, o=options: PushCase(
                        s, t, v, n, "weightbus", options=o
                    ),
                )
            )
    return table


@dataclass(slots=True)
class Row:
    """Timings and peak memory of one case."""

    name: str
    kind: str
    seconds: list[float] = field(default_factory=list)
    publisher_peak_extra: int = 0
    receiver_peak_extra: int = 0

    @property
    def median_s(self) -> float:
        ordered = sorted(self.seconds)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _timed_run(case: Case) -> tuple[float, int, int]:
    """Seconds of one `run`, and the extra peak RSS of the publisher and of the receivers."""
    case.prepare()
    me = os.getpid()
    pids = case.pids()
    for pid in (me, *pids):
        reset_peak(pid)
    before = {pid: rss_bytes(pid) for pid in (me, *pids)}
    start = time.perf_counter()
    case.run()
    seconds = time.perf_counter() - start
    publisher = rss_bytes(me, "VmHWM") - before[me]
    receivers = max((rss_bytes(pid, "VmHWM") - before[pid] for pid in pids), default=0)
    return seconds, max(publisher, 0), max(receivers, 0)


def _measure(built: list[Case], repeat: int, label: str) -> list[Row]:
    """Interleaved rounds (every case once per round) after one untimed warm-up round."""
    rows = [Row(case.name, case.kind) for case in built]
    for round_index in range(repeat + 1):
        for case, row in zip(built, rows, strict=True):
            seconds, publisher, receivers = _timed_run(case)
            tag = "warm-up" if round_index == 0 else f"round {round_index}/{repeat}"
            print(f"  [{label} {tag}] {case.name}: {seconds:.3f} s", file=sys.stderr, flush=True)
            if round_index == 0:
                continue
            row.seconds.append(seconds)
            row.publisher_peak_extra = max(row.publisher_peak_extra, publisher)
            row.receiver_peak_extra = max(row.receiver_peak_extra, receivers)
    return rows


def _write_checkpoint(weights: list, size: int, directory: Path) -> None:
    directory.mkdir()
    shape = llama_shape(size, 2)
    (directory / "config.json").write_text(json.dumps(hf_config(shape)))
    save_file(dict(weights), str(directory / "model.safetensors"))


def _bench_size(size: int, args: argparse.Namespace, workdir: Path) -> dict:
    label = format_bytes(size)
    print(f"{label}: generating weights, starting a TP-{args.tp} engine", file=sys.stderr)
    weights = llama_weights(size, torch.bfloat16)
    model_bytes = sum(t.nbytes for _, t in weights)
    model_dir = workdir / f"model-{size}"
    _write_checkpoint(weights, size, model_dir)
    proc, url = start_engine(str(model_dir), args.tp, extra=["--dtype", "bfloat16"])
    built: list[Case] = []
    try:
        setup = Setup(
            weights, size, model_bytes, url, child_pids(proc.pid), args.tp, args.bucket_bytes
        )
        for name, factory in cases():
            print(f"{label}: setting up {name}", file=sys.stderr, flush=True)
            built.append(factory(setup))
        rows = _measure(built, args.repeat, label)
    finally:
        for case in built:
            case.close()
        stop_engine(proc)
    return {"size": model_bytes, "num_tensors": len(weights), "rows": rows}


def _speedups(row: Row, by_kind: dict[str, Row]) -> dict[str, float]:
    if row.kind != "weightbus":
        return {}
    return {kind: by_kind[kind].median_s / row.median_s for kind in BASELINES if kind in by_kind}


def _result_json(result: dict) -> dict:
    rows: list[Row] = result["rows"]
    floor = next(r for r in rows if r.kind == "floor")
    by_kind = {r.kind: r for r in rows if r.kind in BASELINES}
    return {
        "size": result["size"],
        "num_tensors": result["num_tensors"],
        "rows": [
            {
                "name": r.name,
                "kind": r.kind,
                "seconds": r.seconds,
                "median_s": r.median_s,
                "gb_per_s": result["size"] / r.median_s / 1e9,
                "x_floor": r.median_s / floor.median_s,
                "speedup": _speedups(r, by_kind),
                "publisher_peak_extra_rss": r.publisher_peak_extra,
                "receiver_peak_extra_rss": r.receiver_peak_extra,
            }
            for r in rows
        ],
    }


def _print(result: dict, args: argparse.Namespace) -> None:
    print(
        f"\n{format_bytes(result['size'])} Llama-shaped bf16 ({result['num_tensors']} tensors), "
        f"engine TP {args.tp}, {args.tp} receiver processes per baseline, "
        f"median of {args.repeat}, {os.cpu_count()} cores"
    )
    table = []
    for row in result["rows"]:
        speedup = row["speedup"]
        table.append(
            [
                row["name"],
                f"{row['median_s']:.3f}",
                f"{row['gb_per_s']:.2f}",
                f"{row['x_floor']:.1f}",
                *(f"{speedup[k]:.1f}x" if k in speedup else "" for k in BASELINES),
                format_bytes(row["publisher_peak_extra_rss"]),
                format_bytes(row["receiver_peak_extra_rss"]),
            ]
        )
    headers = ["case", "median s", "GB/s", "x floor", *(f"vs {k}" for k in BASELINES)]
    print_table([*headers, "pub +RSS", "recv +RSS"], table)


def _sizes(args: argparse.Namespace) -> list[int]:
    return [byte_size_arg(text) for text in args.sizes.split(",")]


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.sizes, args.repeat = QUICK_SIZES, 1
    if args.tp < 1 or args.repeat < 1:
        print("weightbus bench: error: --tp and --repeat must be >= 1", file=sys.stderr)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("weightbus.core.publisher").setLevel(logging.WARNING)
    torch.set_num_threads(os.cpu_count() or 1)
    results = []
    shm = Path("/dev/shm")  # noqa: S108 - the checkpoints live in RAM, like the transports'
    with tempfile.TemporaryDirectory(
        prefix="weightbus-bench-", dir=shm if shm.is_dir() else None
    ) as tmp:
        for size in _sizes(args):
            result = _result_json(_bench_size(size, args, Path(tmp)))
            results.append(result)
            _print(result, args)
    payload = {
        "suite": "compare",
        "tp": args.tp,
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "results": results,
    }
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    if _plot(results, args.plot):
        print(f"\nwrote {args.json} and {args.plot}")
    else:
        print(f"\nwrote {args.json}")
    return 0


def _plot(results: list[dict], path: str) -> bool:
    """Write the PNG; False (and one line saying how to get it) when matplotlib is missing."""
    from weightbus.apps.bench.plot import plot_results

    try:
        plot_results(results, path)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] != "matplotlib":
            raise
        print(
            f"weightbus bench: plot skipped ({path}): matplotlib is not installed; "
            "pip install 'weightbus[bench]' to get it",
            file=sys.stderr,
        )
        return False
    return True
