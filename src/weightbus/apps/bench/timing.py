"""Timing and reporting helpers shared by the benchmark suites."""

import gc
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from weightbus.apps.progress import RoundsProgress


@dataclass(frozen=True, slots=True)
class Measurement:
    """Median wall time of one benchmarked operation over `repeat` runs."""

    name: str
    nbytes: int
    seconds: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.median_s / 1e9


def measure_interleaved(
    operations: Sequence[tuple[str, int, Callable[[], object]]],
    repeat: int,
    settle: Callable[[], object] | None = None,
) -> list[Measurement]:
    """Time `(name, nbytes, fn)` operations in rounds, each round running every operation once.

    Interleaving makes the ratios between rows robust to load that comes and goes on a shared
    machine: every operation sees the same conditions. One untimed round warms up first (page
    faults, caches). The objects alive after it are frozen out of the garbage collector, so a
    full collection of the benchmark's own heap never lands inside a timed row. `settle`, if
    given, runs untimed before each timed operation. A terminal shows the round and row running
    (`RoundsProgress`).
    """
    seconds: list[list[float]] = [[] for _ in operations]
    with RoundsProgress(len(operations), repeat) as progress:
        for name, _, fn in operations:
            progress.row(0, name)
            fn()
        gc.collect()
        gc.freeze()
        try:
            for round_index in range(1, repeat + 1):
                for samples, (name, _, fn) in zip(seconds, operations, strict=True):
                    progress.row(round_index, name)
                    if settle is not None:
                        settle()
                    start = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - start)
        finally:
            gc.unfreeze()
    return [
        Measurement(name, nbytes, samples)
        for samples, (name, nbytes, _) in zip(seconds, operations, strict=True)
    ]


def write_json(path: str | Path, payload: dict) -> None:
    """Write a benchmark result as JSON (dataclasses are converted)."""

    def convert(value: object) -> object:
        if isinstance(value, Measurement):
            return {**asdict(value), "median_s": value.median_s, "gb_per_s": value.gb_per_s}
        raise TypeError(f"cannot serialise {type(value).__name__}")

    Path(path).write_text(json.dumps(payload, indent=2, default=convert) + "\n")
