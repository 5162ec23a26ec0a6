"""The Publisher: pushes a model version into every engine and waits for their commits.

`Publisher.push` reads as the protocol: `normalize_weights`, `_plan` (a session: the plan,
reused while the layout is unchanged, and the digests), `sink.prepare` (make the session
readable), `_request_all` (every engine target gets its order, in parallel), `_stream` (the sink
sends what is not sent yet), `_collect` (every engine committed the same fingerprint, or one
`PushError` naming each engine that did not and why). No transport is named here: each one's
specifics live behind its sink, each engine's behind its `EngineTarget`.

An atomic push to several engines is two-phase (`two_phase.py`): every engine stages and
verifies, then all commit or none does. `rollback` swaps the fleet back the same way, and
`add_engine` / `remove_engine` change the fleet between pushes (a newcomer is brought to the
fleet's version first, by a push of its own).
"""

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx

from weightbus.core.delta import version_digests
from weightbus.core.meta import is_draft_name
from weightbus.core.plan import DEFAULT_BUCKET_BYTES
from weightbus.core.publisher.delta import (
    DEFAULT_MAX_RATIO,
    DELTA_MODES,
    DeltaMode,
    DeltaPlan,
    DeltaReport,
    DeltaState,
    is_base_refusal,
)
from weightbus.core.publisher.fleet import FleetMembership
from weightbus.core.publisher.probe import LogprobProbe
from weightbus.core.publisher.progress import PushProgress
from weightbus.core.publisher.results import FleetVersion, PushError, PushOptions, PushResult
from weightbus.core.publisher.routes import RoutedSink, normalize_routes
from weightbus.core.publisher.session import NameMap, SessionFactory, Weights, normalize_weights
from weightbus.core.publisher.targets import (
    EngineRequestError,
    EngineResult,
    EngineTarget,
    EngineWeights,
    HttpEngineTarget,
    PushOrder,
)
from weightbus.core.publisher.two_phase import Check, abort_staged, commit_all, settle
from weightbus.core.transport import (
    BucketSink,
    PushSession,
    SourceDescription,
    WeightsGroupInfo,
    encode_description,
    make_sink,
)
from weightbus.core.transport.base import Progress
from weightbus.core.wire import PauseMode, VerifyLevel
from weightbus.core.wire.delta import DeltaSpec

logger = logging.getLogger(__name__)

# Bound of the HTTP calls `close` makes (leaving a transport's set-up) and of reading versions.
_CONTROL_TIMEOUT_S = 10.0


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
        else:
            reason = "it committed"
        sink.engine_answered(
            session, url, f"engine {url} answered before the stream ended: {reason}"
        )

    return answered


class Publisher(FleetMembership):
    """Trainer-side handle on a fleet of engines.

    Args:
        engines: the engines to push to: base URLs of engines speaking weightbus's HTTP API
            (the reference engine), or `EngineTarget`s (any mix; one push reaches them all).
            The Publisher closes every target on `close`.
        transport: a registered transport name (`weightbus.core.transport.transport_names()`),
            or each engine's transport by URL (`{url: "shm", url2: "nixl"}`: one push, each
            engine over its own transport; `weightbus.apps.ray` routes by placement).
        bucket_bytes: bucket size of the plan (and of transport buffers).
        token: bearer token of the engines' admin routes (URL engines), if they require one.
        timeout_s: bound of one push on every engine.
        transport_options: keyword arguments of the transport's sink (e.g. `root` for disk);
            with routes, keyword arguments by transport name.
        delta: how pushes go by default (`push(delta=...)`): `never` (whole), `always` (as
            changes to the last version pushed, whenever every engine can take them) or
            `auto` (as changes when they carry at most `delta_max_ratio` of the bytes). With
            deltas on, the Publisher keeps a host copy of the last version pushed
            (`delta_base_nbytes`).
        delta_max_ratio: see `delta`.
        delta_sparse: a delta carries the changed elements of each changed tensor (False:
            changed tensors go whole, only unchanged ones are skipped).

    Attributes:
        fleet_version: what every member serves since this Publisher's last commit (None
            before the first).

    Pushes, rollbacks and membership changes from several threads run one at a time; a joining
    engine's catch-up push runs beside them.

    Raises:
        ValueError: no engines, an unknown transport, or a non-positive timeout.
    """

    def __init__(
        self,
        engines: Sequence[str | EngineTarget],
        *,
        transport: str | Mapping[str, str] = "disk",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        token: str | None = None,
        timeout_s: float = 120.0,
        transport_options: dict[str, Any] | None = None,
        delta: DeltaMode = "never",
        delta_max_ratio: float = DEFAULT_MAX_RATIO,
        delta_sparse: bool = True,
    ) -> None:
        if not engines:
            raise ValueError("engines: give at least one engine URL or target")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.delta = _delta_mode(delta)
        self._delta = DeltaState(delta_max_ratio, delta_sparse)
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self._token = token
        self._transport_options = dict(transport_options or {})
        self._setup_options: dict[str, Any] | None = None
        self._sessions = SessionFactory(bucket_bytes)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(headers=headers)
        self.targets = [self._target(engine) for engine in engines]
        try:
            self._sink: BucketSink
            self.transport: str | dict[str, str]
            if isinstance(transport, str):
                self._sink, self.transport = (
                    make_sink(transport, **self._transport_options),
                    transport,
                )
            else:
                routes = normalize_routes(transport, [target.url for target in self.targets])
                self._sink = RoutedSink(routes, self._transport_options)
                self.transport = self._sink.routes  # one dict: membership changes update both
        except Exception:
            self._http.close()
            raise
        self._pool = self._new_pool()
        self._lock = threading.RLock()
        self.fleet_version: FleetVersion | None = None

    def _target(self, engine: str | EngineTarget) -> EngineTarget:
        return HttpEngineTarget(engine, client=self._http) if isinstance(engine, str) else engine

    def _new_pool(self) -> ThreadPoolExecutor:
        # each engine may have an update and an abort (or a commit) in flight at once
        return ThreadPoolExecutor(max_workers=2 * len(self.targets) + 2, thread_name_prefix="push")

    @property
    def engines(self) -> list[str]:
        """The members' URLs, in push order."""
        return [target.url for target in self.targets]

    @property
    def transports(self) -> set[str]:
        """The transports pushes take (one, or each routed engine's)."""
        return {self.transport} if isinstance(self.transport, str) else set(self.transport.values())

    @property
    def delta_base_nbytes(self) -> int:
        """Host memory held to encode deltas: a copy of the last version pushed (0 with
        deltas off)."""
        return self._delta.base_nbytes

    @property
    def sink(self) -> BucketSink:
        """The transport's sink (e.g. `DistSink.rank_sent_bytes`: per rank, the last push)."""
        return self._sink

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the transport (files, shared memory, sockets, its set-up on the engines), the
        targets and the HTTP connections."""
        self._close_transport()
        for target in self.targets:
            target.close()

    def _close_transport(self) -> None:
        self._sink.close()
        self._pool.shutdown(wait=True)
        self._http.close()

    def setup_transport(self, **options: Any) -> Any:
        """Set the transport up across every engine before pushing (the `dist` weights group:
        `master_addr`, `master_port`, `backend`, `timeout_s`; see `DistSink.setup`). Calling it
        again re-does it (e.g. after a failed push left a weights group broken); membership
        changes re-do it with the same options.

        Returns:
            What the transport's set-up reports (`WeightsGroupInfo` for `dist`; with routes,
            a dict of the reports by transport name).

        Raises:
            ValueError: the transport needs no set-up.
        """
        with self._lock:
            info = self._sink.setup(self.targets, **options)
            self._setup_options = options
            return info

    def teardown_transport(self, timeout_s: float = 60.0) -> None:
        """Undo `setup_transport` here and on every engine."""
        with self._lock:
            self._setup_options = None
            self._sink.teardown(timeout_s)

    def init_weights_group(
        self,
        master_addr: str,
        master_port: int = 0,
        *,
        backend: str = "gloo",
        timeout_s: float = 60.0,
    ) -> WeightsGroupInfo:
        """Form the `dist` weights group (SGLang's name for `setup_transport`): this process is
        rank 0, rank r of engine i is group rank `offset_i + r`.

        Args:
            master_addr: this host's address as the engines reach it.
            master_port: the group store's port (0: a free port from the OS).
            backend: `gloo` (CPU tensors over TCP).
            timeout_s: bound of the group's formation on every member.

        Returns:
            The group's name, size and each engine's first group rank (with routes: in a dict,
            under "dist").

        Raises:
            ValueError: the transport is not `dist`.
            WeightsGroupError: an engine or this process could not join (each one named).
        """
        if "dist" not in self.transports:
            raise ValueError(f"init_weights_group needs transport 'dist', not {self.transport!r}")
        return self.setup_transport(
            master_addr=master_addr, master_port=master_port, backend=backend, timeout_s=timeout_s
        )

    def destroy_weights_group(self, timeout_s: float = 60.0) -> None:
        """Leave the `dist` weights group here and on every engine (`teardown_transport`).

        Raises:
            WeightsGroupError: an engine did not confirm (this process has left regardless).
        """
        self.teardown_transport(timeout_s)

    def engine_weights(self, timeout_s: float = _CONTROL_TIMEOUT_S) -> list[EngineWeights]:
        """The version, fingerprint and status every engine serves now, in engine order.

        Raises:
            EngineRequestError: an engine did not answer.
        """
        futures = [self._pool.submit(target.weights, timeout_s) for target in self.targets]
        return [future.result() for future in futures]

    def fingerprint(self, weights: Weights, name_map: NameMap | None = None) -> str:
        """The fingerprint engines report after a push of `weights` (computed locally)."""
        normalized = normalize_weights(weights, name_map)
        session = self._sessions.session(normalized, "local", None)
        session.ensure_digests(dict(normalized))
        return session.fingerprint

    def set_delta_base(
        self, weights: Weights, *, version: str, name_map: NameMap | None = None
    ) -> str:
        """Take `weights` as the version the engines serve (e.g. the checkpoint they started
        from), so the next push with deltas on may be a delta against it. Engines are checked
        before each delta: one that does not serve it gets the whole version.

        Returns:
            Its fingerprint.
        """
        with self._lock:
            tensors = dict(normalize_weights(weights, name_map))
            digests, fingerprint = version_digests(tensors)
            self._delta.committed_full(tensors, version, fingerprint, digests)
            return fingerprint

    def push(
        self,
        weights: Weights,
        *,
        version: str,
        step: int | None = None,
        pause_mode: PauseMode = "drain",
        atomic: bool = True,
        verify: VerifyLevel = "full",
        force: bool = False,
        name_map: NameMap | None = None,
        progress: Progress | None = None,
        probe: LogprobProbe | None = None,
        two_phase: bool | None = None,
        delta: DeltaMode | None = None,
        keep_draft: bool = False,
    ) -> PushResult:
        """Push `weights` as `version` into every engine; block until all committed.

        Args:
            weights: an `nn.Module`, a state dict, or `(name, tensor)` pairs with HF names.
            version: the new version's name; engines refuse a version they already serve
                unless `force`.
            step: optional increasing training step; engines refuse a step not above theirs.
            pause_mode: `drain`, `in_place` or `abort` (see the design).
            atomic: stage the update and swap at a step boundary (old version serves on failure).
            verify: `full` checks every digest; `none` skips digests only.
            force: re-push the version an engine already serves.
            name_map: renames applied before sending (a name mapped to None is dropped).
            progress: called with the bytes of each part handed to the transport (besides the
                terminal progress bar), on the pushing thread (with routes: on the stream
                thread of the first transport).
            probe: logprobs every engine must reproduce after loading (`LogprobProbe.of_model`
                on the pushed model): catches engines that verified the bytes but serve
                something else. Needs targets that score probes (`VllmEngineTarget`).
            two_phase: every engine stages and verifies, then all commit or none does. None
                (default): two-phase for atomic pushes to several engines when every target
                supports it (else one-phase, logged).
            delta: `never`, `always` or `auto` (None: the Publisher's `delta`). A delta names
                the version it applies to; an engine serving another refuses it and gets the
                whole version in the same call. `PushResult.delta` says how the push went.
            keep_draft: `weights` hold no draft model: engines serving one (speculative
                decoding) keep it. Without it they refuse a push lacking the draft's tensors
                (`draft.` + its names), so a draft never goes stale by accident.

        Returns:
            The committed version, its fingerprint and per-engine results; `gone` names engines
            that failed after the commit point (removed from this Publisher).

        Raises:
            PushError: an engine refused, failed or timed out (each one named with its reason);
                two-phase: no engine committed.
            ValueError: a probe for targets that cannot score one; `two_phase` with an in-place
                push or targets that cannot stage and commit on a later word.
        """
        with self._lock:
            use_two_phase = self._two_phase(two_phase, atomic)
            if probe is not None:
                unable = [t.url for t in self.targets if not t.scores_probes]
                if unable:
                    raise ValueError(f"probe: these engines cannot score a logprob probe: {unable}")
            options = PushOptions(
                pause_mode=pause_mode,
                atomic=atomic,
                verify=verify,
                force=force,
                probe=probe,
                two_phase=use_two_phase,
                keep_draft=keep_draft,
            )
            tensors = dict(normalize_weights(weights, name_map))
            mode = self.delta if delta is None else _delta_mode(delta)
            return self._push(
                tensors, version, step=step, options=options, progress=progress, mode=mode
            )

    def _two_phase(self, requested: bool | None, atomic: bool) -> bool:
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

    def _push(
        self,
        tensors: dict,
        version: str,
        *,
        step: int | None,
        options: PushOptions,
        progress: Progress | None,
        mode: DeltaMode,
    ) -> PushResult:
        """A delta when every engine can take one, else (or after an engine refused the
        delta's base) the whole version; the base then becomes what was pushed."""
        tick = time.perf_counter()
        plan = self._delta.plan(mode, tensors, self.targets, self._sink, _CONTROL_TIMEOUT_S)
        delta_s = time.perf_counter() - tick
        if isinstance(plan, DeltaPlan):
            try:
                result, _ = self._send(
                    plan.stream, version, step=step, options=options, progress=progress, delta=plan
                )
            except PushError as exc:
                if not any(is_base_refusal(reason) for reason in exc.failures.values()):
                    raise
                logger.warning("%s: pushing the whole version instead", exc)
                base = plan.report.base_version
                report = DeltaReport.full(f"refused: {exc}", plan.encoding, base)
                options = dataclasses.replace(options, force=True)  # some may serve it already
            else:
                self._delta.committed_delta(plan, tensors, version)
                return _with_delta(result, plan.report, delta_s)
        else:
            report = plan
        result, session = self._send(
            tensors, version, step=step, options=options, progress=progress, delta=None
        )
        if self._delta.keeps_base(mode):
            self._delta.committed_full(tensors, version, result.fingerprint, session.digests)
        return _with_delta(result, report, delta_s)

    def _send(
        self,
        tensors: dict,
        version: str,
        *,
        step: int | None,
        options: PushOptions,
        progress: Progress | None,
        delta: DeltaPlan | None,
    ) -> tuple[PushResult, PushSession]:
        """One session to every engine: `tensors` travel, engines commit the version (the
        delta's when given, else the tensors' own fingerprint)."""
        start = time.perf_counter()
        phases: dict[str, float] = {}
        session = self._plan(tensors, version, step, options.verify)
        phases["plan_s"] = time.perf_counter() - start
        progress_bar = PushProgress(version, session.plan.total_bytes)
        advance = _both(progress_bar.advance, progress)
        try:
            # prepare + request + stream
            tick = time.perf_counter()
            description = self._sink.prepare(session, tensors, advance)
            phases["prepare_s"] = time.perf_counter() - tick
            specs = {} if delta is None else delta.specs
            futures = self._request_all(session, description, options, specs)
            tick = time.perf_counter()
            stream_error = self._stream(session, tensors, advance)
            phases["stream_s"] = time.perf_counter() - tick
        finally:
            progress_bar.close()
        # collect (two-phase: every engine staged), then commit
        tick = time.perf_counter()
        # a failed stream may have left tensors undigested: no engine can match then
        fingerprint = "(stream failed)"
        if stream_error is None:
            fingerprint = session.fingerprint if delta is None else delta.fingerprint
        staged = self._collect(
            futures,
            version,
            check=self._fingerprint_check(fingerprint),
            two_phase=options.two_phase,
            stream_error=stream_error,
        )
        phases["wait_s"] = time.perf_counter() - tick
        engines, gone = staged, {}
        if options.two_phase:
            tick = time.perf_counter()
            engines, gone = self._commit(staged, version, fingerprint)
            phases["commit_s"] = time.perf_counter() - tick
        self.fleet_version = FleetVersion(version, step, fingerprint)
        seconds = time.perf_counter() - start
        logger.info("pushed %s to %d engine(s) in %.3f s", version, len(engines), seconds)
        result = PushResult(
            version=version,
            fingerprint=fingerprint,
            nbytes=session.plan.total_bytes,
            seconds=seconds,
            engines=engines,
            phases=phases,
            mode=self._sink.mode,
            two_phase=options.two_phase,
            gone=gone,
            sent_bytes=session.sent_bytes,
        )
        return result, session

    def _plan(
        self, tensors: dict, version: str, step: int | None, verify: VerifyLevel
    ) -> PushSession:
        return self._sessions.session(
            list(tensors.items()),
            version,
            step,
            receivers=len(self.targets),
            verify=verify == "full",
            engines=tuple(self.engines),
        )

    def _request_all(
        self,
        session: PushSession,
        description: SourceDescription,
        options: PushOptions,
        deltas: Mapping[str, DeltaSpec],
    ) -> dict[str, Future]:
        """Hand every target its order (in parallel); an early answer abandons the stream."""
        futures = {}
        carries_draft = any(is_draft_name(meta.name) for meta in session.plan.metas)
        for index, target in enumerate(self.targets):
            route = self._sink.route(description, index, options.verify)
            order = PushOrder(
                version=session.version,
                step=session.step,
                transport=route.transport,
                source=encode_description(route.source),
                plan_hash=session.plan.plan_hash,
                pause_mode=options.pause_mode,
                atomic=options.atomic,
                verify=route.verify,
                force=options.force,
                timeout_s=self.timeout_s,
                probe=options.probe,
                two_phase=options.two_phase,
                delta=deltas.get(target.url),
                keep_draft=options.keep_draft,
                carries_draft=carries_draft,
            )
            futures[target.url] = self._pool.submit(target.update, order)
        for url, future in futures.items():
            future.add_done_callback(_abandon_on_answer(self._sink, session, url))
        return futures

    def _stream(self, session: PushSession, tensors: dict, progress: Progress) -> str | None:
        try:
            self._sink.stream(session, tensors, self.timeout_s, progress)
        except (TimeoutError, OSError, ValueError) as exc:
            return f"transport {self._sink.name}: {exc}"
        return None

    def _collect(
        self,
        futures: dict[str, Future],
        version: str,
        *,
        check: Check,
        two_phase: bool,
        stream_error: str | None = None,
        action: str | None = None,
    ) -> list[EngineResult]:
        """Every engine's result (two-phase: staged), or a `PushError` naming each failure
        once the engines that staged were told to discard."""
        settled = settle(
            self._pool, self.targets, futures, version=version, check=check, two_phase=two_phase
        )
        failures = settled.failures
        if stream_error and not failures:
            failures = dict.fromkeys(futures, stream_error)
        if failures:
            aborted = []
            if two_phase:
                aborted = abort_staged(self._pool, self.targets, settled, version)
            raise PushError(version, failures, stream_error, aborted=aborted, action=action)
        return [settled.results[url] for url in futures]

    def _fingerprint_check(self, pushed: str) -> Check:
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

    def _commit(
        self, staged: list[EngineResult], version: str, fingerprint: str
    ) -> tuple[list[EngineResult], dict[str, str]]:
        """Phase two; engines that fail it are past the commit point: they leave the fleet."""
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


def _delta_mode(mode: str) -> DeltaMode:
    if mode not in DELTA_MODES:
        raise ValueError(f"delta must be one of {', '.join(DELTA_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def _with_delta(result: PushResult, report: DeltaReport, delta_s: float) -> PushResult:
    phases = {"delta_s": delta_s, **result.phases}
    report = dataclasses.replace(report, prepare_s=delta_s)
    return dataclasses.replace(
        result, delta=report, phases=phases, seconds=result.seconds + delta_s
    )


def _both(first: Progress, second: Progress | None) -> Progress:
    if second is None:
        return first

    def advance(nbytes: int) -> None:
        first(nbytes)
        second(nbytes)

    return advance
