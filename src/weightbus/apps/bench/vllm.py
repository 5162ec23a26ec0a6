"""`weightbus bench vllm`: pushes into a live vLLM server (backend `weightbus`) against the path
users take today -- the trainer saves safetensors, vLLM reloads the directory -- and against
the memcpy floor, same run, same weights, interleaved rounds.

Rows: `floor` (one memcpy of the weights into preallocated buffers, timed before vLLM starts,
whose start-up would take the cores); `weightbus` (a push that
changes every tensor, split into the transfer -- bytes into every rank's staging, digests
checked -- and vLLM's own load); `weightbus, attention frozen` (only the MLP and norms change:
the blocks whose bytes did not change are not reloaded); `save + reload` (save_file into
/dev/shm, then vLLM's `reload_weights` of that directory). The split comes from the workers'
log line (`weightbus: version ...`), the only channel vLLM leaves a backend.
"""

import argparse
import contextlib
import functools
import importlib.util
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from weightbus.apps.bench.llama_weights import hf_config, llama_shape, llama_weights
from weightbus.apps.bench.timing import Measurement, measure_interleaved, write_json
from weightbus.apps.bench.vllm_parity import (
    ParityFigures,
    measure_deltas,
    parity_operations,
    report_parity,
    worker_splits,
)
from weightbus.apps.tables import print_table
from weightbus.core.units import format_bytes

MIB = 2**20

_TIMEOUT_S = 300.0
# vLLM's processes spin (sched_yield) for 1 s after every message on their shared-memory queues
# (`shm_broadcast.SpinCondition`, busy_loop_s=1, not configurable): pushes back to back would
# each start while the engine core and both workers spin, which on 2 cores starves the
# publisher. A trainer pushes once per step, seconds apart: each timed operation starts after
# the spin ended.
VLLM_SPIN_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mib", type=int, default=300, help="model size (default 300)")
    parser.add_argument("--tp", type=int, default=2, help="vLLM tensor-parallel size")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (median)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=VLLM_SPIN_S + 0.2,
        help="untimed pause before each timed operation (default: vLLM's spin after a message, "
        "%(default)s s; 0: back to back)",
    )


class _Bench:
    """The served checkpoint, the server, two weight sets and what vLLM serves now."""

    def __init__(self, root: Path, size_bytes: int) -> None:
        from weightbus.engines.vllm.launch import write_word_tokenizer

        self.root = root
        first = dict(llama_weights(size_bytes, torch.bfloat16, seed=0))
        self.sets = [first, dict(llama_weights(size_bytes, torch.bfloat16, seed=1))]
        self.nbytes = sum(t.nbytes for t in first.values())
        model_dir = root / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(hf_config(llama_shape(size_bytes, 2))))
        save_file(first, str(model_dir / "model.safetensors"))
        write_word_tokenizer(model_dir, hf_config(llama_shape(size_bytes, 2))["vocab_size"])
        self.model_dir = model_dir
        self.served = (0, 0)  # (set of attention/embeddings, set of MLP/norms)
        self.history: list[tuple[int, int]] = []  # what weightbus served before (rollbacks)
        self.shm_rank_bytes: list[int] = []
        self.count = 0
        # the versions each kind of push sent (its workers' log lines, read once at the end)
        self.split_versions: dict[str, list[str]] = {
            "full": [],
            "partial": [],
            "verify none": [],
            "nixl": [],
        }
        self.splits: dict[str, list[dict]] = {}
        self.baseline: dict[str, list[float]] = {"save_s": [], "reload_s": []}

    def state(self, served: tuple[int, int]) -> dict[str, torch.Tensor]:
        attention, mlp = (self.sets[i] for i in served)
        return {name: (mlp if _is_mlp(name) else attention)[name] for name in attention}

    def version(self) -> str:
        self.count += 1
        return f"bench-{self.count}"


def _is_mlp(name: str) -> bool:
    return ".mlp." in name or "layernorm" in name


def run(args: argparse.Namespace) -> int:
    from weightbus.engines.vllm.launch import VllmServer

    figures = ParityFigures()
    with tempfile.TemporaryDirectory(prefix="weightbus-bench-vllm-", dir="/dev/shm") as tmp:
        bench = _Bench(Path(tmp), args.size_mib * MIB)
        floor = measure_interleaved([_floor(bench)], max(5, args.repeat))
        bench.server = VllmServer(
            bench.model_dir, tp_size=args.tp, dtype="bfloat16", log_path=bench.root / "vllm.log"
        )
        try:
            bench.server.wait_ready()
            results = floor + _measure(bench, args.repeat, figures, args.settle_s)
            bench.splits = worker_splits(bench.server.log_path, bench.split_versions)
        finally:
            bench.server.stop()
    _report(bench, results, args)
    report_parity(figures, bench.shm_rank_bytes)
    return 0


def _measure(
    bench: "_Bench", repeat: int, figures: ParityFigures, settle_s: float
) -> list[Measurement]:
    from weightbus.core.publisher import Publisher
    from weightbus.engines.vllm.messages import VllmInitInfo
    from weightbus.engines.vllm.target import VllmEngineTarget

    # every target keeps the previous version (the rollback row): the workers hold two copies
    init_info = VllmInitInfo(keep_previous=True)

    def publisher(transport: str = "shm", skip_unchanged: bool = False, **options) -> Publisher:
        target = VllmEngineTarget(
            bench.server.url, init_info=init_info, skip_unchanged=skip_unchanged
        )
        return Publisher([target], transport=transport, timeout_s=_TIMEOUT_S, **options)

    # the frozen-attention push follows a weightbus push in every round: the workers' record
    # of what they loaded is current (the reload row changes it)
    full, partial, two_phase = publisher(), publisher(skip_unchanged=True), publisher()
    dist = publisher("dist", transport_options={"mode": "parts"})
    nixl = publisher("nixl") if importlib.util.find_spec("nixl") else None
    delta, whole = publisher(delta="always"), publisher(delta="never")
    with full, partial, two_phase, dist, nixl or contextlib.nullcontext(), delta, whole:
        dist.init_weights_group("127.0.0.1")
        operations = _operations(bench, full, partial)
        operations[2:2] = parity_operations(bench, two_phase, dist, nixl, figures)
        settle = functools.partial(time.sleep, settle_s)
        results = measure_interleaved(operations, repeat, settle)
        measure_deltas(bench, delta, whole, repeat, figures, settle=settle)
    return results


def _floor(bench: _Bench) -> tuple[str, int, Callable[[], object]]:
    buffers = {name: torch.empty_like(t) for name, t in bench.sets[0].items()}

    def memcpy() -> None:
        for name, tensor in bench.sets[1].items():
            buffers[name].copy_(tensor)

    return ("floor (memcpy)", bench.nbytes, memcpy)


def _operations(bench: _Bench, full, partial) -> list[tuple[str, int, Callable[[], object]]]:
    def push(kind: str) -> Callable[[], None]:
        def run_push() -> None:
            attention, mlp = bench.served
            served = (1 - attention, 1 - mlp) if kind == "full" else (attention, 1 - mlp)
            version = bench.version()
            publisher = full if kind == "full" else partial
            result = publisher.push(bench.state(served), version=version)
            bench.history.append(bench.served)
            bench.served = served
            bench.shm_rank_bytes = result.engines[0].rank_nbytes
            bench.split_versions[kind].append(version)

        return run_push

    def save_and_reload() -> None:
        served = (1 - bench.served[0], 1 - bench.served[1])
        directory = bench.root / "checkpoint"
        directory.mkdir(exist_ok=True)
        tick = time.perf_counter()
        save_file(bench.state(served), str(directory / "model.safetensors"))
        bench.baseline["save_s"].append(time.perf_counter() - tick)
        tick = time.perf_counter()
        _reload_directory(bench.server.url, directory)
        bench.baseline["reload_s"].append(time.perf_counter() - tick)
        bench.served = served

    return [
        ("weightbus shm", bench.nbytes, push("full")),
        ("weightbus shm, attention frozen", bench.nbytes, push("partial")),
        ("save + vLLM reload", bench.nbytes, save_and_reload),
    ]


def _reload_directory(url: str, directory: Path) -> None:
    """What users do today: pause, `reload_weights` from the directory, resume."""
    with httpx.Client(base_url=url, timeout=_TIMEOUT_S) as http:
        http.post("/pause", params={"mode": "wait"}).raise_for_status()
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}}
        http.post("/collective_rpc", json=body).raise_for_status()
        http.post("/resume").raise_for_status()


def _report(bench: _Bench, results: list[Measurement], args: argparse.Namespace) -> None:
    by_name = {m.name: m for m in results}
    floor = by_name["floor (memcpy)"].median_s
    full = by_name["weightbus shm"].median_s
    baseline = by_name["save + vLLM reload"].median_s
    print(
        f"\nvLLM TP {args.tp}, Llama {format_bytes(bench.nbytes)} bf16, "
        f"median of {args.repeat} interleaved rounds, {args.settle_s:g} s untimed before each\n"
    )
    rows = [
        [m.name, f"{m.median_s:.3f}", f"{m.gb_per_s:.2f}", f"{m.median_s / floor:.1f}x"]
        for m in results
    ]
    print_table(["row", "seconds", "GB/s", "vs floor"], rows)
    # the warm-up round is in the splits too: the timed rounds are the last `repeat`
    splits = {kind: values[-args.repeat :] for kind, values in bench.splits.items()}
    print()
    split_rows = [
        [
            kind,
            f"{statistics.median([s['transfer_s'] for s in values]):.3f}",
            f"{statistics.median([s['load_s'] for s in values]):.3f}",
            f"{values[-1]['loaded']}/{values[-1]['tensors']}",
        ]
        for kind, values in splits.items()
    ]
    print_table(["push", "transfer s (rank)", "vLLM load s", "tensors loaded"], split_rows)
    save_s = statistics.median(bench.baseline["save_s"][-args.repeat :])
    reload_s = statistics.median(bench.baseline["reload_s"][-args.repeat :])
    transfer = ", ".join(
        f"{'shm' if kind == 'full' else kind} "
        f"{statistics.median([s['transfer_s'] for s in splits[kind]]) / floor:.1f}x"
        for kind in ("full", "verify none", "nixl")
        if splits[kind]
    )
    print(
        f"\nsave + reload: save {save_s:.3f} s, reload {reload_s:.3f} s\n"
        f"transfer / floor (target <= 2.5x): {transfer}; "
        f"save + reload / weightbus: {baseline / full:.1f}x (target >= 2.5x)"
    )
    if args.json:
        write_json(
            args.json,
            {
                "tp": args.tp,
                "nbytes": bench.nbytes,
                "results": results,
                "splits": splits,
                "baseline": {"save_s": save_s, "reload_s": reload_s},
            },
        )
