"""Fleet-wide decisions of a two-phase push or rollback: every engine commits, or none does.

Phase one is each target's `update` (or `rollback`) with `two_phase`: the engine stages and
verifies, then answers. `settle` waits for every answer; at the first failure it tells every
other engine to abort at once, so staged engines stop holding memory and (in drain mode)
queueing requests while the slow or dead one times out. Phase two, `commit_all`, runs only
when every engine staged the same fingerprint: each commit is a swap that moves no bytes. An
engine that fails its commit is past the commit point: it is reported as gone, and the others
stay committed.
"""

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait

from weightbus.core.publisher.targets import EngineRequestError, EngineResult, EngineTarget

logger = logging.getLogger(__name__)

# Bound of an abort call: an engine that does not answer by then discards on its own when its
# update's `timeout_s` runs out without a decision.
ABORT_TIMEOUT_S = 5.0

# A result as the Publisher records it, and why it fails the push (None: it does not).
Check = Callable[[EngineResult], tuple[EngineResult, str | None]]


class Settled:
    """The answers of phase one: staged results and failures, by engine URL."""

    def __init__(self) -> None:
        self.results: dict[str, EngineResult] = {}
        self.failures: dict[str, str] = {}
        self.aborts: list[Future] = []


def settle(
    pool: ThreadPoolExecutor,
    targets: Sequence[EngineTarget],
    futures: dict[str, Future],
    *,
    version: str,
    check: Check,
    two_phase: bool,
) -> Settled:
    """Wait for every engine's answer; `check` says whether a result fails the push.

    With `two_phase`, the first failure sends every other engine an abort (not awaited here:
    `abort_staged` waits for them).
    """
    settled = Settled()
    urls = {future: url for url, future in futures.items()}
    for future in as_completed(urls):
        url = urls[future]
        try:
            result = future.result()
        except EngineRequestError as exc:
            reason: str | None = str(exc)
        else:
            result, reason = check(result)
            if reason is None:
                settled.results[url] = result
        if reason is None:
            continue
        settled.failures[url] = reason
        if two_phase and not settled.aborts:
            why = f"engine {url} failed: {reason}"
            others = [t for t in targets if t.url != url]
            settled.aborts = [pool.submit(_abort, t, version, why) for t in others]
    # report in the engines' order, not the order they answered
    settled.failures = {url: settled.failures[url] for url in futures if url in settled.failures}
    return settled


def abort_staged(
    pool: ThreadPoolExecutor, targets: Sequence[EngineTarget], settled: Settled, version: str
) -> list[str]:
    """Make sure no engine keeps the version staged: wait for the early aborts, then abort
    every engine that answered "staged" (it may have staged after its early abort arrived).

    Returns:
        The engines that had staged the version and were told to discard it.
    """
    wait(settled.aborts)
    why = "another engine failed: " + "; ".join(
        f"{url}: {reason}" for url, reason in settled.failures.items()
    )
    staged = [t for t in targets if t.url in settled.results]
    wait([pool.submit(_abort, t, version, why) for t in staged])
    return [t.url for t in staged]


def _abort(target: EngineTarget, version: str, reason: str) -> None:
    try:
        target.abort(version, reason, ABORT_TIMEOUT_S)
    except EngineRequestError as exc:
        # nothing pending there (already discarded, failed, or never reached it): harmless
        logger.info("abort of %s on %s: %s", version, target.url, exc)


def commit_all(
    pool: ThreadPoolExecutor,
    targets: Sequence[EngineTarget],
    *,
    version: str,
    fingerprint: str | None,
    timeout_s: float,
) -> tuple[list[EngineResult], dict[str, str]]:
    """Phase two: every engine swaps the staged version in, in parallel.

    Returns:
        The committed results, and the engines that failed past the commit point (gone).
    """
    futures = {
        target.url: pool.submit(target.commit, version, fingerprint, timeout_s)
        for target in targets
    }
    results, gone = [], {}
    for url, future in futures.items():
        try:
            results.append(future.result())
        except EngineRequestError as exc:
            gone[url] = str(exc)
            logger.warning("engine %s failed after the commit point of %s: %s", url, version, exc)
    return results, gone
