"""Deadlines of bounded waits: every blocking wait of a transport ends by its push's deadline."""

import time


def remaining_s(deadline: float, what: str) -> float:
    """Seconds left until `deadline` (a `time.monotonic()` value).

    Raises:
        TimeoutError: the deadline has passed (the message names `what` was awaited).
    """
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(f"timed out waiting for {what}")
    return remaining


def remaining_ms(deadline: float, what: str) -> int:
    """Whole milliseconds left until `deadline` (at least 1), for poll timeouts.

    Raises:
        TimeoutError: the deadline has passed.
    """
    return max(1, int(remaining_s(deadline, what) * 1000))
