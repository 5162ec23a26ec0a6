"""`dist`'s leader and the other trainer ranks of a group of N: how they join the weights group
the leader forms, and which of them a failed step failed because of (dead, or failed on their
own rather than because the group broke under them)."""

import time
from collections.abc import Callable
from typing import Any

from weightbus.core.trainer.group import TrainerGroup, TrainerRankError
from weightbus.core.transport.distributed.messages import WeightsGroupError
from weightbus.core.transport.distributed.sender import JoinOrder
from weightbus.core.transport.distributed.setup import JoinSenders
from weightbus.core.transport.sending import RankWork

# How long the leader waits, after a failed step, for the other ranks to say why they stopped.
CAUSE_WAIT_S = 1.0

# Hands every trainer rank an order (`Sending.everyone` of the sink): (order, leader's hooks).
Everyone = Callable[[Any, Any], list]


def joining(
    everyone: Everyone, *, group_name: str, master_addr: str, timeout_s: float
) -> JoinSenders:
    """`form_group`'s `join_senders`: every other trainer rank joins (a `JoinOrder`) while the
    leader's own sender runs the leader's part of forming the group.

    Raises (from the returned function):
        WeightsGroupError: trainer ranks did not join (each named with why).
        TrainerRankError: a trainer rank failed to join or did not report (named).
    """

    def join(port: int, world_size: int, lead: Callable[[], bool]) -> None:
        order = JoinOrder(
            group_name=group_name,
            master_addr=master_addr,
            master_port=port,
            world_size=world_size,
            timeout_s=timeout_s,
        )

        def leader_part(work: RankWork) -> None:
            if not lead():  # the ranks that did not join, named, end the step at once
                missing = silent_ranks(work.group, work.key, "did not join")
                if missing:
                    raise WeightsGroupError(group_name, "initialisation", missing)

        everyone(order, leader_part)

    return join


def silent_ranks(group: TrainerGroup, key: str, what: str) -> dict[str, str]:
    """After a failed step `key`: each other trainer rank that failed it or sent no report
    (within `CAUSE_WAIT_S`), with why."""
    found = group.failures(f"{key}/done", group.others, time.monotonic() + CAUSE_WAIT_S)
    return {
        f"trainer rank {rank}": f"{what} (dead?)" if error is None else error
        for rank, error in found.items()
    }


def failure_cause(group: TrainerGroup, key: str) -> TrainerRankError | None:
    """After a failed step `key`: the trainer ranks that died or failed on their own (not
    because the group broke under them), named, or None."""
    found = group.failures(f"{key}/done", group.others, time.monotonic() + CAUSE_WAIT_S)
    reasons: dict[int, str] = {}
    for rank, error in found.items():
        if error is None:
            reasons[rank] = f"trainer rank {rank} sent no report (dead?)"
        elif not error.startswith(("GroupBrokenError", "TimeoutError")):
            reasons[rank] = f"trainer rank {rank} failed: {error}"
    return TrainerRankError("; ".join(reasons[r] for r in sorted(reasons))) if reasons else None
