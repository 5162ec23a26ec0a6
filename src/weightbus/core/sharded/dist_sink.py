"""Rank 0's sink of a sharded push over `dist`: the session as `DistSink` runs it (the weights
group, the hand-shake, the session's messages), with every trainer rank a member of the group
that sends its own parts (`dist_send.GroupDist`).

The group forms on the first push, and again on the push after one that failed (whatever
failed: a rank that died, an engine that refused or lost its side of the group): every trainer
rank joins it (told by rank 0) beside every engine rank, so there is nothing to call before
pushing.
"""

import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from weightbus.core.sharded.control import GroupControl, TrainerRankError
from weightbus.core.sharded.dist_send import DistOrder, GroupDist, JoinOrder, abort
from weightbus.core.sharded.sink import SharedPush
from weightbus.core.sharded.steps import DistJoinStep, DistStep
from weightbus.core.transport.base import EngineLink, Progress, PushSession, no_progress
from weightbus.core.transport.distributed.group import WeightsGroup, get_group, group_names
from weightbus.core.transport.distributed.handshake import start_stream
from weightbus.core.transport.distributed.messages import DEFAULT_GROUP_NAME
from weightbus.core.transport.distributed.sink import DistSink

# how long rank 0 waits, after a failed stream, for the other ranks to say why they stopped
_CAUSE_WAIT_S = 1.0


class ShardedDistSink(DistSink):
    """`dist` for a trainer group's rank 0.

    Args:
        master_addr: rank 0's address as every engine rank and trainer rank reaches it.
        master_port: the group store's port (0: a free port from the OS).
        group_timeout_s: bound of forming the group.
    """

    def __init__(
        self,
        group_dist: GroupDist,
        control: GroupControl,
        *,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = DEFAULT_GROUP_NAME,
        prefetch_depth: int = 1,
        group_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(group_name, mode="auto", prefetch_depth=prefetch_depth)
        self.group_dist = group_dist
        self.control = control
        self.master_addr, self.master_port = master_addr, master_port
        self.group_timeout_s = group_timeout_s
        self.push: SharedPush | None = None
        self._reform = False  # a push failed: form the group again before the next one
        self._live_session: str | None = None  # the session the ranks are sending

    def ensure_group(self, engines: Sequence[EngineLink]) -> None:
        """Form the group with every trainer rank and engine rank, unless it is formed, usable,
        and the last push did not fail.

        Raises:
            WeightsGroupError: an engine or rank 0 could not join (named).
            TrainerRankError: a trainer rank could not join (named).
        """
        push = self.push
        assert push is not None, "a sharded sink forms its group inside a ShardedPublisher push"
        formed = self._members and self.group_name in group_names()
        if formed and not self._reform and self.setup_broken() is None:
            return
        timeout_s = min(self.group_timeout_s, push.deadline - time.monotonic())
        self.setup(
            engines, master_addr=self.master_addr, master_port=self.master_port, timeout_s=timeout_s
        )
        others = range(1, self.control.world_size)
        deadline = time.monotonic() + timeout_s
        self.control.collect(f"{push.key}/join", "join of the weights group", deadline, others)
        self._reform = False

    def _senders(self) -> dict[str, Any]:
        push = self.push
        assert push is not None

        def tell(port: int, world_size: int) -> None:
            order = JoinOrder(
                group_name=self.group_name,
                master_addr=self.master_addr,
                master_port=port,
                world_size=world_size,
                timeout_s=min(self.group_timeout_s, push.deadline - time.monotonic()),
            )
            push.announce(DistJoinStep(order=order))

        return {"senders": self.control.world_size, "store_served": tell}

    def _push_mode(self, group: WeightsGroup) -> Literal["sharded"]:
        del group
        return "sharded"  # every trainer rank sends the parts it holds

    def stream(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        timeout_s: float,
        progress: Progress = no_progress,
    ) -> None:
        push = self.push
        assert push is not None, "a sharded sink streams only inside a ShardedPublisher push"
        try:
            self._stream(session, push, timeout_s, progress)
        except BaseException:
            # whatever failed (an engine that lost its group, a rank that died), the next push
            # forms the group anew rather than find out midway
            self._reform = True
            raise

    def _stream(
        self, session: PushSession, push: SharedPush, timeout_s: float, progress: Progress
    ) -> None:
        group = self._group()
        deadline = time.monotonic() + timeout_s
        start_stream(
            group,
            session.session_id,
            deadline,
            abandoned=lambda: session.abandoned,
            describe_rank=lambda group_rank: self._describe_rank(group, group_rank),
        )
        self._live_session = session.session_id
        try:
            self._send(session, push, group, deadline, progress)
        finally:
            self._live_session = None

    def _send(
        self,
        session: PushSession,
        push: SharedPush,
        group: WeightsGroup,
        deadline: float,
        progress: Progress,
    ) -> None:
        order = DistOrder(
            group_name=self.group_name,
            session_id=session.session_id,
            bucket_bytes=session.plan.bucket_bytes,
            plan_hash=session.plan.plan_hash,
            layouts=[group.layouts[rank] for rank in sorted(group.layouts)],
        )
        push.announce(DistStep(order=order))
        try:
            push.sent_bytes = self.group_dist.run(
                push.key, order, push.layout, push.holdings, deadline,
                session=session, progress=progress,
            ) or []  # fmt: skip
        except Exception as exc:
            cause = self._cause(push.key)
            if cause is None:
                raise
            raise cause from exc

    def engine_answered(self, session: PushSession, url: str, reason: str) -> None:
        """An engine that failed mid-stream (its ranks lost a sender: a trainer rank died)
        ends every member's pending operation at once, instead of at the push's deadline."""
        super().engine_answered(session, url, reason)
        live = session.session_id == self._live_session and self.group_name in group_names()
        if live and session.at_fault:
            abort(get_group(self.group_name), f"engine {url} failed mid-stream: {reason}")

    def _cause(self, key: str) -> TrainerRankError | None:
        """After a failed stream: the trainer ranks that died or failed on their own (not
        because the group broke under them), named, or None."""
        others = range(1, self.control.world_size)
        deadline = time.monotonic() + _CAUSE_WAIT_S
        reasons: dict[int, str] = {}
        for step in (f"{key}/digests", key):
            for rank, error in self.control.failures(step, others, deadline).items():
                if error is None:
                    reasons.setdefault(rank, f"trainer rank {rank} sent no report (dead?)")
                elif not error.startswith(("GroupBrokenError", "TimeoutError")):
                    reasons.setdefault(rank, f"trainer rank {rank} failed: {error}")
        return TrainerRankError("; ".join(reasons[r] for r in sorted(reasons))) if reasons else None
