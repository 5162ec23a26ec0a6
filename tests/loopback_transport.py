"""`loopback`: a transport defined outside weightbus, for the registry's tests.

The trainer rank's sender copies the tensors it sends (so the trainer may change its own
afterwards) into this process, where the sink keeps each session; the source hands them to the
Receiver in one batch (a session lives in one process: a trainer of one rank). Its set-up
(`sink.setup`) has every engine rank write a file into a directory (`rank<r>-of-<tp>`), and its
tear-down remove them. It exists to show what a new transport is: a description, a sink, a
rank sender, a source, a rank set-up with its requests, and one `TransportEntry`; nothing else
in weightbus changes for it.
"""

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import msgspec
import torch

from weightbus.core.digest import tensor_digest
from weightbus.core.transport import (
    BucketSink,
    BucketSource,
    PushSession,
    RankSender,
    RankSetupRequest,
    ReceivedBatch,
    Sending,
    SourceDescription,
    TransportEntry,
)
from weightbus.core.transport.base import EngineLink, Progress, no_progress
from weightbus.core.transport.sending import RankWork
from weightbus.core.wire import UpdateBegin, UpdateEnd
from weightbus.core.wire.messages import Hex128, SliceSpec

_sessions: dict[str, tuple[UpdateBegin, dict[str, torch.Tensor], dict[str, str], UpdateEnd]] = {}


class LoopbackDescription(SourceDescription, frozen=True):
    session_id: Hex128


class LoopbackSetup(RankSetupRequest, frozen=True, tag="setup", tag_field="kind"):
    """Every rank writes its file into `directory`."""

    directory: str


class LoopbackTeardown(RankSetupRequest, frozen=True, tag="teardown", tag_field="kind"):
    """Every rank removes its file from `directory`."""

    teardown: ClassVar[bool] = True

    directory: str


# what an engine rank's set-up takes
LoopbackRequest = LoopbackSetup | LoopbackTeardown


def apply_rank_setup(
    request: LoopbackSetup | LoopbackTeardown,
    *,
    tp_rank: int,
    tp_size: int,
    slices: list[SliceSpec],
) -> None:
    """Engine rank: write (or remove) `rank<r>-of-<tp>`, holding how many slices the rank has."""
    path = Path(request.directory) / f"rank{tp_rank}-of-{tp_size}"
    if request.teardown:
        path.unlink()
    else:
        path.write_text(str(len(slices)))


class CopyOrder(msgspec.Struct, frozen=True):
    """Copy what you send for session `session_id`."""

    session_id: str


class LoopbackSender(RankSender):
    """A trainer rank's part: copies of the tensors it sends, with their digests."""

    order_type = CopyOrder
    report_type = dict[str, str]

    def run(self, order: CopyOrder, work: RankWork) -> dict[str, str]:
        mine = [name for name, rank in work.layout.senders.items() if rank == self.group.rank]
        copies = {name: work.holdings[name].tensor.clone() for name in mine}
        _copies.setdefault(order.session_id, {}).update(copies)
        return {name: tensor_digest(tensor) for name, tensor in copies.items()}


_copies: dict[str, dict[str, torch.Tensor]] = {}


class LoopbackSink(BucketSink):
    name = "loopback"

    def __init__(self) -> None:
        self._members: tuple[EngineLink, ...] = ()
        self._directory = ""

    def setup(
        self,
        engines: Sequence[EngineLink],
        steps: Sending | None = None,
        *,
        directory: str,
        timeout_s: float = 30.0,
    ) -> None:
        """Every rank of every engine writes its file into `directory`."""
        for engine in engines:
            engine.setup_transport("loopback", LoopbackSetup(directory=directory), timeout_s)
        self._members, self._directory = tuple(engines), directory

    def teardown(self, timeout_s: float) -> None:
        """Every rank of every engine set up removes its file."""
        members, self._members = self._members, ()
        for engine in members:
            engine.teardown_transport(
                "loopback", LoopbackTeardown(directory=self._directory), timeout_s
            )

    def prepare(
        self, session: PushSession, sending: Sending, progress: Progress = no_progress
    ) -> LoopbackDescription:
        for digests in self.everyone(sending, CopyOrder(session.session_id)):
            session.digests.update(digests)
        copies = _copies.pop(session.session_id)
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
        sending: Sending,
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
    sender="loopback_transport:LoopbackSender",
    rank_setup="loopback_transport:apply_rank_setup",
    setup_request="loopback_transport:LoopbackRequest",
)
