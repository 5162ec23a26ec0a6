"""`weightbus bench plan`: `weightbus plan`'s time model against real pushes, same run.

The model (`weightbus.apps.capacity.timing`) takes bandwidths and fixed costs as inputs. Here they
are measured on this machine, interleaved with the pushes they predict:

- memcpy into a shared-memory mapping (a /dev/shm file, as the ranks' parameter arenas), all
  cores: the `shm` direct write and the ranks' copies;
- xxh3-128 of the model's tensors on one thread (`digest.tensor_digest`: the fingerprint);
- one raw gloo broadcast of the model's bytes to N peer processes (`dist` broadcast's link);
- raw gloo point-to-point sends of a rank's share to each peer at once (`dist` parts's link);
- the fixed cost of each path: pushes of a tiny model (4 MiB) into a TP-N engine.

Then it predicts `shm` direct and `dist` broadcast / parts pushes of Llama-shaped bf16 weights
into a real TP-N engine (in place, verify none) and times them: predicted against measured.
"""

import argparse
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from weightbus.apps.bench.dist import Baseline, DistPusher, write_model
from weightbus.apps.bench.llama_weights import hf_config, llama_shape, llama_weights
from weightbus.apps.bench.timing import Measurement, measure_interleaved, write_json
from weightbus.apps.capacity.forecast import Scenario, forecast
from weightbus.apps.capacity.shapes import ModelTensors
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.capacity.timing import Hardware
from weightbus.apps.launch import start_engine, stop_engine
from weightbus.apps.tables import print_table
from weightbus.core.digest import tensor_digest
from weightbus.core.meta import metas_of
from weightbus.core.publisher import Publisher
from weightbus.core.units import format_bytes, parse_bytes

PATHS = ("shm", "dist-broadcast", "dist-parts")
_TINY_BYTES = 4 << 20
_GROUP_TIMEOUT_S = 120.0
FLOORS = ("memcpy into shared memory", "xxh3, one thread", "gloo broadcast", "gloo send, each peer")
# bandwidths do not change bytes: the share per rank is computed with any
_BYTES_ONLY = Hardware(name="bytes only", nic_gb_per_s=1, local_gb_per_s=1, copy_gb_per_s=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="256MiB,1GiB", help="comma-separated model sizes")
    parser.add_argument("--tp", type=int, default=2, help="TP size of the engine")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per row (median)")
    parser.add_argument("--json", default=None, help="also write the results to this file")


class _Pushers:
    """One engine's publishers: `shm` direct and `dist` in both modes, in place, verify none."""

    def __init__(self, url: str) -> None:
        self.shm = Publisher([url], transport="shm", timeout_s=600)
        self.dist = Publisher([url], transport="dist", timeout_s=600)
        self.dist.init_weights_group("127.0.0.1", timeout_s=_GROUP_TIMEOUT_S)
        self.by_path = {
            "shm": self._push_shm,
            "dist-broadcast": DistPusher(self.dist, "broadcast"),
            "dist-parts": DistPusher(self.dist, "parts"),
        }
        self.count = 0

    def _push_shm(self, weights: list) -> None:
        self.count += 1
        self.shm.push(
            weights,
            version=f"shm-{self.count}-{time.monotonic_ns()}",
            atomic=False,
            pause_mode="in_place",
            verify="none",
        )

    def close(self) -> None:
        self.shm.close()
        self.dist.close()


def fixed_costs(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """Median push time of a tiny model per path: the fixed cost of a push."""
    weights = llama_weights(_TINY_BYTES, torch.bfloat16)
    proc, url = start_engine(
        str(write_model(weights, _TINY_BYTES, workdir, "tiny")),
        args.tp,
        extra=["--dtype", "bfloat16"],
    )
    try:
        pushers = _Pushers(url)
        try:
            ops = [(path, 0, lambda p=pushers.by_path[path]: p(weights)) for path in PATHS]
            rows = measure_interleaved(ops, max(5, args.repeat))
        finally:
            pushers.close()
    finally:
        stop_engine(proc)
    return {m.name: m.median_s for m in rows}


def _shared_buffer(folder: Path, nbytes: int) -> torch.Tensor:
    """A /dev/shm-backed buffer of `nbytes` (mapped shared, as the ranks' arenas are)."""
    path = folder / "floor.bin"
    with path.open("wb") as handle:
        handle.truncate(nbytes)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def floor_operations(
    weights: list, baseline: Baseline, share: int, tp: int, folder: Path
) -> list[tuple[str, int, Callable[[], object]]]:
    """The `FLOORS` as operations for `measure_interleaved`: memcpy of the model into shared
    memory (a file in `folder`), its xxh3 on one thread, a gloo broadcast of it to the
    `baseline` peers, and `share` bytes sent to each of the `tp` peers at once."""
    model_bytes = sum(t.nbytes for _, t in weights)
    source = torch.empty(model_bytes, dtype=torch.uint8).fill_(1)
    floor_buffer = _shared_buffer(folder, model_bytes)
    return [
        ("memcpy into shared memory", model_bytes, lambda: floor_buffer.copy_(source)),
        ("xxh3, one thread", model_bytes, lambda: [tensor_digest(t) for _, t in weights]),
        ("gloo broadcast", model_bytes, baseline.single),
        ("gloo send, each peer", share * tp, lambda: baseline.send_each(share)),
    ]


def _measure_size(size: int, fixed: dict, args: argparse.Namespace, workdir: Path) -> dict:
    weights = llama_weights(size, torch.bfloat16)
    model_bytes = sum(t.nbytes for _, t in weights)
    model = ModelTensors(
        f"llama {format_bytes(size)}", tuple(metas_of(weights)), hf_config(llama_shape(size, 2))
    )
    share = max(forecast(model, _scenario("shm", args.tp, _BYTES_ONLY)).traffic.share_bytes)
    folder = write_model(weights, size, workdir, f"model-{size}")
    proc, url = start_engine(str(folder), args.tp, extra=["--dtype", "bfloat16"])
    (folder / "model.safetensors").unlink()
    baseline = Baseline(args.tp, [t for _, t in weights])
    pushers = _Pushers(url)
    try:
        ops = floor_operations(weights, baseline, share, args.tp, folder)
        ops += [(path, model_bytes, lambda p=pushers.by_path[path]: p(weights)) for path in PATHS]
        rows = {m.name: m for m in measure_interleaved(ops, args.repeat)}
    finally:
        pushers.close()
        baseline.close()
        stop_engine(proc)
    floors = {name: rows[name].gb_per_s for name in FLOORS}
    predicted = {
        path: forecast(
            model, _scenario(path, args.tp, measured_hardware(floors, fixed[path]))
        ).timing
        for path in PATHS
    }
    return {
        "size": model_bytes,
        "floors": floors,
        "fixed_s": fixed,
        "rows": rows,
        "predicted": predicted,
    }


def measured_hardware(floors: dict[str, float], push_s: float) -> Hardware:
    return Hardware(
        name="this machine, measured",
        nic_gb_per_s=floors["gloo send, each peer"],
        local_gb_per_s=floors["memcpy into shared memory"],
        broadcast_gb_per_s=floors["gloo broadcast"],
        copy_gb_per_s=floors["memcpy into shared memory"],
        hash_gb_per_s=floors["xxh3, one thread"],
        push_s=push_s,
        shared_cpu=True,
    )


def _scenario(path: str, tp: int, hardware: Hardware) -> Scenario:
    # shm stays in this host's memory; dist goes through (loopback) sockets, as across nodes
    return Scenario(
        engine=EngineLayout(tp),
        transport=path,
        hardware=hardware,
        cross_node=path != "shm",
        verify=False,  # the pushes here run with verify none: the transport alone
    )


def _print(result: dict, args: argparse.Namespace) -> None:
    print(
        f"\n{format_bytes(result['size'])} Llama-shaped bf16 into 1 engine of TP {args.tp}, "
        f"median of {args.repeat}, in place, verify none"
    )
    floors = ", ".join(f"{name} {gb:.2f} GB/s" for name, gb in result["floors"].items())
    print(f"floors: {floors}")
    table = []
    for path in PATHS:
        measured: Measurement = result["rows"][path]
        timing = result["predicted"][path]
        error = (timing.seconds - measured.median_s) / measured.median_s
        table.append(
            [
                path,
                f"{measured.median_s:.3f}",
                f"{timing.seconds:.3f}",
                f"{error:+.0%}",
                " / ".join(
                    f"{s:.3f}"
                    for s in (timing.stage_s, timing.wire_s, timing.apply_s, timing.push_s)
                ),
            ]
        )
    print_table(
        ["path", "measured s", "predicted s", "error", "stage / wire / apply / fixed s"], table
    )


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    torch.set_num_threads(os.cpu_count() or 1)
    shm = Path("/dev/shm")  # noqa: S108 - the benchmark's checkpoints live in RAM
    results = []
    with tempfile.TemporaryDirectory(
        prefix="weightbus-bench-", dir=shm if shm.is_dir() else None
    ) as tmp:
        fixed = fixed_costs(args, Path(tmp))
        print(f"fixed cost of a push (tiny model): {fixed}")
        for size in (parse_bytes(s) for s in args.sizes.split(",")):
            result = _measure_size(size, fixed, args, Path(tmp))
            _print(result, args)
            results.append(result)
    if args.json:
        payload = [
            {**r, "predicted": {p: t.as_dict() for p, t in r["predicted"].items()}} for r in results
        ]
        write_json(args.json, {"suite": "plan", "results": payload})
    return 0
