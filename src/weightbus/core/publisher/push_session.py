"""One push session to every member of a fleet: plan → prepare → order → stream → collect.

`PushRun.run` reads as the protocol, one named step each (and, two-phase, `_commit`). No
transport is named here: each one's specifics live behind its sink, each engine's behind its
`EngineTarget`. `push_version` runs a push as a delta when every engine can take one, else as
the whole version; `catch_up` brings a newcomer to the fleet's version before it joins.
"""

import contextlib
import dataclasses
import gc
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import msgspec

from weightbus.core.finite import NonFiniteWeightsError
from weightbus.core.meta import is_draft_name
from weightbus.core.publisher.delta import (
    DeltaMode,
    DeltaPlan,
    DeltaReport,
    DeltaState,
    is_base_refusal,
)
from weightbus.core.publisher.fleet import Fleet
from weightbus.core.publisher.phases import StepTimes, phase_breakdown
from weightbus.core.publisher.probe import LogprobProbe
from weightbus.core.publisher.progress import PushProgress
from weightbus.core.publisher.ranks import Round, TrainerRanks
from weightbus.core.publisher.results import FleetVersion, PushError, PushResult
from weightbus.core.publisher.targets import (
    EngineRequestError,
    EngineResult,
    EngineTarget,
    PushOrder,
)
from weightbus.core.trainer.holdings import Holding
from weightbus.core.trainer.layout import TrainerLayout
from weightbus.core.transport import (
    BucketSink,
    PushSession,
    Sending,
    SourceDescription,
    encode_description,
)
from weightbus.core.transport.base import EngineRoute, Progress, no_progress
from weightbus.core.weights import NameMap
from weightbus.core.wire import PauseMode, VerifyLevel
from weightbus.core.wire.adapter import served_fingerprint
from weightbus.core.wire.delta import DeltaSpec
from weightbus.core.wire.order import RunningKV

logger = logging.getLogger(__name__)

# Bound of reading each engine's slice maps and version before a delta.
_DELTA_CHECK_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PushArgs:
    """A push's arguments, as `Publisher.push` takes them (the leader's count)."""

    version: str
    step: int | None = None
    pause_mode: PauseMode = "drain"
    atomic: bool = True
    verify: VerifyLevel = "full"
    force: bool = False
    name_map: NameMap | None = None
    progress: Progress | None = None
    progress_bar: bool = False
    probe: LogprobProbe | None = None
    two_phase: bool | None = None
    delta: DeltaMode | None = None
    keep_draft: bool = False
    allow_nonfinite: bool = False
    adapter: Any = None
    base_fingerprint: str | None = None
    running_kv: RunningKV = "keep"
    keep_prefix_cache: bool = False


@dataclass(frozen=True, slots=True)
class PushRequest:
    """What one push sends and how.

    Attributes:
        layout: what every trainer rank holds of the tensors to send (a delta's stream, for
            a delta session), agreed by the ranks.
        holdings: the leader's own holdings, by HF name (in a group of one: every tensor).
        round: the trainer group's round this push runs in.
        version: the new version's name.
        step: its training step, if any.
        options: the order every engine's is made from (`push_options`).
        progress: also called with the bytes of each part handed to the transport.
        progress_bar: draw a bar of those bytes on stderr when it is a terminal
            (`Publisher(progress=True)`).
        nonfinite_in_stream: the ranks' copies refuse NaN/inf (the Publisher decided it with
            `stream_refuses_nonfinite` and skipped its pre-pass); a delta stream never does.
    """

    layout: TrainerLayout
    holdings: dict[str, Holding]
    round: Round
    version: str
    step: int | None
    options: PushOrder
    progress: Progress | None = None
    progress_bar: bool = False
    nonfinite_in_stream: bool = False
    stream: str = ""

    @classmethod
    def of(
        cls, held: Any, round_: Round, args: PushArgs, options: PushOrder, **more: Any
    ) -> "PushRequest":
        """`args`' push of `held` (a layout and this rank's holdings) in `round_`."""
        return cls(
            held.layout, held.holdings, round_, args.version, args.step, options, args.progress,
            args.progress_bar, **more,
        )  # fmt: skip


def push_options(fleet: Fleet, args: PushArgs) -> PushOrder:
    """A push's options, checked against `fleet`'s members: the order every engine's is made
    from (`engine_order` fills in its transport, source, verify level, plan, timeout and
    delta), `two_phase` decided (`Fleet.two_phase`).

    Raises:
        ValueError: a probe for members that cannot score one; `two_phase` with an in-place
            push or members that cannot stage and commit on a later word.
    """
    fleet.check_probe(args.probe)
    return PushOrder(
        version=args.version,
        step=args.step,
        transport="",  # each engine's route says (`engine_order`)
        source={},
        pause_mode=args.pause_mode,
        atomic=args.atomic,
        verify=args.verify,
        force=args.force,
        probe=args.probe,
        two_phase=fleet.two_phase(args.two_phase, args.atomic),
        keep_draft=args.keep_draft,
        allow_nonfinite=args.allow_nonfinite,
        running_kv=args.running_kv,
        keep_prefix_cache=args.keep_prefix_cache,
    )


def engine_order(
    session: PushSession,
    route: EngineRoute,
    options: PushOrder,
    *,
    timeout_s: float,
    delta: DeltaSpec | None,
    carries_draft: bool,
    peers: list[str] | None = None,
) -> PushOrder:
    """One engine's order for `session`, routed by `route` (`sink.route`) from `options`
    (`push_options`): every order of a push is made here. `delta`: the engine's delta spec
    (None: a whole version); `peers`: a two-phase push's other engines (asked for the outcome
    if the trainer goes silent before the engine's decision)."""
    return msgspec.structs.replace(
        options,
        version=session.version,
        step=session.step,
        transport=route.transport,
        source=encode_description(route.source),
        plan_hash=session.plan.plan_hash,
        verify=route.verify,
        timeout_s=timeout_s,
        delta=delta,
        carries_draft=carries_draft,
        peers=peers or [],
    )


class PushRun:
    """One session to every member of `fleet`: what the ranks hold (`request.layout`) travels,
    the engines commit `request.version` (the delta's fingerprint when `delta` is given, else
    the tensors' own).

    Args:
        fleet: the engines to push to.
        ranks: the trainer group (the leader runs this; every rank sends its part).
        request: what to send, and how.
        delta: the delta plan `request.layout` streams (None: a whole version).
    """

    def __init__(
        self,
        fleet: Fleet,
        ranks: TrainerRanks,
        request: PushRequest,
        delta: DeltaPlan | None = None,
    ) -> None:
        self._fleet = fleet
        self._ranks = ranks
        self._request = request
        self._delta = delta
        self._sending: Sending | None = None
        self._times = StepTimes()
        self._session: PushSession | None = None
        self._bar: PushProgress | None = None
        self._advance: Progress = no_progress
        self._description: SourceDescription | None = None
        self._futures: dict[str, Future] = {}
        self._orders_sent_at = time.monotonic()
        self._stream_error: str | None = None
        self._fingerprint = "(stream failed)"
        self._engines: list[EngineResult] = []
        self._staged: list[EngineResult] = []  # two-phase: the answers before the commit
        self._gone: dict[str, str] = {}

    @property
    def session(self) -> PushSession:
        """The push's session (its digests), once `run` planned it."""
        assert self._session is not None, "the push was not planned"
        return self._session

    def run(self) -> PushResult:
        """Plan, prepare, order, stream, collect (and, two-phase, commit); the fleet's version
        becomes the pushed one.

        Returns:
            The committed version, its fingerprint, per-engine results and each phase's seconds
            (`phases.phase_breakdown`).

        Raises:
            PushError: an engine refused, failed or timed out, or the stream failed (each
                engine named with its reason); two-phase: no engine committed.
        """
        start = time.perf_counter()
        try:
            for name, step in self._steps():
                tick = time.perf_counter()
                step()
                setattr(self._times, name, time.perf_counter() - tick)
        except NonFiniteWeightsError as refused:
            self._answer_refused_stream(refused)
        finally:
            self._close_progress()
        return self._result(time.perf_counter() - start)

    def _steps(self) -> list[tuple[str, Callable[[], None]]]:
        """Each step, under the `StepTimes` field its seconds go to."""
        steps: list[tuple[str, Callable[[], None]]] = [
            ("plan_s", self._plan),
            ("prepare_s", self._prepare),
            ("order_s", self._order),
            ("stream_s", self._stream),
            ("collect_s", self._collect),
        ]
        if self._request.options.two_phase:
            steps.append(("commit_s", self._commit))
        return steps

    def _plan(self) -> None:
        request = self._request
        self._session = PushSession(
            session_id=secrets.token_hex(16),
            version=request.version,
            step=request.step,
            plan=self._ranks.plan(request.layout),
            receivers=len(self._fleet.targets),
            verify=request.options.verify == "full",
            engines=tuple(self._fleet.urls),
        )
        if request.progress_bar:
            total_bytes = self._session.plan.total_bytes
            self._bar = PushProgress.on_terminal(request.version, total_bytes)
        advance = request.progress or no_progress
        self._advance = advance if self._bar is None else _both(self._bar.advance, advance)

    def _prepare(self) -> None:
        request = self._request
        self._sending = self._ranks.sending(
            request.round,
            request.layout,
            request.holdings,
            refuse_nonfinite=request.nonfinite_in_stream and self._delta is None,
            stream=request.stream,
        )
        self._description = self._fleet.sink.prepare(self.session, self._sending, self._advance)

    def _order(self) -> None:
        """Hand every member its order (in parallel); an early answer abandons the stream."""
        session, options, sink = self.session, self._request.options, self._fleet.sink
        assert self._description is not None
        specs = {} if self._delta is None else self._delta.specs
        carries_draft = any(is_draft_name(meta.name) for meta in session.plan.metas)
        orders = {}
        # the peers an engine left undecided asks: the members that can answer
        urls = [t.url for t in self._fleet.targets if t.answers_peers] if options.two_phase else []
        for index, target in enumerate(self._fleet.targets):
            orders[target.url] = engine_order(
                session,
                sink.route(self._description, index, options.verify),
                options,
                timeout_s=self._fleet.timeout_s,
                delta=specs.get(target.url),
                carries_draft=carries_draft,
                peers=[url for url in urls if url != target.url],
            )
        # the engines' bound starts when their order arrives: the stream's, before it
        self._orders_sent_at = time.monotonic()
        self._futures = self._fleet.update_all(orders)
        for url, future in self._futures.items():
            future.add_done_callback(_abandon_on_answer(sink, session, url))

    def _stream(self) -> None:
        """Stream the session; a failure is the stream error every engine is answered with.

        Raises:
            NonFiniteWeightsError: the sink refused NaN/inf as it copied (`run` answers every
                engine first, then raises it).
        """
        sink, sending = self._fleet.sink, self._sending
        assert sending is not None
        started_at = time.perf_counter()
        try:
            # ends before any engine's own wait, so the abort of a failed stream reaches them
            timeout_s = self._fleet.timeout_s - (time.monotonic() - self._orders_sent_at)
            with no_collection():
                sink.stream(self.session, sending, timeout_s, self._advance)
        except (TimeoutError, OSError, ValueError) as exc:
            self._stream_error = f"transport {sink.name}: {exc}"
            if isinstance(exc, NonFiniteWeightsError):
                raise
        finally:
            self._close_progress()
            if self.session.joined_at is not None:
                self._times.joined_s = self.session.joined_at - started_at

    def _answer_refused_stream(self, refused: NonFiniteWeightsError) -> None:
        """The sink refused NaN/inf mid-stream (its ranks were aborted): every engine is
        answered (what staged is discarded), then the refusal is raised, not a `PushError`.

        Raises:
            NonFiniteWeightsError: always (`refused`).
        """
        try:
            self._collect()
        except PushError as failed:
            raise refused from failed
        raise refused

    def _collect(self) -> None:
        """Every engine committed (two-phase: staged) the pushed fingerprint."""
        # a failed stream may have left tensors undigested: no engine can match then
        if self._stream_error is None:
            delta = self._delta
            self._fingerprint = self.session.fingerprint if delta is None else delta.fingerprint
            adapter = self._request.options.adapter
            if adapter is not None:  # the engines report base and adapter as one
                self._fingerprint = served_fingerprint(adapter, self._fingerprint)
        self._engines = self._fleet.collect(
            self._futures,
            self._request.version,
            check=self._fleet.fingerprint_check(self._fingerprint),
            two_phase=self._request.options.two_phase,
            stream_error=self._stream_error,
            at_fault=self.session.at_fault,
        )

    def _commit(self) -> None:
        self._staged = self._engines
        self._engines, self._gone = self._fleet.commit(
            self._engines, self._request.version, self._fingerprint
        )

    def _close_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _phases(self) -> dict[str, float]:
        """Each phase's seconds (`phase_breakdown`): the steps', with the engines' phases."""
        if self._request.options.two_phase:
            answered, committed = self._staged, self._engines
        else:
            answered, committed = self._engines, []
        return phase_breakdown(
            self._times,
            [result.engine_phases for result in answered],
            [result.engine_phases for result in committed],
        )

    def _result(self, seconds: float) -> PushResult:
        request = self._request
        self._fleet.version = FleetVersion(request.version, request.step, self._fingerprint)
        logger.info(
            "pushed %s to %d engine(s) in %.3f s", request.version, len(self._engines), seconds
        )
        return PushResult(
            version=request.version,
            fingerprint=self._fingerprint,
            nbytes=self.session.plan.total_bytes,
            seconds=seconds,
            engines=self._engines,
            phases=self._phases(),
            mode=self._fleet.sink.mode,
            two_phase=request.options.two_phase,
            gone=self._gone,
            sent_bytes=self.session.sent_bytes,
            rank_sent_bytes=list(self._sending.rank_sent) if self._sending else [],
        )


def stream_refuses_nonfinite(fleet: Fleet, options: PushOrder, *, delta: bool) -> bool:
    """Whether a push's NaN/inf check runs in the sink's copies instead of a pre-pass over every
    byte (`refuse_nonfinite`): the sink checks as it copies (`refuses_nonfinite_in_stream`:
    `shm`), the push refuses non-finite values, and a failed stream serves nothing of them: it
    is atomic into engines that stage before they load (bytes land in staging memory they
    discard on a refusal; in place they would land in the live weights) and a whole version (a
    delta streams XOR-encoded bits, which no check of its bytes can judge). A vLLM server
    pauses while it receives, so such a push pauses it for the stream's length; a pass over
    every byte before the stream would cost every push instead (measured 1.0 s of a 1.4 s
    300 MiB push beside vLLM's busy workers)."""
    return (
        bool(getattr(fleet.sink, "refuses_nonfinite_in_stream", False))
        and all(target.stages_before_loading for target in fleet.targets)
        and options.atomic
        and not options.allow_nonfinite
        and not delta
    )


class _Streams:
    """Streams running now, and whether the collector was on before the first of them."""

    lock = threading.Lock()
    running = 0
    collector_was_on = False


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """No automatic garbage collection while a stream runs: the copy threads take the GIL
    between chunks, so a full collection of a trainer's heap (~0.1 s measured) would stall every
    one of them. A stream allocates little; the collector is back on once the last concurrent
    stream (routes stream on several threads) ended, if it was on before."""
    with _Streams.lock:
        if _Streams.running == 0:
            _Streams.collector_was_on = gc.isenabled()
            gc.disable()
        _Streams.running += 1
    try:
        yield
    finally:
        with _Streams.lock:
            _Streams.running -= 1
            if _Streams.running == 0 and _Streams.collector_was_on:
                gc.enable()


def push_version(
    fleet: Fleet,
    ranks: TrainerRanks,
    deltas: DeltaState,
    request: PushRequest,
    mode: DeltaMode,
) -> PushResult:
    """Push `request` as a delta when every engine can take one (`DeltaState.plan`), else (or
    after an engine refused the delta's base) as the whole version; every rank's base then
    becomes what was pushed (`DeltaState.landed`, once the round's outcome is known).

    Returns:
        The push's result, with `delta` saying how it went and why.

    Raises:
        PushError: the push failed (a delta's base refusal is followed by a whole push).
        WeightsGroupError: a `dist` group a failed push left broken could not re-form (each
            member named).
    """
    fleet.repair_setup()
    tick = time.perf_counter()
    plan = deltas.plan(
        mode,
        request,
        targets=fleet.targets,
        sink=fleet.sink,
        ranks=ranks,
        timeout_s=_DELTA_CHECK_TIMEOUT_S,
    )
    delta_s = time.perf_counter() - tick
    report = plan
    if isinstance(plan, DeltaPlan):
        result, report = _push_delta(fleet, ranks, request, plan)
        if result is not None:
            return _with_delta(result, report, delta_s)
        deltas.forget_layouts()  # a refused base may be experts that moved: read them again
        forced = msgspec.structs.replace(request.options, force=True)  # some may serve it already
        request = dataclasses.replace(request, options=forced)
    run = PushRun(fleet, ranks, request)
    result = run.run()
    if deltas.keeps_base(mode):
        deltas.whole_pushed(run.session.digests, result.fingerprint)
    return _with_delta(result, report, delta_s)


def _push_delta(
    fleet: Fleet, ranks: TrainerRanks, request: PushRequest, plan: DeltaPlan
) -> tuple[PushResult | None, DeltaReport]:
    """The delta pushed; or no result, and why, when an engine refused the delta's base (the
    whole version goes next)."""
    delta_request = dataclasses.replace(
        request, layout=plan.layout, holdings=plan.holdings, stream="delta"
    )
    try:
        result = PushRun(fleet, ranks, delta_request, plan).run()
    except PushError as exc:
        if not any(is_base_refusal(reason) for reason in exc.failures.values()):
            raise
        logger.warning("%s: pushing the whole version instead", exc)
        figures = {k: v for k, v in dataclasses.asdict(plan.report).items() if k in _FIGURES}
        return None, DeltaReport.full(f"refused: {exc}", figures, plan.report.base_version)
    return result, plan.report


_FIGURES = ("changed_fraction", "tensors", "stream_bytes", "full_bytes", "encode_s")


def catch_up(
    fleet: Fleet,
    ranks: TrainerRanks,
    target: EngineTarget,
    *,
    round_: Round,
    held: Any,
    route: str | None,
) -> EngineResult:
    """Bring a newcomer to the fleet's version with a push of its own, on a sibling of `fleet`
    (`Fleet.sibling`; in a group of one, pushes to the members go on meanwhile), every rank
    sending what it holds. `target` stays open.

    Args:
        fleet: the fleet it is to join (it has a version).
        ranks: the trainer group.
        target: the newcomer.
        round_: the round of the call.
        held: what the ranks hold of the fleet's version (None: nothing was given).
        route: its transport on a routed fleet (None: the fleet's one transport).

    Returns:
        The newcomer's result.

    Raises:
        ValueError: the weights are missing or are not the fleet's version (checked before a
            byte is sent).
        PushError: the catch-up failed.
    """
    current = fleet.version
    assert current is not None
    if held is None:
        raise ValueError(
            f"weights: the fleet serves version {current.version!r}; pass its weights so "
            f"{target.url} can catch up before it joins"
        )
    fingerprint = ranks.fingerprint(round_, held.layout, held.holdings)
    if fingerprint != current.fingerprint:
        raise ValueError(
            f"weights: fingerprint {fingerprint} is not the fleet's version "
            f"{current.version!r} ({current.fingerprint}): pass the weights pushed last"
        )
    newcomer = fleet.sibling(target, route)
    try:
        args = PushArgs(version=current.version, step=current.step, force=True)
        request = PushRequest.of(held, round_, args, push_options(newcomer, args))
        return PushRun(newcomer, ranks, request).run().engines[0]
    finally:
        ranks.release_senders(newcomer.release())


def _with_delta(result: PushResult, report: DeltaReport, delta_s: float) -> PushResult:
    phases = {"delta_s": delta_s, **result.phases}
    report = dataclasses.replace(report, prepare_s=delta_s)
    return dataclasses.replace(
        result, delta=report, phases=phases, seconds=result.seconds + delta_s
    )


def _abandon_on_answer(
    sink: BucketSink, session: PushSession, url: str
) -> Callable[[Future], None]:
    """A callback for an engine's update: an answer while the stream still runs (a refusal,
    a 503, a dropped connection) means that engine reads no more of it."""

    def answered(future: Future) -> None:
        try:
            future.result()
        except EngineRequestError as exc:
            reason = str(exc)
            if not (session.at_fault or session.abandon_reasons):  # the first cause, no echo
                session.at_fault.add(url)
        else:
            reason = "it committed"
        sink.engine_answered(
            session, url, f"engine {url} answered before the stream ended: {reason}"
        )

    return answered


def _both(first: Progress, second: Progress) -> Progress:
    def advance(nbytes: int) -> None:
        first(nbytes)
        second(nbytes)

    return advance
