"""The fleet a Publisher pushes to: its members (`EngineTarget`s, in push order), the sink that
reaches them (one transport's, or a `RoutedSink`), the thread pool their calls run on, the
transport's set-up (`dist`: one gloo group over every member), and every decision taken over
all of them: settling and committing a push, rollbacks, engines joining and leaving.

An engine joins with a push of its own on a `sibling` (a fleet of the newcomer alone, on a
second sink of the same transport, so pushes to the members go on meanwhile), then `admit`
counts it. Transports with a set-up re-do it with the new membership; the members keep serving
while they do. The caller runs pushes, rollbacks and membership changes one at a time (the
Publisher's lock).
"""

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence, Set
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from weightbus.core.publisher.probe import LogprobProbe
from weightbus.core.publisher.results import FleetVersion, PushError, PushResult
from weightbus.core.publisher.routes import RoutedSink, check_transport, normalize_routes
from weightbus.core.publisher.targets import (
    EngineRequestError,
    EngineResult,
    EngineTarget,
    EngineWeights,
    PushOrder,
    RollbackOrder,
)
from weightbus.core.publisher.two_phase import Check, abort_staged, commit_all, settle
from weightbus.core.transport import BucketSink, Sending, has_setup, make_sink
from weightbus.core.wire import PauseMode

logger = logging.getLogger(__name__)

# Bound of reading every engine's state before a rollback, and of leaving a transport's set-up.
_STATE_TIMEOUT_S = 10.0
_ROLLBACK = "rollback to the previous version"


class Fleet:
    """The engines one Publisher pushes to (see the module docstring).

    Args:
        targets: the members, in push order (`close` closes them).
        sink: the sink that reaches them.
        transport: the transport's name, or the routed sink's routes (the same dict: membership
            changes update both).
        transport_options: keyword arguments of the sink (with routes: by transport name).
        timeout_s: bound of a push, commit or rollback on every engine.

    Attributes:
        version: what every member serves since the last commit (None before the first).
    """

    def __init__(
        self,
        targets: Sequence[EngineTarget],
        sink: BucketSink,
        transport: str | dict[str, str],
        transport_options: dict[str, Any],
        timeout_s: float,
    ) -> None:
        self.targets = list(targets)
        self.sink = sink
        self.transport = transport
        self.timeout_s = timeout_s
        self.version: FleetVersion | None = None
        # how the current call reaches the trainer ranks (set by the leader for each call):
        # a transport whose set-up the ranks join (`dist`) hands them its orders through it
        self.steps: Sending | None = None
        self._transport_options = transport_options
        self._setup_options: dict[str, Any] | None = None
        self._pool = self._new_pool()

    @classmethod
    def build(
        cls,
        targets: Sequence[EngineTarget],
        transport: str | Mapping[str, str],
        transport_options: dict[str, Any],
        timeout_s: float,
    ) -> "Fleet":
        """A fleet of `targets` over `transport`: a registered transport's name, or each
        engine's transport by URL (a `RoutedSink`).

        Raises:
            ValueError: an unknown transport, routes that do not match the targets, or options
                the sink refuses.
        """
        if isinstance(transport, str):
            sink = make_sink(transport, **transport_options)
            return cls(targets, sink, transport, transport_options, timeout_s)
        routes = normalize_routes(transport, [target.url for target in targets])
        routed = RoutedSink(routes, transport_options)
        return cls(targets, routed, routed.routes, transport_options, timeout_s)

    @property
    def urls(self) -> list[str]:
        """The members' URLs, in push order."""
        return [target.url for target in self.targets]

    @property
    def transports(self) -> set[str]:
        """The transports pushes take (one, or each routed engine's)."""
        return {self.transport} if isinstance(self.transport, str) else set(self.transport.values())

    def _new_pool(self) -> ThreadPoolExecutor:
        # each engine may have an update and an abort (or a commit) in flight at once
        return ThreadPoolExecutor(max_workers=2 * len(self.targets) + 2, thread_name_prefix="push")

    def release(self) -> list[str]:
        """Free the sink and the thread pool; the members stay open (a newcomer caught up on
        a sibling joins another fleet).

        Returns:
            The keys of the sinks freed (each trainer rank frees its senders of them).
        """
        keys = self.sink.keys()
        self.sink.close()
        self._pool.shutdown(wait=True)
        return keys

    def close(self) -> None:
        """Free the sink and the thread pool, and close every member."""
        self.release()
        for target in self.targets:
            target.close()

    # --- the transport's set-up ---

    def setup(self, **options: Any) -> Any:
        """Set the transport up across every member; membership changes re-do it with the
        same options.

        Returns:
            What the sink's set-up reports.

        Raises:
            ValueError: the transport needs no set-up.
        """
        info = self.sink.setup(self.targets, steps=self.steps, **options)
        self._setup_options = options
        return info

    def teardown(self, timeout_s: float) -> None:
        """Undo `setup` here and on every member."""
        self._setup_options = None
        self.sink.teardown(timeout_s)

    def _redo_setup(self) -> Any:
        """Re-do the transport's set-up over the members (a `dist` group re-forms).

        Raises:
            WeightsGroupError: as the sink's `setup`; it is left undone (the next push says so).
        """
        assert self._setup_options is not None
        return self.sink.setup(self.targets, steps=self.steps, **self._setup_options)

    def repair_setup(self) -> None:
        """Do the transport's set-up a push needs first (`BucketSink.setup_on_push`: a group
        of several trainer ranks forms its `dist` weights group on its first push), or re-do
        it when a failed push left it broken (members that stopped mid-stream), so the next
        push needs no call from the user.

        Raises:
            WeightsGroupError: the set-up could not (re-)form (each member named with its
                reason: a dead engine is removed with `remove_engine`).
        """
        if self._setup_options is None:
            options = self.sink.setup_on_push(self.steps)
            if options is not None:
                self.setup(**options)
            return
        broken = self.sink.setup_broken()
        if broken is None:
            return
        logger.warning("re-forming the %s set-up before the push (%s)", self.transport, broken)
        self._redo_setup()

    def _redo_setup_or_log(self) -> None:
        """`_redo_setup` where its failure must not hide the outcome being reported."""
        if self._setup_options is None:
            return
        try:
            self._redo_setup()
        except Exception:  # logged: the next push reports the set-up missing
            logger.exception("re-doing the %s set-up over the members failed", self.transport)

    # --- what every member is asked ---

    def engine_weights(self, timeout_s: float) -> list[EngineWeights]:
        """The version, fingerprint and status every member serves now, in push order.

        Raises:
            EngineRequestError: an engine did not answer.
        """
        futures = [self._pool.submit(target.weights, timeout_s) for target in self.targets]
        return [future.result() for future in futures]

    def check_probe(self, probe: LogprobProbe | None) -> None:
        """Raises: ValueError: a probe is given and a member cannot score one."""
        if probe is None:
            return
        unable = [t.url for t in self.targets if not t.scores_probes]
        if unable:
            raise ValueError(f"probe: these engines cannot score a logprob probe: {unable}")

    def two_phase(self, requested: bool | None, atomic: bool) -> bool:
        """Whether a push is two-phase: as `requested`, or (None) when it is atomic, to several
        members, and every member can stage and commit on a later word (else logged).

        Raises:
            ValueError: two-phase is requested for an in-place push, or a member cannot take
                part.
        """
        unable = [t.url for t in self.targets if not t.supports_two_phase]
        if requested:
            if not atomic:
                raise ValueError(
                    "two_phase needs atomic=True: an in-place push writes the live weights, "
                    "so there is nothing to commit on a later word"
                )
            if unable:
                raise ValueError(f"two_phase: these engines cannot stage and commit: {unable}")
            return True
        if requested is None and atomic and len(self.targets) > 1:
            if unable:
                logger.warning("one-phase push: %s cannot take part in a two-phase commit", unable)
                return False
            return True
        return False

    def update_all(self, orders: Mapping[str, PushOrder]) -> dict[str, Future]:
        """Hand every member its order (by URL), in parallel.

        Returns:
            Each member's pending `update`, by URL, in push order.
        """
        return {t.url: self._pool.submit(t.update, orders[t.url]) for t in self.targets}

    # --- settle and commit ---

    def collect(
        self,
        futures: dict[str, Future],
        version: str,
        *,
        check: Check,
        two_phase: bool,
        stream_error: str | None = None,
        action: str | None = None,
        at_fault: Set[str] = frozenset(),
    ) -> list[EngineResult]:
        """Every engine's result (two-phase: staged), in the order of `futures`.

        `at_fault`: the engines the stream failed because of (the session's `at_fault`); the
        others that failed were waiting for them and were aborted.

        Raises:
            PushError: naming each failure (every engine, with `stream_error`, when the stream
                failed and no engine did), once the engines that staged were told to discard;
                `aborted` names those and the engines that waited for one at fault.
        """
        settled = settle(
            self._pool, self.targets, futures, version=version, check=check, two_phase=two_phase
        )
        failures = settled.failures
        if stream_error and not failures:
            failures = dict.fromkeys(futures, stream_error)
        if failures:
            staged = abort_staged(self._pool, self.targets, settled, version) if two_phase else []
            waited = [url for url in failures if at_fault and url not in at_fault]
            aborted = [url for url in futures if url in staged or url in waited]
            raise PushError(version, failures, stream_error, aborted=aborted, action=action)
        return [settled.results[url] for url in futures]

    def fingerprint_check(self, pushed: str) -> Check:
        """A result fails unless it reports `pushed` (targets that cannot report one: theirs
        is the pushed one, which their ranks verified)."""
        targets = {target.url: target for target in self.targets}

        def check(result: EngineResult) -> tuple[EngineResult, str | None]:
            if result.fingerprint is None and not targets[result.url].reports_fingerprint:
                result = dataclasses.replace(result, fingerprint=pushed)
            if result.fingerprint != pushed:
                what = "staged" if result.staged else "committed"
                return result, f"{what} fingerprint {result.fingerprint} != pushed {pushed}"
            return result, None

        return check

    def commit(
        self, staged: list[EngineResult], version: str, fingerprint: str | None
    ) -> tuple[list[EngineResult], dict[str, str]]:
        """Phase two; engines that fail it are past the commit point: they leave the fleet.

        Returns:
            The committed results, and the engines that left (URL -> reason).

        Raises:
            PushError: no engine committed.
        """
        members = {target.url: target for target in self.targets}
        targets = [members[result.url] for result in staged]
        committed, gone = commit_all(
            self._pool, targets, version=version, fingerprint=fingerprint, timeout_s=self.timeout_s
        )
        if not committed:
            raise PushError(version, {url: f"commit: {why}" for url, why in gone.items()})
        for url in gone:
            self._drop(members[url], f"it failed after the commit point of {version!r}")
        if gone:
            self._redo_setup_or_log()  # the push committed: report that, not a set-up failure
        return committed, gone

    # --- rollback ---

    def rollback(self, pause_mode: PauseMode, timeout_s: float | None) -> PushResult:
        """Swap every member back to the previous version (see `Publisher.rollback`).

        Raises:
            PushError: an engine holds no rollback version or another one, refused, or did not
                answer; no engine swapped.
        """
        start = time.perf_counter()
        target = _rollback_target(self._states())
        order = RollbackOrder(
            version=target.version,
            fingerprint=target.fingerprint,
            pause_mode=pause_mode,
            two_phase=len(self.targets) > 1,
            timeout_s=timeout_s or self.timeout_s,
        )
        futures = {t.url: self._pool.submit(t.rollback, order) for t in self.targets}
        engines = self.collect(
            futures,
            target.version,
            check=lambda result: (result, None),
            two_phase=order.two_phase,
            action=f"rollback to version {target.version!r}",
        )
        gone: dict[str, str] = {}
        if order.two_phase:
            engines, gone = self.commit(engines, target.version, target.fingerprint)
        self.version = target
        return PushResult(
            version=target.version,
            fingerprint=target.fingerprint,
            nbytes=0,
            seconds=time.perf_counter() - start,
            engines=engines,
            mode="rollback",
            two_phase=order.two_phase,
            gone=gone,
        )

    def _states(self) -> list[EngineWeights]:
        futures = {t.url: self._pool.submit(t.weights, _STATE_TIMEOUT_S) for t in self.targets}
        states, failures = [], {}
        for url, future in futures.items():
            try:
                states.append(future.result())
            except EngineRequestError as exc:
                failures[url] = str(exc)
        if failures:
            raise PushError("(previous)", failures, action=_ROLLBACK)
        return states

    # --- joining and leaving ---

    def newcomer_route(self, url: str, transport: str | None) -> str | None:
        """The transport of a newcomer `url` on a routed fleet (None on a single-transport one).

        Raises:
            ValueError: `url` is already a member, or the transport is missing, unknown, not
                this fleet's, or one whose set-up is not done.
        """
        if url in self.urls:
            raise ValueError(f"engine {url} is already a member")
        if isinstance(self.transport, str):
            if transport not in (None, self.transport):
                raise ValueError(
                    f"transport: this Publisher pushes over {self.transport!r} only, not "
                    f"{transport!r} (route each engine with transport={{url: name}})"
                )
            return None
        if transport is None:
            raise ValueError(f"transport: name the transport of {url} (this Publisher routes)")
        check_transport(transport)
        if has_setup(transport) and self._setup_options is None:
            raise ValueError(
                f"transport: {transport!r} is set up across engines first: route {url} over "
                f"another transport, or call setup_transport with {transport!r} engines first"
            )
        return transport

    def sibling(self, target: EngineTarget, route: str | None) -> "Fleet":
        """A fleet of `target` alone, on a second sink of this fleet's transport (`route` on
        a routed fleet), its set-up done where the transport has one: a push to it goes on
        beside the members' pushes. `release` it afterwards; `target` stays open.

        Raises:
            ValueError: the sink refuses the options.
            WeightsGroupError: the set-up failed (the sibling is released).
        """
        sink_options, setup_options = self.sink.sibling_options(
            self._transport_options, self._setup_options
        )
        if route is not None and not has_setup(route):
            setup_options = None  # the set-up is another route's
        transport = self.transport if route is None else {target.url: route}
        sibling = Fleet.build([target], transport, sink_options, self.timeout_s)
        sibling.steps = self.steps
        if setup_options is not None:
            try:
                sibling.setup(**setup_options)
            except Exception:
                sibling.release()
                raise
        return sibling

    def admit(
        self, target: EngineTarget, route: str | None, caught_up: FleetVersion | None
    ) -> None:
        """Count `target` as a member, caught up to `caught_up` (the fleet's version then).

        Raises:
            PushError: the fleet moved to another version meanwhile.
            WeightsGroupError: the set-up did not re-form with it (it is not a member; the set-up
                is re-done over the others).
        """
        self._check_unmoved(target.url, caught_up)
        if route is not None:  # its sink exists before the engine counts as a member
            self.sink.add_route(target.url, route, self._transport_options.get(route, {}))
        self.targets.append(target)
        self._resize_pool()
        if self._setup_options is None:
            return
        try:
            self._redo_setup()
        except Exception:
            # the members go on without it; the caller learns why it did not join
            self.targets.remove(target)
            self._forget_route(target.url)
            self._resize_pool()
            self._redo_setup_or_log()
            raise

    def _check_unmoved(self, url: str, caught_up: FleetVersion | None) -> None:
        if self.version == caught_up:
            return
        moved = self.version.version if self.version else None
        raise PushError(
            caught_up.version if caught_up else "(none)",
            {url: f"the fleet moved to version {moved!r} during the catch-up"},
            action=f"catch-up of {url} to version {caught_up.version!r}"
            if caught_up
            else f"adding {url}",
        )

    def remove(self, url: str) -> None:
        """Stop pushing to a member (alive or not); it keeps serving what it serves.

        Raises:
            ValueError: no member has this URL, or it is the last one.
            WeightsGroupError: a `dist` group could not re-form over the other members.
        """
        target = next((t for t in self.targets if t.url == url.rstrip("/")), None)
        if target is None:
            raise ValueError(f"engine {url} is not a member; members: {self.urls}")
        if len(self.targets) == 1:
            raise ValueError(f"engine {url} is the last member: close the Publisher instead")
        self._drop(target, "removed")
        if self._setup_options is not None:
            self._redo_setup()

    def _drop(self, target: EngineTarget, reason: str) -> None:
        """Stop pushing to `target`; the caller re-does the transport's set-up."""
        self.targets.remove(target)
        self._resize_pool()
        logger.warning("engine %s left the fleet: %s", target.url, reason)
        if self._setup_options is not None:
            self._leave_setup(target)
        self._forget_route(target.url)
        target.close()

    def _forget_route(self, url: str) -> None:
        if isinstance(self.sink, RoutedSink):
            self.sink.remove_route(url)

    def _resize_pool(self) -> None:
        old, self._pool = self._pool, self._new_pool()
        old.shutdown(wait=False)

    def _leave_setup(self, target: EngineTarget) -> None:
        try:
            self.sink.teardown_engine(target, _STATE_TIMEOUT_S)
        except EngineRequestError as exc:  # gone, or never joined: nothing to leave
            logger.info("engine %s did not leave the transport set-up: %s", target.url, exc)


def _rollback_target(states: list[EngineWeights]) -> FleetVersion:
    """The previous version every engine holds, or a `PushError` naming each engine that
    holds none or another one."""
    refusals = {
        w.url: f"no previous version is held: {w.rollback_unavailable or 'none reported'}"
        for w in states
        if w.rollback is None
    }
    held = {
        w.url: FleetVersion(w.rollback["version"], w.rollback["step"], w.rollback["fingerprint"])
        for w in states
        if w.rollback is not None
    }
    if not refusals and len(set(held.values())) > 1:
        refusals = {
            url: f"engines hold different previous versions; this one {v.version!r} "
            f"({v.fingerprint})"
            for url, v in held.items()
        }
    if refusals:
        raise PushError("(previous)", refusals, action=_ROLLBACK)
    return next(iter(held.values()))
