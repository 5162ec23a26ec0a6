"""Rank 0's sink of a sharded push over `nixl`: the session as `NixlSink` runs it (hellos,
`TensorsWritten`, end), with every trainer rank posting its own WRITEs (`GroupNixlWriter`)."""

import time
from collections.abc import Mapping

import msgspec
import torch

from weightbus.core.sharded.nixl_write import GroupNixlWriter, NixlTarget, NixlWriteOrder
from weightbus.core.sharded.sink import SharedPush, tell_written
from weightbus.core.sharded.steps import NixlWriteStep
from weightbus.core.transport.base import Progress, PushSession, no_progress
from weightbus.core.transport.nixl.messages import NixlHello
from weightbus.core.transport.nixl.sink import NixlSink, SessionRanks
from weightbus.core.wire import UpdateAbort


class ShardedNixlSink(NixlSink):
    """`nixl` for a trainer group's rank 0 (whole versions: parameters only, no inboxes)."""

    carries_any_tensors = False

    def __init__(self, writer: GroupNixlWriter, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.group_writer = writer
        self.push: SharedPush | None = None

    def stream(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        timeout_s: float,
        progress: Progress = no_progress,
    ) -> None:
        push = self.push
        assert push is not None, "a sharded sink streams only inside a ShardedPublisher push"
        deadline = time.monotonic() + timeout_s
        ranks = SessionRanks(session)
        joined: list[tuple[bytes, NixlHello]] = []
        try:
            ranks.wait_until_complete(
                lambda what, anyway: self._receive(ranks, deadline, what, anyway)
            )
            joined = ranks.ordered()
            self._write(
                session, push, ranks=ranks, joined=joined, deadline=deadline, progress=progress
            )
        except Exception as exc:
            reason = f"publisher failed: {type(exc).__name__}: {exc}"
            identities = [identity for identity, _ in (joined or ranks.ordered())]
            self._send(identities, UpdateAbort(session_id=session.session_id, reason=reason))
            raise
        self._send([identity for identity, _ in joined], session.end_message())

    def _write(
        self,
        session: PushSession,
        push: SharedPush,
        *,
        ranks: SessionRanks,
        joined: list[tuple[bytes, NixlHello]],
        deadline: float,
        progress: Progress,
    ) -> None:
        identities = [identity for identity, _ in joined]
        hellos = [hello for _, hello in joined]
        targets = []
        for hello in hellos:
            if hello.target is None:
                raise ValueError(f"engine {hello.group} rank {hello.rank}: {hello.refusal}")
            targets.append(
                NixlTarget(
                    agent_name=hello.agent_name,
                    agent_metadata=hello.agent_metadata,
                    memory_address=hello.memory_address,
                    target=hello.target,
                )
            )
        self._send(identities, msgspec.structs.replace(session.begin_message(), direct=True))
        # no byte lands in a rank's parameters before the rank knows they are being written
        while len(ranks.ready) < len(joined):
            self._receive(ranks, deadline, "every rank to confirm the session")
        order = NixlWriteOrder(
            targets=targets,
            bucket_bytes=session.plan.bucket_bytes,
            plan_hash=session.plan.plan_hash,
            verify=session.verify,
        )
        push.announce(NixlWriteStep(order=order))
        self.group_writer.write(push.key, order, push.layout, push.holdings, deadline)
        outcome = self.group_writer.outcome(push.key, push.layout, order, deadline)
        tell_written(session, push, outcome, identities, socket=self._socket, progress=progress)
