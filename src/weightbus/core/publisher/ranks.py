"""The trainer side of a Publisher: its group of ranks, what each holds, the layout they agree
on, and the words the leader and the others exchange in one collective call.

Every call a Publisher makes collectively (a push, a rollback, an engine joining, a
fingerprint) is a *round*: every rank reports what it holds (`agree`), the leader does the work
that talks to the engines (`lead`), and the other ranks do what it announces, in order
(`follow`: a transport's part of the bytes, a delta's encoding, a NaN/inf check), until the
round's outcome, which every rank returns or raises alike. In a group of one the leader is
alone: `agree` builds the layout from its own holdings, nothing is announced.
"""

import functools
import itertools
import logging
import operator
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec

from weightbus.core.digest import fingerprint_of_metas
from weightbus.core.finite import (
    NOTHING_SENT,
    NonFiniteWeightsError,
    describe_nonfinite,
    nonfinite_error,
)
from weightbus.core.plan import DEFAULT_BUCKET_BYTES, Plan, plan_buckets
from weightbus.core.publisher.results import PushError
from weightbus.core.trainer.boxes import Box
from weightbus.core.trainer.digests import (
    BlockDigests,
    DigestPlan,
    RankDigests,
    Region,
    combine,
    combine_shares,
    compute,
    digest_share,
)
from weightbus.core.trainer.group import ControlMessage, TrainerGroup, TrainerRankError
from weightbus.core.trainer.holdings import Holding
from weightbus.core.trainer.layout import HeldMeta, TrainerLayout, held_metas
from weightbus.core.transport import RankSender, Sending, make_rank_sender
from weightbus.core.transport.sending import RankWork, TransportStep, run_step

logger = logging.getLogger(__name__)

# a follower waits this much longer than the round's bound for the leader's outcome (it answers
# within the bound; a dead leader is noticed at once, through the store's connection)
_OUTCOME_GRACE_S = 30.0
# the leader's close waits this long for the other ranks to read the last outcome
_CLOSE_WAIT_S = 5.0


class _Ready(msgspec.Struct, frozen=True, kw_only=True):
    held: list[HeldMeta]
    tied: list[str]  # heads held bit-equal to their embeddings in the same box


class CheckStep(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The leader's word: look for NaN/inf in what you hold (before a byte moves)."""


class DigestStep(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The leader's word: digest your share of the version (`trainer.digests.digest_share`)."""


class RegionStep(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The leader's word: digest your blocks of these regions (`trainer.digests.compute`)."""

    regions: list[tuple[str, Box]]


class OutcomeStep(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """How the round ended, as every rank returns or raises it."""

    ok: bool
    result: bytes = b""  # the msgpack of what the leader returned
    kind: str = ""  # the type of what the leader raised
    message: str = ""
    failures: dict[str, str] = {}
    transport_error: str | None = None
    aborted: list[str] = []
    version: str = ""
    action: str | None = None


# What the leader may announce; a caller's own step types follow the same rule (`tag=True`).
Step = TransportStep | CheckStep | DigestStep | RegionStep | OutcomeStep
# a caller's step: (the step, the rank's work, the round's streams: name -> (layout, holdings))
StepHandler = Callable[[Any, RankWork, dict], bytes | None]


@dataclass
class Round:
    """One collective call: where its words go on the group, and by when."""

    group: TrainerGroup
    key: str
    deadline: float
    _steps: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def next_key(self) -> str:
        """Where the next announcement goes (steps are read in this order)."""
        return f"{self.key}/step/{next(self._steps)}"

    def announce(self, step: msgspec.Struct) -> str:
        """The leader: tell every other rank `step`; returns the step's key (they report on
        `<key>/done`)."""
        key = self.next_key()
        if self.group.world_size > 1:
            self.group.announce(key, ControlMessage(body=msgspec.msgpack.encode(step)))
        return key


class TrainerRanks:
    """A Publisher's view of its trainer group.

    Args:
        group: the ranks (`TrainerGroup.local()` for one process holding every tensor).
        bucket_bytes: bucket size of the pushes' plans.
    """

    def __init__(self, group: TrainerGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.group = group
        self.bucket_bytes = bucket_bytes
        self._senders: dict[str, RankSender] = {}
        self._layouts: dict[bytes, TrainerLayout] = {}
        self._plan: Plan | None = None
        self._last_round: str | None = None  # the last round whose outcome the leader announced
        self._last_silent: set[int] = set()  # the ranks it waited for in vain in that round

    def plan(self, layout: TrainerLayout) -> Plan:
        """The plan of `layout`'s tensors (reused while they are unchanged)."""
        metas = tuple(layout.metas)
        if self._plan is None or self._plan.metas != metas:
            self._plan = plan_buckets(metas, self.bucket_bytes)
        return self._plan

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def is_leader(self) -> bool:
        return self.group.is_leader

    @property
    def single(self) -> bool:
        return self.group.world_size == 1

    def sender(self, sink: str, transport: str) -> RankSender:
        """This rank's sender of sink `sink` (made on first use; kept for the next pushes)."""
        if sink not in self._senders:
            self._senders[sink] = make_rank_sender(transport, self.group)
        return self._senders[sink]

    def release_senders(self, sinks: list[str]) -> None:
        """Close this rank's senders of sinks the leader freed."""
        for sink in sinks:
            found = self._senders.pop(sink, None)
            if found is not None:
                found.close()

    def begin(self, timeout_s: float) -> Round:
        """The next round, bounded by `timeout_s` (every rank counts rounds alike)."""
        return Round(self.group, self.group.next_push(), time.monotonic() + timeout_s)

    # --- agreeing on the model ---

    def agree(self, round_: Round, holdings: list[Holding], tied: list[str]) -> TrainerLayout:
        """The layout of what every rank holds, the same on every rank (a head every rank
        holding it found tied to its embeddings is left out, as one process drops it).

        Raises:
            TrainerRankError: a rank failed before reporting, died or did not report (named);
                its own error when it failed.
            ValueError: ranks disagree on a tensor, or some part of one is held by no rank.
        """
        key = f"{round_.key}/ready"
        if self.single:
            dropped = set(tied)
            held = [[meta for meta in held_metas(holdings) if meta.name not in dropped]]
        else:
            ready = _Ready(held=held_metas(holdings), tied=tied)
            self.group.report(key, ControlMessage(body=msgspec.msgpack.encode(ready)))
            reports = self.group.collect(key, "shards' metadata", round_.deadline)
            readies = [
                msgspec.msgpack.decode(reports[r].body, type=_Ready) for r in sorted(reports)
            ]
            dropped = _tied_everywhere(readies)
            held = [[meta for meta in r.held if meta.name not in dropped] for r in readies]
            # every rank reported on this round: all of them are done reading the earlier ones
            self.group.forget_earlier_pushes()
        encoded = msgspec.msgpack.encode(held)
        layout = self._layouts.get(encoded)
        if layout is None:
            layout = TrainerLayout(tuple(tuple(metas) for metas in held))
            self._layouts = {encoded: layout}
        return layout

    def refuse_failure(self, round_: Round, exc: BaseException) -> None:
        """A rank that failed before it reported: tell the others why (they raise
        `TrainerRankError` naming it) before raising its own error."""
        if not self.single:
            self.group.report(f"{round_.key}/ready", ControlMessage.failed(exc))

    # --- the leader ---

    def sending(
        self,
        round_: Round,
        layout: TrainerLayout,
        holdings: dict[str, Holding],
        *,
        refuse_nonfinite: bool = False,
        stream: str = "",
    ) -> Sending:
        """What the leader's sinks hand the ranks in this round (`stream`: which of the round's
        streams they send, `TransportStep.stream`)."""
        return Sending(
            layout=layout,
            holdings=holdings,
            group=self.group,
            next_key=round_.next_key,
            deadline=round_.deadline,
            senders=self.sender,
            refuse_nonfinite=refuse_nonfinite,
            stream=stream,
        )

    def check_nonfinite(
        self,
        round_: Round,
        layout: TrainerLayout,
        holdings: dict[str, Holding],
        outcome: str = NOTHING_SENT,
    ) -> None:
        """The leader: every rank looks for NaN/inf in what it holds (before a byte moves;
        after a stream that refused some, `outcome` says so).

        Raises:
            NonFiniteWeightsError: some rank's tensors hold NaN or inf (each named, with the
                rank in a group of several).
        """
        key = round_.announce(CheckStep())
        found = _nonfinite(layout, holdings, self.rank)
        for found_there in self.collect_reports(round_, key, "NaN/inf check", list[str]):
            found += found_there
        if found:
            raise nonfinite_error(found, outcome)

    def digests(
        self, round_: Round, layout: TrainerLayout, holdings: dict[str, Holding]
    ) -> dict[str, str]:
        """The leader: every tensor's digest, each rank digesting its share (no gather).

        Raises:
            TrainerRankError: a rank failed, died or did not report in time (named).
        """
        key = round_.announce(DigestStep())
        shares = [digest_share(holdings, layout, self.group, key, round_.deadline)]
        shares += self.collect_reports(round_, key, "digests", RankDigests)
        return combine_shares(layout, shares)

    def region_digests(
        self,
        round_: Round,
        layout: TrainerLayout,
        holdings: dict[str, Holding],
        regions: list[Region],
    ) -> list[str]:
        """The leader: the digest of each region, the ranks digesting blocks together."""
        if not regions:
            return []
        step = RegionStep(regions=[(region.name, region.box) for region in regions])
        key = round_.announce(step)
        plan = region_plan(layout, tuple(regions))
        reports = [compute(plan, holdings, self.group, key, round_.deadline)]
        reports += self.collect_reports(round_, key, "region digests", BlockDigests)
        return combine(plan, reports)

    def collect_reports(self, round_: Round, key: str, what: str, kind: Any) -> list[Any]:
        """The leader: the other ranks' reports on step `key`, decoded as `kind`."""
        if self.single:
            return []
        reports = self.group.collect(f"{key}/done", what, round_.deadline, self.group.others)
        return [msgspec.msgpack.decode(message.body, type=kind) for message in reports.values()]

    def fingerprint(
        self, round_: Round, layout: TrainerLayout, holdings: dict[str, Holding]
    ) -> str:
        """The leader: the fingerprint of what the ranks hold (`digests`)."""
        return fingerprint_of_metas(layout.metas, self.digests(round_, layout, holdings))

    def lead(self, round_: Round, work: Callable[[], Any]) -> Any:
        """The leader runs `work` and announces how it ended to the other ranks."""
        try:
            result = work()
        except PushError as exc:
            self._end(round_, _failed(exc, exc.version, exc.failures, exc.transport_error))
            raise
        except BaseException as exc:
            self._end(round_, _failed(exc))
            raise
        self._end(round_, OutcomeStep(ok=True, result=msgspec.msgpack.encode(result)))
        return result

    def _end(self, round_: Round, outcome: OutcomeStep) -> None:
        if not self.single:
            round_.announce(outcome)
            # the others read it and say so (`follow`); `close` waits for that. A round that
            # ended before the leader led it (a rank's weights refused in `hold`) has no
            # outcome to read: no rank would say so
            self._last_round, self._last_silent = round_.key, set(self.group.silent)

    # --- the other ranks ---

    def follow(
        self,
        round_: Round,
        layout: TrainerLayout,
        holdings: dict[str, Holding],
        result_type: Any,
        handlers: dict[type, StepHandler] | None = None,
    ) -> Any:
        """Do what the leader announces until the round's outcome; return or raise it.

        Raises:
            PushError, NonFiniteWeightsError, ValueError: as the leader raised them.
            TrainerRankError: the leader failed otherwise, died or went silent (named).
        """
        deadline = round_.deadline + _OUTCOME_GRACE_S
        types: Any = Step if not handlers else Step | functools.reduce(operator.or_, handlers)
        streams: dict[str, tuple[TrainerLayout, dict[str, Holding]]] = {"": (layout, holdings)}
        try:
            while True:
                key = round_.next_key()
                message = self.group.await_announcement(key, "word on the push", deadline)
                step = msgspec.msgpack.decode(message.body, type=types)
                if isinstance(step, OutcomeStep):
                    return _outcome(step, result_type)
                stream = step.stream if isinstance(step, TransportStep) else ""
                held_layout, held = streams[stream]
                work = RankWork(
                    holdings=held, layout=held_layout, group=self.group, key=key, deadline=deadline
                )
                with _reported_elsewhere():
                    self._follow_step(step, work, streams, handlers or {})
        finally:  # the leader keeps the store up until every rank read the outcome (`close`)
            self.group.report(f"{round_.key}/read", ControlMessage())

    def _follow_step(
        self, step: Any, work: RankWork, streams: dict, handlers: dict[type, StepHandler]
    ) -> None:
        """Do one announced step and report it on `<key>/done` (or why it failed)."""
        if isinstance(step, TransportStep):
            run_step(step, self.sender, work)
            return
        layout, holdings, group, key = work.layout, work.holdings, self.group, work.key

        def run() -> bytes:
            if isinstance(step, CheckStep):
                return msgspec.msgpack.encode(_nonfinite(layout, holdings, self.rank))
            if isinstance(step, DigestStep):
                share = digest_share(holdings, layout, group, key, work.deadline)
                return msgspec.msgpack.encode(share)
            if isinstance(step, RegionStep):
                regions = tuple(Region(name, box) for name, box in step.regions)
                plan = region_plan(layout, regions)
                return msgspec.msgpack.encode(compute(plan, holdings, group, key, work.deadline))
            return handlers[type(step)](step, work, streams) or b""

        group.answer(f"{key}/done", run)

    def close(self) -> None:
        """Free every sender (the leader: once every rank read the last outcome it announced,
        or `_CLOSE_WAIT_S` passed; its store serves them). A rank the leader waited for in vain
        in that round (dead, or stuck) is not waited for again."""
        if self.is_leader and not self.single and self._last_round is not None:
            self.group.report(f"{self._last_round}/read", ControlMessage())
            readers = [r for r in range(self.group.world_size) if r not in self._last_silent]
            try:
                deadline = time.monotonic() + _CLOSE_WAIT_S
                self.group.collect(
                    f"{self._last_round}/read", "read of the outcome", deadline, readers
                )
            except TrainerRankError as exc:
                logger.warning("closing the trainer group's store anyway: %s", exc)
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()


def _tied_everywhere(readies: list[_Ready]) -> set[str]:
    """Heads every rank holding them found bit-equal to their embeddings: not sent."""
    holders = Counter(meta.name for ready in readies for meta in ready.held)
    votes = Counter(name for ready in readies for name in ready.tied)
    return {name for name, count in votes.items() if count == holders[name]}


def _nonfinite(layout: TrainerLayout, holdings: dict[str, Holding], rank: int) -> list[str]:
    """The tensors this rank holds with NaN/inf, each with its counts (and its rank, in a
    group of several)."""
    named = [(h.name, h.tensor) for h in holdings.values() if h.name in layout.metas_by_name]
    found = list(describe_nonfinite(named).values())
    if layout.world_size > 1:
        found = [f"{each} on trainer rank {rank}" for each in found]
    return found


def _failed(
    exc: BaseException,
    version: str = "",
    failures: dict[str, str] | None = None,
    transport_error: str | None = None,
) -> OutcomeStep:
    return OutcomeStep(
        ok=False,
        kind=type(exc).__name__,
        message=str(exc),
        failures=failures or {},
        transport_error=transport_error,
        aborted=list(getattr(exc, "aborted", [])),
        version=version,
        action=getattr(exc, "action", None),
    )


def _outcome(step: OutcomeStep, result_type: Any) -> Any:
    """What the leader's outcome makes a follower return or raise."""
    if step.ok:
        return msgspec.msgpack.decode(step.result, type=result_type)
    if step.kind == "PushError":
        raise PushError(
            step.version,
            step.failures,
            step.transport_error,
            aborted=step.aborted,
            action=step.action,
        ) from None
    if step.kind in ("NonFiniteWeightsError", "ValueError", "TypeError"):
        raise {"NonFiniteWeightsError": NonFiniteWeightsError, "ValueError": ValueError}.get(
            step.kind, TypeError
        )(step.message)
    raise TrainerRankError(f"trainer rank 0 failed: {step.kind}: {step.message}")


@contextmanager
def _reported_elsewhere() -> Iterator[None]:
    """A step this rank failed was reported to the leader, which ends the round: the rank
    goes on to read the outcome instead of raising its own error."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - reported; the leader's outcome follows
        logger.warning("this rank's part of the push failed (reported): %s", exc)


@functools.lru_cache(maxsize=8)
def region_plan(layout: TrainerLayout, regions: tuple[Region, ...]) -> DigestPlan:
    """The plan of the blocks of `regions`, kept: a delta digests the same engine slices at
    every push, and the plan is Python over every block (0.2-0.4 s a push for the column
    slices of a 300 MiB model on two vLLM workers)."""
    return DigestPlan(layout, regions)
