"""`weightbus bench vllm`, the rows of vLLM at parity with the reference engine: a two-phase push
(stage on every worker, then commit), a rollback from the workers' second staging copy, a `dist`
parts push (each worker receives only its part of every tensor), and delta pushes against
whole ones -- with the bytes each worker received (its own count, `weightbus_state`).

The two-phase, rollback and dist rows are interleaved with the shm and save + reload rows
(`vllm.py`); the delta rows run after them, in their own rounds, because a delta needs the
version its publisher pushed last to be the one served.
"""

import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from weightbus.apps.tables import print_table
from weightbus.core.units import format_bytes

_WORKER_LINE = re.compile(
    r"weightbus: version (?P<version>\S+): received \d+ bytes in (?P<received>[\d.]+) s "
    r"\(wait (?P<wait>[\d.]+) s, verify (?P<verify>[\d.]+) s, staging (?P<staging>[\d.]+) s\); "
    r"vLLM loaded (?P<loaded>\d+) of (?P<total>\d+) tensors in (?P<load>[\d.]+) s"
)
# Share of each tensor's elements a delta round changes.
DELTA_CHANGED_FRACTION = 0.01


@dataclass
class ParityFigures:
    """What the parity rows measured besides their seconds."""

    rank_bytes: dict[str, list[int]] = field(default_factory=dict)  # row -> bytes per worker
    delta: dict[str, list[float]] = field(default_factory=lambda: {"delta": [], "whole": []})
    delta_bytes: dict[str, int] = field(default_factory=dict)  # stream and full bytes


def parity_operations(
    bench, two_phase, dist, nixl, figures: ParityFigures
) -> list[tuple[str, int, Callable[[], object]]]:
    """Interleaved rows: two-phase push, rollback, dist parts push, an `shm` push whose
    workers trust the publisher's digests (`verify="none"`), nixl push (`bench`:
    vllm._Bench; `nixl` None: NIXL is not installed, no row; the nixl and verify-none pushes'
    versions go to `bench.split_versions`)."""

    def push(publisher, name: str, **options) -> Callable[[], None]:
        def run_push() -> None:
            served = (1 - bench.served[0], 1 - bench.served[1])
            version = bench.version()
            result = publisher.push(bench.state(served), version=version, **options)
            bench.history.append(bench.served)
            bench.served = served
            figures.rank_bytes[name] = result.engines[0].rank_nbytes
            if name in bench.split_versions:
                bench.split_versions[name].append(version)

        return run_push

    def rollback() -> None:
        two_phase.rollback()
        bench.served = bench.history.pop()

    return [
        ("weightbus shm, two-phase (stage, commit)", bench.nbytes, push(two_phase, "two-phase",
                                                                         two_phase=True)),
        ("rollback (second staging copy)", bench.nbytes, rollback),
        ("weightbus dist parts", bench.nbytes, push(dist, "dist parts")),
        ("weightbus shm, verify none", bench.nbytes, push(two_phase, "verify none",
                                                            verify="none")),
    ] + ([("weightbus nixl", bench.nbytes, push(nixl, "nixl"))] if nixl else [])  # fmt: skip


def worker_splits(log_path: Path, versions: dict[str, list[str]]) -> dict[str, list[dict]]:
    """Per kind of push, each of its `versions`' worker line (the last worker's): transfer
    (received) and vLLM load seconds; the log is read once.

    Raises:
        RuntimeError: a version has no worker line.
    """
    lines = {}
    for line in log_path.read_text(errors="replace").splitlines():
        match = _WORKER_LINE.search(line)
        if match:
            lines[match["version"]] = {
                "transfer_s": float(match["received"]),
                "wait_s": float(match["wait"]),
                "verify_s": float(match["verify"]),
                "staging_s": float(match["staging"]),
                "load_s": float(match["load"]),
                "loaded": int(match["loaded"]),
                "tensors": int(match["total"]),
            }
    missing = [v for kind in versions.values() for v in kind if v not in lines]
    if missing:
        raise RuntimeError(f"no worker line for versions {missing} in {log_path}")
    return {kind: [lines[v] for v in kind_versions] for kind, kind_versions in versions.items()}


def measure_deltas(
    bench, delta, whole, repeat: int, figures: ParityFigures, *, settle: Callable[[], object]
) -> None:
    """`repeat` delta pushes of steps that change `DELTA_CHANGED_FRACTION` of every tensor, then
    the same number of whole pushes of such steps (`settle` untimed before each)."""
    state = bench.state(bench.served)
    delta.push(state, version=bench.version(), force=True)  # the base
    for publisher, kind in ((delta, "delta"), (whole, "whole")):
        for _ in range(repeat):
            state = _step(state)
            settle()
            tick = time.perf_counter()
            result = publisher.push(state, version=bench.version())
            figures.delta[kind].append(time.perf_counter() - tick)
            if kind == "delta":
                figures.delta_bytes = {
                    "stream": result.delta.stream_bytes,
                    "full": result.delta.full_bytes,
                }
                if not result.delta.sent:
                    raise RuntimeError(f"the delta round went whole: {result.delta.reason}")


def _step(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of `state` with `DELTA_CHANGED_FRACTION` of each tensor's elements changed."""
    stepped = {}
    for name, tensor in state.items():
        flat = tensor.clone().reshape(-1)
        count = max(1, int(flat.numel() * DELTA_CHANGED_FRACTION))
        where = torch.randint(0, flat.numel(), (count,))
        flat[where] = flat[where] + 0.01
        stepped[name] = flat.view(tensor.shape)
    return stepped


def report_parity(figures: ParityFigures, shm_rank_bytes: list[int]) -> None:
    print()
    rows = [["weightbus shm (direct: each worker's part written into its staging)", shm_rank_bytes]]
    rows += [[name, values] for name, values in figures.rank_bytes.items()]
    print_table(
        ["row", "bytes received per worker"],
        [[name, ", ".join(format_bytes(n) for n in values)] for name, values in rows],
    )
    if figures.delta["delta"]:
        stream, full = figures.delta_bytes["stream"], figures.delta_bytes["full"]
        delta_s = statistics.median(figures.delta["delta"])
        whole_s = statistics.median(figures.delta["whole"])
        print(
            f"\ndeltas ({DELTA_CHANGED_FRACTION:.0%} of elements changed per step): "
            f"{delta_s:.3f} s, {format_bytes(stream)} sent; whole: {whole_s:.3f} s, "
            f"{format_bytes(full)} ({stream / full:.0%} of the bytes)"
        )
