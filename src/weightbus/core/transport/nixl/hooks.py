"""What a `nixl` sender knows of the engine ranks it writes to, and what the leader's sink
lends its own sender (`RankWork.hooks`) in a group of one, to talk to the engine ranks as the
WRITEs go."""

import math
from collections.abc import Callable
from dataclasses import dataclass

from weightbus.core.transport.base import Progress, no_progress


@dataclass(frozen=True, slots=True)
class Rank:
    """One engine rank of the session: `index` in the schedule (and in the session's order)."""

    index: int
    group: int
    rank: int
    agent_name: str

    def describe(self) -> str:
        return f"engine {self.group} rank {self.rank}"


@dataclass(frozen=True, slots=True)
class InboxSlots:
    """An engine rank's inbox: `slots` slots of `slot_bytes` from `address` in its memory."""

    address: int
    slot_bytes: int
    slots: int


def _tell_nobody(rank_index: int, bucket: int, digests: dict, slices: dict) -> None:
    """`WriteHooks.written` of a rank that tells nothing (the leader tells, later)."""


def _hear_nothing() -> bool:
    return False


def _never_abandoned() -> str | None:
    return None


@dataclass(frozen=True, kw_only=True)
class WriteHooks:
    """What the leader's sink lends its own sender in a group of one (`RankWork.hooks`), to
    talk to the engine ranks as the WRITEs go. The defaults: a rank that tells nothing.

    Attributes:
        written: `(rank index, bucket index, digests, slice digests)`: tell that engine rank
            the bucket's WRITE to it is complete (in bucket order, once per rank and bucket).
        progress: called with each bucket's payload bytes once every rank was told of it.
        acks: `(group, rank, bucket)` of the inbox slots the ranks released, filled by
            `listen`; None: no inbox can be used (no rank hears the engine ranks' acks).
        listen: takes the messages the engine ranks sent since (never waits); True when any
            came.
        abandoned: why the stream stopped (an engine answered), or None.
        deadline: `time.monotonic()` by which the stream must end (the sink's, before the
            engines' own).
    """

    written: Callable[[int, int, dict[str, str], dict[str, str]], None] = _tell_nobody
    progress: Progress = no_progress
    acks: set[tuple[int, int, int]] | None = None
    listen: Callable[[], bool] = _hear_nothing
    abandoned: Callable[[], str | None] = _never_abandoned
    deadline: float = math.inf
