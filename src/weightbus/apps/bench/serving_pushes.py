"""The per-push breakdown of `weightbus bench serving`: each push's stall beside its phases.

For each push that landed: when it started in the run, how long it took as the trainer saw it,
its phases (`PushResult.phases`, in the order the publisher reports them), its stall (the
longest token gap overlapping it) and where that gap lies against the push's start, the stall
in decode steps of the run without pushes, the first token of its version, and the requests it
aborted (those that ended `abort` after it started and before the next one) or that span its
swap (their tokens went on in its version after another one).
"""

import itertools
from dataclasses import asdict, dataclass

from weightbus.apps.bench.serving_load import RequestLog
from weightbus.apps.bench.serving_trainer import PushRecord
from weightbus.apps.tables import print_table


@dataclass
class PushFigures:
    version: str
    at_s: float  # the push's start, from the run's start
    push_s: float
    phases_s: dict[str, float]
    stall_s: float
    stall_gap_s: tuple[float, float]  # the stall's two tokens, from the push's start
    first_new_token_s: float | None
    aborted: int
    spanning: int


def longest_gap_s(
    logs: list[RequestLog], start_s: float, end_s: float
) -> tuple[float, float] | None:
    """The two token arrivals of one request whose gap is the longest of those overlapping
    `[start_s, end_s]`, or None."""
    overlapping = [
        (a, b)
        for log in logs
        for a, b in itertools.pairwise(log.token_times_s)
        if b >= start_s and a <= end_s
    ]
    return max(overlapping, key=lambda gap: gap[1] - gap[0], default=None)


def _first_token_s(logs: list[RequestLog], version: str) -> float | None:
    times = [
        t
        for log in logs
        for t, v in zip(log.token_times_s, log.token_versions, strict=True)
        if v == version
    ]
    return min(times, default=None)


def _swaps_into(log: RequestLog, version: str) -> bool:
    return any(a != b == version for a, b in itertools.pairwise(log.token_versions))


def push_figures(
    logs: list[RequestLog], pushes: list[PushRecord], run_start_s: float
) -> list[PushFigures]:
    """The breakdown of every push of `pushes` that landed, in order."""
    landed = [p for p in pushes if p.error is None]
    next_starts_s = [p.start_s for p in landed[1:]] + [float("inf")]
    rows = []
    for push, next_start_s in zip(landed, next_starts_s[: len(landed)], strict=True):
        gap = longest_gap_s(logs, push.start_s, push.end_s)
        first_s = _first_token_s(logs, push.version)
        aborted = sum(
            log.finish_reason == "abort"
            and log.ended_s is not None
            and push.start_s <= log.ended_s < next_start_s
            for log in logs
        )
        rows.append(
            PushFigures(
                version=push.version,
                at_s=push.start_s - run_start_s,
                push_s=push.end_s - push.start_s,
                phases_s=dict(push.phases),
                stall_s=0.0 if gap is None else gap[1] - gap[0],
                stall_gap_s=(0.0, 0.0)
                if gap is None
                else (gap[0] - push.start_s, gap[1] - push.start_s),
                first_new_token_s=None if first_s is None else first_s - push.start_s,
                aborted=aborted,
                spanning=sum(_swaps_into(log, push.version) for log in logs),
            )
        )
    return rows


def as_dicts(rows: list[PushFigures]) -> list[dict]:
    return [asdict(row) for row in rows]


def _phases_ms(phases_s: dict[str, float]) -> str:
    """Phases of at least 1 ms, in the publisher's order: `pause 105 stream 22 ...`."""
    return " ".join(
        f"{name.removesuffix('_s')} {seconds * 1e3:.0f}"
        for name, seconds in phases_s.items()
        if seconds >= 0.0005
    )


def stall_budget_s(push: PushFigures, step_s: float, steps: int) -> float:
    """What an in-place push may stall: `steps` decode steps and its own commit."""
    return steps * step_s + push.phases_s.get("commit_s", 0.0)


def print_pushes(runs: dict[str, list[PushFigures]], step_s: float, steps: int) -> None:
    """One row per push: `runs` maps a run's name to its pushes' figures; `budget`: the
    stall an in-place push may have (`steps` decode steps + its commit)."""
    headers = [
        "run", "push", "at s", "push ms", "stall ms", "steps", "budget ms",
        "gap ms (from push start)", "first new ms", "aborted", "spanning", "phases ms",
    ]  # fmt: skip
    rows = [
        [
            mode,
            index,
            f"{p.at_s:.1f}",
            f"{p.push_s * 1e3:.0f}",
            f"{p.stall_s * 1e3:.0f}",
            f"{p.stall_s / step_s:.1f}" if step_s else "-",
            f"{stall_budget_s(p, step_s, steps) * 1e3:.0f}" if mode == "in_place" else "",
            f"{p.stall_gap_s[0] * 1e3:+.0f} .. {p.stall_gap_s[1] * 1e3:+.0f}",
            "-" if p.first_new_token_s is None else f"{p.first_new_token_s * 1e3:.0f}",
            p.aborted,
            p.spanning,
            _phases_ms(p.phases_s),
        ]
        for mode, pushes in runs.items()
        for index, p in enumerate(pushes)
    ]
    print_table(headers, rows)
