"""`loopback`: a transport defined outside weightbus, for the registry's tests.

The sink keeps each session's tensors in this process (copies, so the trainer may change its
own afterwards); the source hands them to the Receiver in one batch. It exists to show what a
new transport is: a description, a sink, a source, and one `TransportEntry`.
"""

from collections.abc import Iterator, Mapping

import torch

from weightbus.core.transport import (
    BucketSink,
    BucketSource,
    PushSession,
    ReceivedBatch,
    SourceDescription,
    TransportEntry,
)
from weightbus.core.transport.base import Progress, no_progress
from weightbus.core.wire import UpdateBegin, UpdateEnd
from weightbus.core.wire.messages import Hex128

_sessions: dict[str, tuple[UpdateBegin, dict[str, torch.Tensor], dict[str, str], UpdateEnd]] = {}


class LoopbackDescription(SourceDescription, frozen=True):
    session_id: Hex128


class LoopbackSink(BucketSink):
    name = "loopback"

    def prepare(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        progress: Progress = no_progress,
    ) -> LoopbackDescription:
        session.ensure_digests(tensors)
        copies = {meta.name: tensors[meta.name].clone() for meta in session.plan.metas}
        _sessions[session.session_id] = (
            session.begin_message(),
            copies,
            dict(session.digests),
            session.end_message(),
        )
        progress(session.plan.total_bytes)
        return LoopbackDescription(session_id=session.session_id)

    def stream(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        timeout_s: float,
        progress: Progress = no_progress,
    ) -> None:
        """Nothing to stream: `prepare` kept the whole session."""

    def close(self) -> None:
        _sessions.clear()


class LoopbackSource(BucketSource):
    def __init__(self, description: LoopbackDescription, *, rank: int = 0, tp_size: int = 1):
        self.begin_message, self.tensors, self.digests, self.end_message = _sessions[
            description.session_id
        ]

    def begin(self, timeout_s: float) -> UpdateBegin:
        return self.begin_message

    def batches(self, timeout_s: float) -> Iterator[ReceivedBatch]:
        tensors = list(self.tensors.items())
        yield ReceivedBatch(
            tensors=tensors, digests=self.digests, nbytes=sum(t.nbytes for _, t in tensors)
        )

    def end(self, timeout_s: float) -> UpdateEnd:
        return self.end_message


ENTRY = TransportEntry(
    sink="loopback_transport:LoopbackSink",
    source="loopback_transport:LoopbackSource",
    description="loopback_transport:LoopbackDescription",
)
