"""The fleet side of a Publisher: rollback, and engines joining and leaving between pushes.

`FleetMembership` is mixed into `Publisher` (it uses the Publisher's targets, lock, pool, sink
and `fleet_version`):

- `rollback` swaps every engine back to the previous version its staging memory still holds,
  two-phase like a push: no bytes move, and no engine swaps unless all can.
- `add_engine` brings a newcomer to the fleet's version with a push of its own (a second sink of
  the same transport, so pushes to the members go on meanwhile), then counts it as a member.
- `remove_engine` stops pushing to one. Transports with a set-up (`dist`: one gloo group over
  every member) re-do it with the new membership; the members keep serving while they do.
"""

import logging
import time
from typing import TYPE_CHECKING, Any

from weightbus.core.publisher.results import FleetVersion, PushError, PushResult
from weightbus.core.publisher.routes import check_transport
from weightbus.core.publisher.session import NameMap, Weights
from weightbus.core.publisher.targets import (
    EngineRequestError,
    EngineResult,
    EngineTarget,
    EngineWeights,
    RollbackOrder,
)
from weightbus.core.transport import has_setup
from weightbus.core.wire import PauseMode

if TYPE_CHECKING:
    from weightbus.core.publisher.publisher import Publisher

logger = logging.getLogger(__name__)

# Bound of reading every engine's state before a rollback, and of leaving a transport's set-up.
_STATE_TIMEOUT_S = 10.0
_ROLLBACK = "rollback to the previous version"


class FleetMembership:
    """Rollback and membership of a `Publisher` (see the module docstring)."""

    def rollback(
        self: "Publisher", *, pause_mode: PauseMode = "drain", timeout_s: float | None = None
    ) -> PushResult:
        """Swap every engine back to the previous version, without moving weights.

        Every engine must hold the same previous version (same fingerprint) in its staging
        memory: it does after an atomic commit, until the next push stages there, an in-place
        push, or a release of the weights memory. With several engines it is two-phase.

        Args:
            pause_mode: how each engine pauses for the swap (as for a push).
            timeout_s: bound on every engine (default: the Publisher's).

        Returns:
            The version the fleet serves again, and per-engine results (`nbytes` 0).

        Raises:
            PushError: an engine holds no rollback version or another one (each named, with
                the engine's reason), refused, or did not answer; no engine swapped.
        """
        with self._lock:
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
            engines = self._collect(
                futures,
                target.version,
                check=lambda result: (result, None),
                two_phase=order.two_phase,
                action=f"rollback to version {target.version!r}",
            )
            gone: dict[str, str] = {}
            if order.two_phase:
                engines, gone = self._commit(engines, target.version, target.fingerprint)
            self.fleet_version = target
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

    def _states(self: "Publisher") -> list[EngineWeights]:
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

    def add_engine(
        self: "Publisher",
        engine: "str | EngineTarget",
        weights: Weights | None = None,
        *,
        name_map: NameMap | None = None,
        transport: str | None = None,
    ) -> EngineResult | None:
        """Add an engine to the fleet, brought to the fleet's version first.

        The catch-up is a push to the newcomer alone, on a second sink of the same transport:
        pushes to the members go on meanwhile. An engine started with
        `--wait-for-initial-weights` serves nothing until it lands. With a transport set-up
        (`dist`), the set-up is then re-done over every member and the newcomer.

        Args:
            engine: the newcomer's URL or target.
            weights: the weights of `fleet_version` (needed once the fleet has one): their
                fingerprint is checked before a byte is sent.
            name_map: as for `push`.
            transport: the newcomer's transport, when the Publisher routes each engine over
                its own (`Publisher(transport={url: name})`), needed there, also for an
                engine that was a member before. A transport with a set-up
                (`dist`) needs it done already (`setup_transport` over its other engines).

        Returns:
            The newcomer's catch-up result (None when the fleet has no version yet).

        Raises:
            ValueError: the engine is already a member, `weights` are missing or are not
                the fleet's version, or a routed Publisher has no transport for it (or an
                unknown one, or one whose set-up is not done).
            PushError: the catch-up failed (the newcomer is not added), or the fleet moved to
                another version meanwhile (add it again with that version's weights).
        """
        target = self._target(engine)
        if target.url in self.engines:
            raise ValueError(f"engine {target.url} is already a member")
        route = self._route_for(target.url, transport)
        current = self.fleet_version
        result = None
        if current is not None:
            result = self._catch_up(target, weights, current, name_map, route)
        with self._lock:
            if self.fleet_version != current:
                moved = self.fleet_version.version if self.fleet_version else None
                raise PushError(
                    current.version if current else "(none)",
                    {target.url: f"the fleet moved to version {moved!r} during the catch-up"},
                    action=f"catch-up of {target.url} to version {current.version!r}"
                    if current
                    else f"adding {target.url}",
                )
            if route is not None:  # its sink exists before the engine counts as a member
                self._sink.add_route(target.url, route, self._transport_options.get(route, {}))
            self.targets.append(target)
            self._resize_pool()
            if self._setup_options is not None:
                try:
                    self._redo_setup()
                except Exception:
                    # the members go on without it; the caller learns why it did not join
                    self.targets.remove(target)
                    self._forget_route(target.url)
                    self._resize_pool()
                    self._redo_setup_or_log()
                    raise
        logger.info("engine %s joined the fleet", target.url)
        return result

    def _catch_up(
        self: "Publisher",
        target: EngineTarget,
        weights: Weights | None,
        current: FleetVersion,
        name_map: NameMap | None,
        route: str | None,
    ) -> EngineResult:
        if weights is None:
            raise ValueError(
                f"weights: the fleet serves version {current.version!r}; pass its weights so "
                f"{target.url} can catch up before it joins"
            )
        sink_options, setup_options = self._sink.sibling_options(
            self._transport_options, self._setup_options
        )
        if route is not None and not has_setup(route):
            setup_options = None  # the set-up is another route's
        catch_up = type(self)(
            [target],
            transport=self.transport if route is None else {target.url: route},
            bucket_bytes=self.bucket_bytes,
            token=self._token,
            timeout_s=self.timeout_s,
            transport_options=sink_options,
        )
        try:
            fingerprint = catch_up.fingerprint(weights, name_map)
            if fingerprint != current.fingerprint:
                raise ValueError(
                    f"weights: fingerprint {fingerprint} is not the fleet's version "
                    f"{current.version!r} ({current.fingerprint}): pass the weights pushed last"
                )
            if setup_options is not None:
                catch_up.setup_transport(**setup_options)
            pushed = catch_up.push(
                weights, version=current.version, step=current.step, force=True, name_map=name_map
            )
        finally:
            catch_up._close_transport()  # the target stays open: it joins this Publisher
        return pushed.engines[0]

    def _route_for(self: "Publisher", url: str, transport: str | None) -> str | None:
        """The newcomer's transport on a routed Publisher (None on a single-transport one)."""
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

    def _forget_route(self: "Publisher", url: str) -> None:
        if not isinstance(self.transport, str):  # `transport` is the routed sink's routes
            self._sink.remove_route(url)

    def remove_engine(self: "Publisher", url: str) -> None:
        """Stop pushing to an engine (alive or not); it keeps serving what it serves.

        Raises:
            ValueError: no member has this URL, or it is the last one.
            WeightsGroupError: a `dist` group could not re-form over the other members (the
                next push says so too; `init_weights_group` re-forms it).
        """
        with self._lock:
            target = next((t for t in self.targets if t.url == url.rstrip("/")), None)
            if target is None:
                raise ValueError(f"engine {url} is not a member; members: {self.engines}")
            if len(self.targets) == 1:
                raise ValueError(f"engine {url} is the last member: close the Publisher instead")
            self._drop(target, "removed")
            if self._setup_options is not None:
                self._redo_setup()

    def _drop(self: "Publisher", target: EngineTarget, reason: str) -> None:
        """Stop pushing to `target`; the caller re-does the transport's set-up."""
        self.targets.remove(target)
        self._resize_pool()
        logger.warning("engine %s left the fleet: %s", target.url, reason)
        if self._setup_options is not None:
            self._leave_setup(target)
        self._forget_route(target.url)
        target.close()

    def _resize_pool(self: "Publisher") -> None:
        old, self._pool = self._pool, self._new_pool()
        old.shutdown(wait=False)

    def _leave_setup(self: "Publisher", target: EngineTarget) -> None:
        try:
            self._sink.teardown_engine(target, _STATE_TIMEOUT_S)
        except EngineRequestError as exc:  # gone, or never joined: nothing to leave
            logger.info("engine %s did not leave the transport set-up: %s", target.url, exc)

    def _redo_setup(self: "Publisher") -> Any:
        """Re-do the transport's set-up over the members (a `dist` group re-forms).

        Raises:
            what the sink's `setup` raises (`WeightsGroupError`): it is left undone, and the
            next push says so.
        """
        assert self._setup_options is not None
        return self._sink.setup(self.targets, **self._setup_options)

    def _redo_setup_or_log(self: "Publisher") -> None:
        """`_redo_setup` where its failure must not hide the outcome being reported."""
        if self._setup_options is None:
            return
        try:
            self._redo_setup()
        except Exception:  # logged: the next push reports the set-up missing
            logger.exception("re-doing the %s set-up over the members failed", self.transport)


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
