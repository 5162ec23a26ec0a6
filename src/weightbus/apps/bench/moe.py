"""`weightbus bench moe`: each expert only to the ranks that hold it, against every byte to
every rank, and against `weightbus plan`, in one run.

A Qwen3-MoE of `--size` (bf16, 64 experts, top 4) is served by one engine at TP `--tp` with
expert parallelism (EP = TP, `--expert-parallel`: whole experts per rank). It is pushed four
ways, interleaved with the floors that bound them:

- `shm direct`: each rank's experts and its dense share written straight into its parameters;
- `shm slots`: every bucket through the shared slots, which every rank reads, keeping its
  own experts (what an engine does for a layout the sender does not know);
- `dist parts`: each rank receives its regions only, over gloo;
- `dist broadcast`: every byte to every rank, over gloo.

Each row's bytes per engine rank (what the ranks' sources counted) stand beside the planner's
(`weightbus plan`, `apps/capacity/`), and each time beside the planner's prediction from the
floors measured here (as `weightbus bench plan` does for dense models) plus the row's fixed
cost, measured on a tiny twin of the model (the same layers, experts and tensors, a few MiB):
an MoE push's per-tensor work is part of its cost.

With `--trainer-ranks N ...` it measures the trainer side instead (`moe_ranks.py`): the model
on N expert-parallel trainer processes, each pushing the experts it holds, against gathering
them with `full_tensor()` and pushing from rank 0.
"""

import argparse
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from weightbus.apps.bench.dist import Baseline
from weightbus.apps.bench.moe_ranks import RankRun, check, print_results, run_ranks
from weightbus.apps.bench.moe_weights import MoeShape, moe_config, moe_shape, moe_weights
from weightbus.apps.bench.plan import FLOORS, floor_operations, measured_hardware
from weightbus.apps.bench.timing import measure_interleaved, write_json
from weightbus.apps.capacity.forecast import Scenario, forecast
from weightbus.apps.capacity.shapes import ModelTensors
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.launch import start_engine, stop_engine
from weightbus.apps.tables import print_table
from weightbus.core.digest import fingerprint
from weightbus.core.meta import metas_of
from weightbus.core.publisher import Publisher, PushResult
from weightbus.core.units import format_bytes, parse_bytes

_GROUP_TIMEOUT_S = 120.0
# row -> (planner path, whether the row routes experts to their owners)
ROWS = {
    "shm direct": ("shm", True),
    "shm slots": (None, False),
    "dist parts": ("dist-parts", True),
    "dist broadcast": ("dist-broadcast", False),
}
# each routed row against the row that sends every byte to every rank
SPEEDUPS = (("shm direct", "shm slots"), ("dist parts", "dist broadcast"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="1GiB", help="model size (bf16; at least this)")
    parser.add_argument("--experts", type=int, default=64, help="routed experts per layer")
    parser.add_argument("--top-k", type=int, default=4, help="experts per token")
    parser.add_argument("--tp", type=int, default=2, help="engine TP = EP size")
    parser.add_argument("--redundant-experts", type=int, default=0, help="extra expert slots")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per row (median)")
    parser.add_argument(
        "--trainer-ranks",
        type=int,
        nargs="+",
        default=None,
        help="instead of the engine-side rows: the model on N expert-parallel trainer "
        "processes (Shard(0) DTensors as FSDP2 holds them, experts cut by expert) each pushing "
        "its own experts, against full_tensor() then one push from rank 0, for each N given",
    )
    parser.add_argument(
        "--transports",
        nargs="+",
        default=["shm", "dist"],
        choices=["shm", "dist"],
        help="with --trainer-ranks: shm (straight into the parameters), dist (parts, gloo)",
    )
    parser.add_argument("--json", default=None, help="also write the results to this file")


class _Pushers:
    """One engine's publishers, in place and verify none (the transport alone), each push a
    new version; the last result of each row kept (its ranks' byte counts)."""

    def __init__(self, url: str) -> None:
        self.shm = Publisher([url], transport="shm", timeout_s=600)
        self.slots = Publisher(
            [url], transport="shm", transport_options={"direct": False}, timeout_s=600
        )
        self.dist = Publisher([url], transport="dist", timeout_s=600)
        self.dist.init_weights_group("127.0.0.1", timeout_s=_GROUP_TIMEOUT_S)
        self.last: dict[str, PushResult] = {}
        self._count = 0

    def push(self, row: str, weights: list) -> None:
        publisher = {"shm direct": self.shm, "shm slots": self.slots}.get(row, self.dist)
        if publisher is self.dist:
            self.dist.sink.requested_mode = row.removeprefix("dist ")
        self._count += 1
        self.last[row] = publisher.push(
            weights,
            version=f"moe-{self._count}-{time.monotonic_ns()}",
            atomic=False,
            pause_mode="in_place",
            verify="none",
        )

    def close(self) -> None:
        for publisher in (self.shm, self.slots, self.dist):
            publisher.close()


def _write_model(shape: MoeShape, weights: list, folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(moe_config(shape)))
    save_file(dict(weights), str(folder / "model.safetensors"))
    return folder


def _layout(args: argparse.Namespace) -> EngineLayout:
    return EngineLayout(args.tp, args.tp, "linear", args.redundant_experts)


def _engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--dtype", "bfloat16", "--expert-parallel"]
    if args.redundant_experts:
        flags += ["--redundant-experts", str(args.redundant_experts)]
    return flags


def _fixed_costs(shape: MoeShape, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """Median push time per row of a tiny twin of `shape` (its layers, experts and tensors,
    hidden 128, experts of 32: a few MiB): the cost of a push that bandwidths do not explain,
    its per-tensor work included (the planner's `push_s` for each row)."""
    twin = replace(shape, hidden_size=128, moe_intermediate_size=32, vocab_size=256)
    weights = moe_weights(twin)
    folder = _write_model(twin, weights, workdir / "twin")
    proc, url = start_engine(str(folder), args.tp, extra=_engine_flags(args))
    pushers = _Pushers(url)
    try:
        ops = [(row, 0, lambda r=row: pushers.push(r, weights)) for row in ROWS]
        rows = measure_interleaved(ops, max(5, args.repeat))
    finally:
        pushers.close()
        stop_engine(proc)
    return {m.name: m.median_s for m in rows}


def _measure(args: argparse.Namespace, workdir: Path) -> dict:
    shape = moe_shape(parse_bytes(args.size), args.experts, args.top_k)
    fixed = _fixed_costs(shape, args, workdir)
    weights = moe_weights(shape)
    model_bytes = sum(t.nbytes for _, t in weights)
    model = ModelTensors("qwen3-moe", tuple(metas_of(weights)), moe_config(shape))
    folder = _write_model(shape, weights, workdir / "moe")
    proc, url = start_engine(str(folder), args.tp, extra=_engine_flags(args))
    (folder / "model.safetensors").unlink()
    planned = {
        path: forecast(model, Scenario(engine=_layout(args), transport=path,
                                       hardware=measured_hardware(dict.fromkeys(FLOORS, 1.0), 0.0),
                                       cross_node=path != "shm", verify=False)).traffic
        for path, _ in ROWS.values() if path
    }  # fmt: skip
    share = max(planned["dist-parts"].receive_bytes)
    baseline = Baseline(args.tp, [t for _, t in weights])
    pushers = _Pushers(url)
    try:
        ops = floor_operations(weights, baseline, share, args.tp, folder)
        ops += [(row, model_bytes, lambda r=row: pushers.push(r, weights)) for row in ROWS]
        rows = {m.name: m for m in measure_interleaved(ops, args.repeat)}
    finally:
        pushers.close()
        baseline.close()
        stop_engine(proc)
    floors = {name: rows[name].gb_per_s for name in FLOORS}
    predicted = {
        row: forecast(model, Scenario(engine=_layout(args), transport=path,
                                      hardware=measured_hardware(floors, fixed[row]),
                                      cross_node=path != "shm", verify=False)).timing
        for row, (path, _) in ROWS.items() if path
    }  # fmt: skip
    return {
        "shape": shape,
        "size": model_bytes,
        "expert_bytes": shape.expert_numel() * 2,
        "floors": floors,
        "rows": rows,
        "rank_bytes": {row: pushers.last[row].engines[0].rank_nbytes for row in ROWS},
        "planned_bytes": {row: list(planned[p].receive_bytes) for row, (p, _) in ROWS.items() if p},
        "predicted": predicted,
    }


def _error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.0%}" if measured else "-"


def _model_line(result: dict) -> str:
    """The model a bench moe run pushes: its size, layers, experts and experts' bytes."""
    shape: MoeShape = result["shape"]
    return (
        f"\n{format_bytes(result['size'])} Qwen3-MoE bf16 ({shape.num_layers} layers x "
        f"{shape.num_experts} experts, top {shape.top_k}; experts "
        f"{format_bytes(result['expert_bytes'])})"
    )


def _print(result: dict, args: argparse.Namespace) -> None:
    print(
        f"{_model_line(result)} into 1 engine of TP {args.tp} = EP {args.tp}"
        f" ({args.redundant_experts} redundant), median of {args.repeat}, in place, verify none"
    )
    floors = ", ".join(f"{name} {gb:.2f} GB/s" for name, gb in result["floors"].items())
    print(f"floors: {floors}")
    table = []
    for row, (_path, routed) in ROWS.items():
        measured = result["rows"][row].median_s
        got = result["rank_bytes"][row]
        planned = result["planned_bytes"].get(row)
        timing = result["predicted"].get(row)
        table.append([
            row,
            "own experts" if routed else "every byte",
            " / ".join(format_bytes(b) for b in got),
            " / ".join(format_bytes(b) for b in planned) if planned else "-",
            f"{measured:.3f}",
            f"{timing.seconds:.3f} ({_error(timing.seconds, measured)})" if timing else "-",
        ])  # fmt: skip
    print_table(
        ["row", "sends", "bytes per rank", "planned per rank", "measured s", "predicted s"],
        table,
    )
    for routed, whole in SPEEDUPS:
        ratio = result["rows"][whole].median_s / result["rows"][routed].median_s
        print(f"{routed} vs {whole}: {ratio:.2f}x faster")


def _measure_ranks(args: argparse.Namespace, workdir: Path) -> dict:
    """The trainer-side rows for each `--trainer-ranks` N, into one engine."""
    shape = moe_shape(parse_bytes(args.size), args.experts, args.top_k)
    weights = moe_weights(shape)
    model_bytes = sum(t.nbytes for _, t in weights)
    expected = fingerprint(weights)
    folder = _write_model(shape, weights, workdir / "moe")
    del weights  # the ranks read their shards from the checkpoint
    proc, url = start_engine(str(folder), args.tp, extra=_engine_flags(args))
    run = RankRun(str(folder), url, args.tp, tuple(args.transports), args.repeat)
    try:
        results = {n: run_ranks(run, n, workdir / f"ranks{n}") for n in args.trainer_ranks}
    finally:
        stop_engine(proc)
    return {"shape": shape, "size": model_bytes, "expert_bytes": shape.expert_numel() * 2,
            "run": run, "results": results, "fingerprint": expected}  # fmt: skip


def _print_ranks(result: dict, args: argparse.Namespace) -> int:
    print(
        f"{_model_line(result)} on trainer ranks holding FSDP2's Shard(0) "
        f"(experts cut by expert) into 1 engine of TP {args.tp} = EP {args.tp}, median of "
        f"{args.repeat}, in place, verify none, buckets "
        f"{format_bytes(result['run'].bucket_bytes)}; {os.cpu_count()} cores"
    )
    print_results(result["run"], result["results"])
    problems = check(result["results"], result["fingerprint"])
    for problem in problems:
        print(f"MISMATCH: {problem}")
    if not problems:
        print(f"every push: fingerprint {result['fingerprint']}, the checkpoint's")
    if args.json:
        payload = {"fingerprint": result["fingerprint"], "size": result["size"],
                   "results": result["results"]}  # fmt: skip
        write_json(args.json, {"suite": "moe", "trainer_ranks": payload})
    return 1 if problems else 0


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    torch.set_num_threads(os.cpu_count() or 1)
    shm = Path("/dev/shm")  # noqa: S108 - the benchmark's checkpoint lives in RAM
    with tempfile.TemporaryDirectory(
        prefix="weightbus-bench-", dir=shm if shm.is_dir() else None
    ) as tmp:
        if args.trainer_ranks:
            return _print_ranks(_measure_ranks(args, Path(tmp)), args)
        result = _measure(args, Path(tmp))
    _print(result, args)
    if args.json:
        predicted = {row: timing.as_dict() for row, timing in result["predicted"].items()}
        payload = {**result, "shape": asdict(result["shape"]), "predicted": predicted}
        write_json(args.json, {"suite": "moe", "result": payload})
    return 0
