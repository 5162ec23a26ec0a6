"""`weightbus bench fleet`: what fleet-wide atomicity costs, against one-phase pushes, same run.

Starts `--engines` reference engines on one Llama-shaped bf16 checkpoint of `--size` and times,
every operation once per round (median of `--repeat` rounds), over `shm`:

- one-phase and two-phase atomic pushes into 1 engine and into all of them (the ratio is the
  price of all-or-nothing; target <= 5% at 256 MiB), the pair's order swapped every round;
- a rollback of the fleet, against a two-phase push of the same weights;
- the commit skew of each push into the fleet: from the first engine to the last serving the
  new version, read from the commit times the engines record (`GET /v1/weights` history, one
  host, one clock);
- re-forming the `dist` weights group over the fleet: what the members pay when an engine
  joins or leaves a `dist` fleet (their ranks join in the background, generating meanwhile).
"""

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from weightbus.apps.bench.llama_weights import hf_config, llama_shape, llama_weights
from weightbus.apps.bench.timing import Measurement, write_json
from weightbus.apps.launch import start_engine, stop_engine
from weightbus.apps.progress import RoundsProgress
from weightbus.apps.tables import print_table
from weightbus.core.publisher import Publisher
from weightbus.core.units import byte_size_arg, format_bytes

TARGET_TWO_PHASE_OVERHEAD = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=byte_size_arg, default="256MiB", help="model size")
    parser.add_argument("--engines", type=int, default=3, help="engines in the fleet")
    parser.add_argument("--tp", type=int, default=1, help="TP size of each engine")
    parser.add_argument("--repeat", type=int, default=7, help="rounds (median)")
    parser.add_argument("--json", default=None, help="also write the results to this file")


class _Fleet:
    """Publishers over the same engines: the first engine alone, and all of them (`shm`),
    plus all of them over `dist` for the group re-formation."""

    def __init__(self, urls: list[str], weights: list) -> None:
        self.weights = weights
        self.one = Publisher(urls[:1], transport="shm", timeout_s=600)
        self.all = Publisher(urls, transport="shm", timeout_s=600)
        self.dist = Publisher(urls, transport="dist", timeout_s=600)
        self.dist.init_weights_group("127.0.0.1")
        self.skews: dict[str, list[float]] = {"one-phase": [], "two-phase": []}
        self._count = 0

    def push(self, publisher: Publisher, two_phase: bool) -> Callable[[], None]:
        def run() -> None:
            self._count += 1
            publisher.push(self.weights, version=f"v{self._count}", two_phase=two_phase)
            if publisher is self.all:
                self.skews["two-phase" if two_phase else "one-phase"].append(self._skew())

        return run

    def _skew(self) -> float:
        committed = [state.history[-1]["committed_at"] for state in self.all.engine_weights()]
        return max(committed) - min(committed)

    def rollback(self) -> None:
        self.all.rollback()

    def reform_dist_group(self) -> None:
        self.dist.init_weights_group("127.0.0.1")

    def close(self) -> None:
        for publisher in (self.one, self.all, self.dist):
            publisher.close()


def _rounds(fleet: _Fleet, nbytes: int, num_engines: int, repeat: int) -> list[Measurement]:
    """Every operation once per round, after one untimed warm-up round. Each one-phase /
    two-phase pair swaps its order every round, so neither always runs after the other."""
    floor_source = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    floor_buffer = torch.empty(nbytes, dtype=torch.uint8)
    many = f"{num_engines} engines"
    pairs = [
        [
            (f"{count}, one-phase", nbytes, fleet.push(publisher, two_phase=False)),
            (f"{count}, two-phase", nbytes, fleet.push(publisher, two_phase=True)),
        ]
        for count, publisher in (("1 engine", fleet.one), (many, fleet.all))
    ]
    floor = ("floor: memcpy into preallocated", nbytes, lambda: floor_buffer.copy_(floor_source))
    # the rollback follows the fleet's pair: every engine holds the same previous version
    tail = [
        (f"{many}, rollback", 0, fleet.rollback),
        (f"{many}, dist group re-formed", 0, fleet.reform_dist_group),
    ]
    samples: dict[str, list[float]] = {}
    operations = [floor, *[op for pair in pairs for op in pair], *tail]
    with RoundsProgress(len(operations), repeat) as progress:
        for index in range(repeat + 1):
            swapped = [op for pair in pairs for op in pair[:: 1 if index % 2 else -1]]
            for name, _, fn in [floor, *swapped, *tail]:
                progress.row(index, name)
                start = time.perf_counter()
                fn()
                if index:  # round 0 warms up (mappings, page faults)
                    samples.setdefault(name, []).append(time.perf_counter() - start)
    return [Measurement(name, size, samples[name]) for name, size, _ in operations]


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    torch.set_num_threads(os.cpu_count() or 1)
    weights = llama_weights(args.size, torch.bfloat16)
    nbytes = sum(t.nbytes for _, t in weights)
    shm = Path("/dev/shm")  # noqa: S108 - the benchmark's checkpoint lives in RAM
    engines = []
    with tempfile.TemporaryDirectory(
        prefix="weightbus-bench-", dir=shm if shm.is_dir() else None
    ) as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(hf_config(llama_shape(args.size, 2))))
        save_file(dict(weights), str(model_dir / "model.safetensors"))
        try:
            engines.extend(
                start_engine(str(model_dir), args.tp, extra=["--dtype", "bfloat16"])
                for _ in range(args.engines)
            )
            fleet = _Fleet([url for _, url in engines], weights)
            try:
                rows = _rounds(fleet, nbytes, args.engines, args.repeat)
            finally:
                fleet.close()
        finally:
            for proc, _ in engines:
                stop_engine(proc)
    _report(rows, fleet.skews, nbytes, args)
    if args.json:
        write_json(args.json, {"suite": "fleet", "rows": rows, "skews_s": fleet.skews})
    return 0


def _report(rows: list[Measurement], skews: dict, nbytes: int, args: argparse.Namespace) -> None:
    by_name = {m.name: m for m in rows}
    floor = rows[0]
    print(
        f"\n{format_bytes(nbytes)} Llama-shaped bf16, {args.engines} engine(s) of TP {args.tp}, "
        f"shm, atomic drain pushes, median of {args.repeat} interleaved rounds"
    )
    table = [
        [m.name, f"{m.median_s:.3f}", f"{m.median_s / floor.median_s:.2f}" if m.nbytes else ""]
        for m in rows
    ]
    print_table(["operation", "median s", "x floor"], table)
    print()
    many = f"{args.engines} engines"
    for count in ("1 engine", many):
        one = by_name[f"{count}, one-phase"].median_s
        two = by_name[f"{count}, two-phase"].median_s
        overhead = two / one - 1
        verdict = "meets" if overhead <= TARGET_TWO_PHASE_OVERHEAD else "MISSES"
        print(
            f"two-phase over one-phase, {count}: {100 * overhead:+.1f}% "
            f"({verdict} target <= {100 * TARGET_TWO_PHASE_OVERHEAD:.0f}%)"
        )
    rollback = by_name[f"{many}, rollback"].median_s
    push = by_name[f"{many}, two-phase"].median_s
    print(f"rollback: {1000 * rollback:.1f} ms, {push / rollback:.0f}x faster than the push")
    for kind, samples in skews.items():
        print(
            f"commit skew, {kind}: median {1000 * statistics.median(samples):.1f} ms, "
            f"max {1000 * max(samples):.1f} ms (first to last engine serving the new version)"
        )
    reform = by_name[f"{many}, dist group re-formed"].median_s
    print(f"dist group re-formed over {many} (an engine joins or leaves): {1000 * reform:.0f} ms")
