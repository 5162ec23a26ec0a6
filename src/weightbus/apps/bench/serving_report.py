"""The figures of `weightbus bench serving`, from the requests' token logs and the pushes.

- **stall** of a push: the longest gap between two consecutive tokens of one request, among
  the gaps that overlap the push (from its start to its end, as the trainer saw them);
- **goodput**: tokens per second of the run against the run without pushes;
- **first new token**: from the push's start to the first token of its version;
- **aborted**: requests that ended `abort` (each with its reason), per push;
- **spanning**: requests whose tokens came from more than one version;
- **lost**: requests that got no last chunk (an error, a dropped stream);
- **wrong version**: tokens of a version not yet pushed when they arrived, or older than one
  their request had seen already.
"""

import itertools
import statistics
from dataclasses import dataclass

from weightbus.apps.bench.serving_load import RequestLog
from weightbus.apps.bench.serving_pushes import longest_gap_s
from weightbus.apps.bench.serving_trainer import PushRecord


@dataclass
class RunFigures:
    mode: str
    duration_s: float
    pushes: int
    failed_pushes: int
    tokens: int
    tokens_per_s: float
    requests: int
    stalls_s: list[float]
    first_new_token_s: list[float]
    commit_s: list[float]
    aborted: int
    spanning: int
    lost: int
    wrong_version_tokens: int
    step_s: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def token_gaps_s(logs: list[RequestLog]) -> list[float]:
    """Every gap between two consecutive tokens of one request."""
    return [b - a for log in logs for a, b in itertools.pairwise(log.token_times_s)]


def stall_s(logs: list[RequestLog], start_s: float, end_s: float) -> float:
    """The longest gap between two tokens of one request that overlaps `[start_s, end_s]`."""
    gap = longest_gap_s(logs, start_s, end_s)
    return 0.0 if gap is None else gap[1] - gap[0]


def wrong_version_tokens(logs: list[RequestLog], initial: str, pushes: list[PushRecord]) -> int:
    """Tokens no push order explains: of a version unknown or not yet pushed when they
    arrived (before its push started), or older than a version the same request had already
    seen. (Clocks of two processes cannot say more: a token the old weights produced may be
    read after the push that replaced them ended.)"""
    order = {initial: (0, float("-inf"))}
    for i, push in enumerate(p for p in pushes if p.error is None):
        order[push.version] = (i + 1, push.start_s)
    wrong = 0
    for log in logs:
        newest = -1
        for at, version in zip(log.token_times_s, log.token_versions, strict=True):
            rank, pushed_s = order.get(version, (-1, float("inf")))
            wrong += rank < newest or at < pushed_s
            newest = max(newest, rank)
    return wrong


def figures(
    mode: str,
    logs: list[RequestLog],
    pushes: list[PushRecord],
    *,
    initial: str,
    window_s: tuple[float, float],
) -> RunFigures:
    """The figures of one run over `window_s` (its start and end, `time.time()`)."""
    start_s, end_s = window_s
    landed = [p for p in pushes if p.error is None]
    tokens = sum(start_s <= t <= end_s for log in logs for t in log.token_times_s)
    first_new = []
    for push in landed:
        times = [
            t
            for log in logs
            for t, v in zip(log.token_times_s, log.token_versions, strict=True)
            if v == push.version
        ]
        if times:
            first_new.append(min(times) - push.start_s)
    gaps = token_gaps_s(logs)
    return RunFigures(
        mode=mode,
        duration_s=end_s - start_s,
        pushes=len(landed),
        failed_pushes=len(pushes) - len(landed),
        tokens=tokens,
        tokens_per_s=tokens / (end_s - start_s),
        requests=len(logs),
        stalls_s=[stall_s(logs, p.start_s, p.end_s) for p in landed],
        first_new_token_s=first_new,
        commit_s=[p.phases.get("commit_s", 0.0) for p in landed],
        aborted=sum(log.finish_reason == "abort" for log in logs),
        spanning=sum(len(log.versions) > 1 for log in logs),
        lost=sum(log.finish_reason is None for log in logs),
        wrong_version_tokens=wrong_version_tokens(logs, initial, pushes),
        step_s=statistics.median(gaps) if gaps else 0.0,
    )
