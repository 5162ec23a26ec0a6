"""`loopback`: a transport defined outside weightbus, for the registry's tests.

The sink keeps each session's tensors in this process (copies, so the trainer may change its
own afterwards); the source hands them to the Receiver in one batch. Its set-up (`sink.setup`)
has every engine rank write a file into a directory (`rank<r>-of-<tp>`), and its tear-down
remove them. It exists to show what a new transport is: a description, a sink, a source, a rank
set-up with its requests, and one `TransportEntry`; nothing else in weightbus changes for it.
"""

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import torch

from weightbus.core.transport import (
    BucketSink,
    BucketSource,
    PushSession,
    RankSetupRequest,
    ReceivedBatch,
    SourceDescription,
    TransportEntry,
)
from weightbus.core.transport.base import EngineLink, Progress, no_progress
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


class LoopbackSink(BucketSink):
    name = "loopback"

    def __init__(self) -> None:
        self._members: tuple[EngineLink, ...] = ()
        self._directory = ""

    def setup(
        self, engines: Sequence[EngineLink], *, directory: str, timeout_s: float = 30.0
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
    rank_setup="loopback_transport:apply_rank_setup",
    setup_request="loopback_transport:LoopbackRequest",
)
