"""The trainer group's side of the transport seam: what every trainer rank runs of a push.

The sink (on the leader) hands every rank's `RankSender` the same order with
`Sending.everyone`: the leader's runs it in place (in a group of one nothing is encoded), the
others are told on the group (`TransportStep`), run it, and report. Each rank writes what it
sends (`TrainerLayout.sender`), so no byte is gathered and none leaves twice.
"""

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from weightbus.core.finite import NonFiniteWeightsError
from weightbus.core.trainer.group import ControlMessage, TrainerGroup, TrainerRankError
from weightbus.core.trainer.holdings import Holding
from weightbus.core.trainer.layout import TrainerLayout


@dataclass(slots=True, kw_only=True)
class RankWork:
    """What a rank's sender works on in one step: its holdings, the group's layout, where the
    step's words go on the group (`key`), and by when."""

    holdings: Mapping[str, Holding]
    layout: TrainerLayout
    group: TrainerGroup
    key: str
    deadline: float
    refuse_nonfinite: bool = False
    # the leader's own sender only: what its sink lends it to talk to the engine ranks as it
    # goes (transport-specific: `shm` tells them of each bucket written); None on the other ranks
    hooks: Any = None

    def remaining_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


class RankSender(ABC):
    """A transport's part on one trainer rank (leader or not): writes what the rank sends.
    One per sink and rank, kept across pushes; `order_type` and `report_type` are the msgspec
    types of its orders and reports."""

    order_type: ClassVar[Any]
    report_type: ClassVar[Any]

    def __init__(self, group: TrainerGroup) -> None:
        self.group = group

    @abstractmethod
    def run(self, order: Any, work: RankWork) -> Any:
        """Carry out `order` for this rank; return its report.

        Raises:
            whatever stopped the rank (reported to the leader with its type and reason).
        """

    def close(self) -> None:  # noqa: B027 (optional: most keep nothing to free)
        """Free what the sender kept (mapped files, buffers, agents)."""


class TransportStep(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The leader's word to the other ranks: run `order` with your sender of sink `sink` (a
    transport `transport`) on the tensors of stream `stream` ("": the round's weights;
    "delta": a delta's stream), then report on `<key>/done`."""

    sink: str
    transport: str
    order: bytes
    refuse_nonfinite: bool = False
    stream: str = ""


SenderOf = Callable[[str, str], RankSender]


@dataclass(slots=True, kw_only=True)
class Sending:
    """One push as the leader's sink sees the trainer group: the layout, the leader's own
    holdings, and the group to hand orders to.

    Attributes:
        rank_sent: the tensor bytes each trainer rank handed its transport (filled by the
            sink from the ranks' reports).
    """

    layout: TrainerLayout
    holdings: Mapping[str, Holding]
    group: TrainerGroup
    next_key: Callable[[], str]  # where the round's next announcement goes
    deadline: float
    senders: SenderOf  # the leader's own sender of a sink: (sink key, transport) -> sender
    refuse_nonfinite: bool = False
    stream: str = ""  # which of the round's streams the ranks send (`TransportStep.stream`)
    rank_sent: list[int] = field(default_factory=list)

    def count_sent(self, rank_sent: list[int]) -> None:
        """Add the tensor bytes each rank handed its transport."""
        if len(self.rank_sent) < len(rank_sent):
            self.rank_sent += [0] * (len(rank_sent) - len(self.rank_sent))
        for rank, nbytes in enumerate(rank_sent):
            self.rank_sent[rank] += nbytes

    @property
    def single(self) -> bool:
        """A group of one: the leader sends everything."""
        return self.group.world_size == 1

    def everyone(self, sink: str, transport: str, order: Any, hooks: Any = None) -> list[Any]:
        """Every rank runs `order` with its sender of `sink`; their reports, by rank.

        The leader's own part runs here (`hooks`: callbacks its sender may use); the others
        are told first and collected once it is done.

        Raises:
            TrainerRankError: another rank failed, died or did not report in time (named).
            whatever the leader's own part raised.
        """
        key = self.next_key()
        sender = self.senders(sink, transport)
        if not self.single:
            step = TransportStep(
                sink=sink,
                transport=transport,
                order=msgspec.msgpack.encode(order),
                refuse_nonfinite=self.refuse_nonfinite,
                stream=self.stream,
            )
            self.group.announce(key, ControlMessage(body=msgspec.msgpack.encode(step)))
        work = RankWork(
            holdings=self.holdings,
            layout=self.layout,
            group=self.group,
            key=key,
            deadline=self.deadline,
            refuse_nonfinite=self.refuse_nonfinite,
            hooks=hooks,
        )
        try:
            with self.group.watching(key):
                own = sender.run(order, work)
        except Exception as exc:
            if not self.single:  # the others stop waiting on this rank's part at once
                self.group.report(f"{key}/done", ControlMessage.failed(exc))
            _raise_refusal(exc)
            raise
        if self.single:
            return [own]
        try:
            reports = self.group.collect(
                f"{key}/done", f"part of the {transport} step", self.deadline, self.group.others
            )
        except TrainerRankError as exc:
            _raise_refusal(exc)
            raise
        return [own] + [
            msgspec.msgpack.decode(message.body, type=sender.report_type)
            for message in reports.values()
        ]


def _raise_refusal(exc: BaseException) -> None:
    """Another rank's refusal of NaN/inf in its copies is this push's refusal: raise it as the
    same error (anything else: return, for the caller to raise as it is)."""
    if isinstance(exc, TrainerRankError) and exc.kind == NonFiniteWeightsError.__name__:
        raise NonFiniteWeightsError(exc.reason) from exc


def run_step(step: TransportStep, senders: SenderOf, work: RankWork) -> None:
    """A rank other than the leader: run a `TransportStep` and report it (or why it failed,
    then raise that)."""
    sender = senders(step.sink, step.transport)

    def run() -> bytes:
        order = msgspec.msgpack.decode(step.order, type=sender.order_type)
        return msgspec.msgpack.encode(sender.run(order, work))

    work.refuse_nonfinite = step.refuse_nonfinite
    with work.group.watching(work.key):
        work.group.answer(f"{work.key}/done", run)
