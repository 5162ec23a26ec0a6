"""The Publisher: pushes a model version into every engine and waits for their commits.

`Publisher.push` reads as the protocol: `normalize_weights`, `_plan` (a session: the plan,
reused while the layout is unchanged, and the digests), `sink.prepare` (make the session
readable), `_request_all` (every engine target gets its order, in parallel), `_stream` (the sink
sends what is not sent yet), `_collect` (every engine committed the same fingerprint, or one
`PushError` naming each engine that did not and why). No transport is named here: each one's
specifics live behind its sink, each engine's behind its `EngineTarget`.
"""

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from weightbus.plan import DEFAULT_BUCKET_BYTES
from weightbus.publisher.probe import LogprobProbe
from weightbus.publisher.progress import PushProgress
from weightbus.publisher.session import NameMap, SessionFactory, Weights, normalize_weights
from weightbus.publisher.targets import (
    EngineRequestError,
    EngineResult,
    EngineTarget,
    EngineWeights,
    HttpEngineTarget,
    UpdateOrder,
)
from weightbus.transport import BucketSink, PushSession, SourceDescription, make_sink
from weightbus.transport.base import Progress
from weightbus.transport.dist.messages import WeightsGroupInfo
from weightbus.wire import PauseMode, VerifyLevel

logger = logging.getLogger(__name__)

# Bound of the HTTP calls `close` makes (leaving a transport's set-up) and of reading versions.
_CONTROL_TIMEOUT_S = 10.0


class PushError(RuntimeError):
    """One or more engines did not commit a push.

    Attributes:
        failures: engine URL -> reason.
        transport_error: why the publisher's side of the transport failed, if it did.
    """

    def __init__(
        self, version: str, failures: dict[str, str], transport_error: str | None = None
    ) -> None:
        self.version = version
        self.failures = failures
        self.transport_error = transport_error
        details = "; ".join(f"{url}: {reason}" for url, reason in failures.items())
        if transport_error:
            details += f"; publisher: {transport_error}"
        super().__init__(
            f"push of version {version!r} failed on {len(failures)} engine(s): {details}"
        )


@dataclass(frozen=True, slots=True)
class PushResult:
    """A committed push: every engine serves `version` with `fingerprint`."""

    version: str
    fingerprint: str
    nbytes: int
    seconds: float
    engines: list[EngineResult]
    phases: dict[str, float] = field(default_factory=dict)
    mode: str = ""  # how the bytes travelled: the transport, or "shm direct" / "shm slots"


@dataclass(frozen=True, slots=True, kw_only=True)
class _Options:
    """How engines apply a push (the `push` arguments every order carries)."""

    pause_mode: PauseMode
    atomic: bool
    verify: VerifyLevel
    force: bool
    probe: LogprobProbe | None = None


def _abandon_on_answer(session: PushSession, url: str) -> Callable[[Future], None]:
    """A callback for an engine's update: an answer while the stream still runs (a refusal,
    a 503, a dropped connection) means that engine reads no more of it."""

    def answered(future: Future) -> None:
        try:
            future.result()
        except EngineRequestError as exc:
            reason = str(exc)
        else:
            reason = "it committed"
        session.abandon(f"engine {url} answered before the stream ended: {reason}")

    return answered


class Publisher:
    """Trainer-side handle on a set of engines.

    Args:
        engines: the engines to push to: base URLs of engines speaking weightbus's HTTP API
            (the reference engine), or `EngineTarget`s (any mix; one push reaches them all).
            The Publisher closes every target on `close`.
        transport: a registered transport name (`weightbus.transport.transport_names()`).
        bucket_bytes: bucket size of the plan (and of transport buffers).
        token: bearer token of the engines' admin routes (URL engines), if they require one.
        timeout_s: bound of one push on every engine.
        transport_options: keyword arguments of the transport's sink (e.g. `root` for disk).

    Raises:
        ValueError: no engines, an unknown transport, or a non-positive timeout.
    """

    def __init__(
        self,
        engines: Sequence[str | EngineTarget],
        *,
        transport: str = "disk",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        token: str | None = None,
        timeout_s: float = 120.0,
        transport_options: dict[str, Any] | None = None,
    ) -> None:
        if not engines:
            raise ValueError("engines: give at least one engine URL or target")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.transport = transport
        self.timeout_s = timeout_s
        self._sessions = SessionFactory(bucket_bytes)
        self._sink: BucketSink = make_sink(transport, **(transport_options or {}))
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(headers=headers)
        self.targets = [
            HttpEngineTarget(engine, client=self._http) if isinstance(engine, str) else engine
            for engine in engines
        ]
        self.engines = [target.url for target in self.targets]
        self._pool = ThreadPoolExecutor(max_workers=len(self.targets), thread_name_prefix="push")

    @property
    def sink(self) -> BucketSink:
        """The transport's sink (e.g. `DistSink.sent_bytes`: bytes per rank of the last push)."""
        return self._sink

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the transport (files, shared memory, sockets, its set-up on the engines), the
        targets and the HTTP connections."""
        self._sink.close()
        self._pool.shutdown(wait=True)
        for target in self.targets:
            target.close()
        self._http.close()

    def setup_transport(self, **options: Any) -> Any:
        """Set the transport up across every engine before pushing (the `dist` weights group:
        `master_addr`, `master_port`, `backend`, `timeout_s`; see `DistSink.setup`). Calling it
        again re-does it (e.g. after a failed push left a weights group broken).

        Returns:
            What the transport's set-up reports (`WeightsGroupInfo` for `dist`).

        Raises:
            ValueError: the transport needs no set-up.
        """
        return self._sink.setup(self.targets, **options)

    def teardown_transport(self, timeout_s: float = 60.0) -> None:
        """Undo `setup_transport` here and on every engine."""
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
            The group's name, size and each engine's first group rank.

        Raises:
            ValueError: the transport is not `dist`.
            WeightsGroupError: an engine or this process could not join (each one named).
        """
        if self.transport != "dist":
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
                terminal progress bar), on the pushing thread.
            probe: logprobs every engine must reproduce after loading (`LogprobProbe.of_model`
                on the pushed model): catches engines that verified the bytes but serve
                something else. Needs targets that score probes (`VllmEngineTarget`).

        Returns:
            The committed version, its fingerprint and per-engine results.

        Raises:
            PushError: an engine refused, failed or timed out (each one named with its reason).
            ValueError: a probe for targets that cannot score one.
        """
        start = time.perf_counter()
        if probe is not None:
            unable = [t.url for t in self.targets if not t.scores_probes]
            if unable:
                raise ValueError(f"probe: these engines cannot score a logprob probe: {unable}")
        options = _Options(
            pause_mode=pause_mode, atomic=atomic, verify=verify, force=force, probe=probe
        )
        phases: dict[str, float] = {}
        # normalize + plan
        tensors = dict(normalize_weights(weights, name_map))
        session = self._plan(tensors, version, step, verify)
        phases["plan_s"] = time.perf_counter() - start
        progress_bar = PushProgress(version, session.plan.total_bytes)
        advance = _both(progress_bar.advance, progress)
        try:
            # prepare + request + stream
            tick = time.perf_counter()
            description = self._sink.prepare(session, tensors, advance)
            phases["prepare_s"] = time.perf_counter() - tick
            futures = self._request_all(session, description, options)
            tick = time.perf_counter()
            stream_error = self._stream(session, tensors, advance)
            phases["stream_s"] = time.perf_counter() - tick
        finally:
            progress_bar.close()
        # collect
        tick = time.perf_counter()
        engines = self._collect(session, futures, stream_error)
        phases["wait_s"] = time.perf_counter() - tick
        seconds = time.perf_counter() - start
        logger.info("pushed %s to %d engine(s) in %.3f s", version, len(engines), seconds)
        return PushResult(
            version=version,
            fingerprint=session.fingerprint,
            nbytes=session.plan.total_bytes,
            seconds=seconds,
            engines=engines,
            phases=phases,
            mode=self._sink.mode,
        )

    def _plan(
        self, tensors: dict, version: str, step: int | None, verify: VerifyLevel
    ) -> PushSession:
        return self._sessions.session(
            list(tensors.items()),
            version,
            step,
            receivers=len(self.targets),
            verify=verify == "full",
        )

    def _request_all(
        self, session: PushSession, description: SourceDescription, options: _Options
    ) -> dict[str, Future]:
        """Hand every target its order (in parallel); an early answer abandons the stream."""
        futures = {}
        for index, target in enumerate(self.targets):
            order = UpdateOrder(
                version=session.version,
                step=session.step,
                transport=self.transport,
                source=self._sink.for_engine(description, index),
                plan_hash=session.plan.plan_hash,
                pause_mode=options.pause_mode,
                atomic=options.atomic,
                verify=self._sink.receiver_verify(options.verify),
                force=options.force,
                timeout_s=self.timeout_s,
                probe=options.probe,
            )
            futures[target.url] = self._pool.submit(target.update, order)
        for url, future in futures.items():
            future.add_done_callback(_abandon_on_answer(session, url))
        return futures

    def _stream(self, session: PushSession, tensors: dict, progress: Progress) -> str | None:
        try:
            self._sink.stream(session, tensors, self.timeout_s, progress)
        except (TimeoutError, OSError, ValueError) as exc:
            return f"transport {self.transport}: {exc}"
        return None

    def _collect(
        self, session: PushSession, futures: dict[str, Future], stream_error: str | None
    ) -> list[EngineResult]:
        failures: dict[str, str] = {}
        results: list[EngineResult] = []
        # a failed stream may have left tensors undigested: no engine can match then
        pushed = session.fingerprint if stream_error is None else "(stream failed)"
        targets = {target.url: target for target in self.targets}
        for url, future in futures.items():
            try:
                result = future.result()
            except EngineRequestError as exc:
                failures[url] = str(exc)
                continue
            if result.fingerprint is None and not targets[url].reports_fingerprint:
                result = dataclasses.replace(result, fingerprint=pushed)
            if result.fingerprint != pushed:
                failures[url] = f"committed fingerprint {result.fingerprint} != pushed {pushed}"
                continue
            results.append(result)
        if stream_error and not failures:
            failures = dict.fromkeys(futures, stream_error)
        if failures:
            raise PushError(session.version, failures, stream_error)
        return results


def _both(first: Progress, second: Progress | None) -> Progress:
    if second is None:
        return first

    def advance(nbytes: int) -> None:
        first(nbytes)
        second(nbytes)

    return advance
