"""The Publisher: pushes a model version into every engine and waits for their commits.

`Publisher.push` is a short loop over named steps: `_session` (normalise, plan, digest),
`sink.prepare` (make the session readable), `_request_all` (ask every engine to update, in
parallel), `sink.stream` (send what is not sent yet), `_collect` (every engine committed the
same fingerprint, or one `PushError` naming each engine that did not and why).
"""

import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any, Literal

import httpx

from weightbus.owners import owner_is_dead, private_dir
from weightbus.publisher.progress import PushProgress
from weightbus.publisher.weights import NameMap, SessionFactory, Weights, normalize_weights
from weightbus.transport import BucketSink, PushSession, make_sink
from weightbus.transport.base import Progress
from weightbus.transport.dist_group import create_publisher_group, destroy_group, serve_group

logger = logging.getLogger(__name__)

PauseMode = Literal["drain", "in_place", "abort"]
VerifyLevel = Literal["full", "none"]
DEFAULT_BUCKET_BYTES = 256 * 2**20
# Margin on top of the update's own timeout for the HTTP answer to travel back.
_HTTP_MARGIN_S = 10.0


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


class WeightsGroupError(RuntimeError):
    """A `dist` weights group could not be initialised or destroyed on every member.

    Attributes:
        failures: engine URL (or "publisher") -> reason.
    """

    def __init__(self, name: str, action: str, failures: dict[str, str]) -> None:
        self.failures = failures
        details = "; ".join(f"{member}: {reason}" for member, reason in failures.items())
        super().__init__(f"{action} of weights group {name!r} failed: {details}")


@dataclass(frozen=True, slots=True)
class WeightsGroupInfo:
    """A formed weights group: its size and each engine's first group rank."""

    name: str
    world_size: int
    rank_offsets: dict[str, int]


@dataclass(frozen=True, slots=True)
class EngineResult:
    """What one engine reported after committing."""

    url: str
    version: str
    fingerprint: str
    nbytes: int
    seconds: float
    phases: dict[str, float]


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


DISK_ROOT_PREFIX = "weightbus-disk-"


def _remove_stale_disk_roots(parent: Path) -> None:
    """Remove session directories left by publishers that died without closing (SIGKILL)."""
    for path in parent.glob(f"{DISK_ROOT_PREFIX}*-*"):
        if owner_is_dead(path.name, DISK_ROOT_PREFIX):
            logger.info("removing %s, left by a dead publisher", path)
            shutil.rmtree(path, ignore_errors=True)


def _default_disk_root() -> Path:
    # a fresh 0700 directory with an unguessable name, so /dev/shm is safe here
    shm = Path("/dev/shm")  # noqa: S108
    parent = shm if shm.is_dir() else Path(tempfile.gettempdir())
    _remove_stale_disk_roots(parent)
    return private_dir(DISK_ROOT_PREFIX, parent)


def _error_reason(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:500]}"
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else body
    names = body.get("names") if isinstance(body, dict) else None
    suffix = f" (tensors: {names})" if names else ""
    return f"HTTP {response.status_code}: {message}{suffix}"


def _abandon_on_answer(session: PushSession, url: str) -> Callable[[Future], None]:
    """A callback for an engine's update request: an answer while the stream still runs
    (a refusal, a 503, a dropped connection) means that engine reads no more of it."""

    def answered(future: Future) -> None:
        try:
            response = future.result()
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}"
        else:
            reason = _error_reason(response)
        session.abandon(f"engine {url} answered before the stream ended: {reason}")

    return answered


class Publisher:
    """Trainer-side handle on a set of engines.

    Args:
        engines: base URLs of the engines' HTTP servers.
        transport: a registered transport name (`weightbus.transport.transport_names()`).
        bucket_bytes: bucket size of the plan (and of transport buffers).
        token: bearer token of the engines' admin routes, if they require one.
        timeout_s: bound of one push on every engine.
        transport_options: keyword arguments of the transport's sink (e.g. `root` for disk).

    Raises:
        ValueError: no engines, an unknown transport, or a non-positive timeout.
    """

    def __init__(
        self,
        engines: list[str],
        *,
        transport: str = "disk",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        token: str | None = None,
        timeout_s: float = 120.0,
        transport_options: dict[str, Any] | None = None,
    ) -> None:
        if not engines:
            raise ValueError("engines: give at least one engine URL")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.engines = [url.rstrip("/") for url in engines]
        self.transport = transport
        self.timeout_s = timeout_s
        self._sessions = SessionFactory(bucket_bytes)
        options = dict(transport_options or {})
        self._owned_root: Path | None = None
        if transport == "disk" and "root" not in options:
            self._owned_root = options["root"] = _default_disk_root()
        self._sink: BucketSink = make_sink(transport, **options)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(headers=headers, timeout=timeout_s + _HTTP_MARGIN_S)
        self._pool = ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="push")
        self._group_name: str | None = None  # the dist group this publisher formed

    @property
    def sink(self) -> BucketSink:
        """The transport's sink (e.g. `DistSink.sent_bytes`: bytes per rank of the last push)."""
        return self._sink

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the transport (files, shared memory, sockets, the weights group) and the HTTP
        connections."""
        if self._group_name is not None:
            with contextlib.suppress(WeightsGroupError):
                self.destroy_weights_group(timeout_s=_HTTP_MARGIN_S)
        self._pool.shutdown(wait=True)
        self._sink.close()
        self._http.close()
        if self._owned_root is not None:
            shutil.rmtree(self._owned_root, ignore_errors=True)

    def init_weights_group(
        self,
        master_addr: str,
        master_port: int = 0,
        *,
        backend: Literal["gloo"] = "gloo",
        timeout_s: float = 60.0,
    ) -> WeightsGroupInfo:
        """Form the `dist` weights group: this process is rank 0, every engine rank a member.

        Serves the group's store on `master_addr:master_port` (0: a free port from the OS),
        asks every engine in parallel to join (`POST /v1/init_weights_group`, each with its
        `rank_offset`) and joins itself. The group is reused by every push until
        `destroy_weights_group` or `close`; calling this again re-forms it (after a failed push,
        which leaves the group broken).

        Args:
            master_addr: this host's address as the engines reach it.
            master_port: the store's port.
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
        name = self._sink.group_name
        tp_sizes = self._tp_sizes()
        offsets = list(accumulate([1, *tp_sizes[:-1]]))
        world_size = 1 + sum(tp_sizes)
        store = serve_group(
            name=name,
            master_addr=master_addr,
            master_port=master_port,
            world_size=world_size,
            timeout_s=timeout_s,
        )
        bodies = {
            url: {
                "master_addr": master_addr,
                "master_port": store.port,
                "rank_offset": offset,
                "world_size": world_size,
                "backend": backend,
                "group_name": name,
                "timeout_s": timeout_s,
            }
            for url, offset in zip(self.engines, offsets, strict=True)
        }
        futures = self._post_all("/v1/init_weights_group", bodies, timeout_s + _HTTP_MARGIN_S)
        failures = {}
        try:
            create_publisher_group(
                name=name,
                store=store,
                master_addr=master_addr,
                world_size=world_size,
                timeout_s=timeout_s,
            )
        except (TimeoutError, OSError) as exc:
            failures["publisher"] = str(exc)
        failures = {**self._failures(futures), **failures}
        if failures:
            destroy_group(name)
            raise WeightsGroupError(name, "initialisation", failures)
        self._group_name = name
        logger.info("weights group %r formed: %d members", name, world_size)
        return WeightsGroupInfo(name, world_size, dict(zip(self.engines, offsets, strict=True)))

    def destroy_weights_group(self, timeout_s: float = 60.0) -> None:
        """Leave the `dist` weights group on this process and on every engine.

        Raises:
            WeightsGroupError: an engine did not confirm (this process has left regardless).
        """
        name = self._sink.group_name
        self._group_name = None
        bodies = {url: {"group_name": name} for url in self.engines}
        futures = self._post_all("/v1/destroy_weights_group", bodies, timeout_s)
        destroy_group(name)
        failures = self._failures(futures)
        if failures:
            raise WeightsGroupError(name, "destruction", failures)

    def _tp_sizes(self) -> list[int]:
        futures = {
            url: self._pool.submit(self._http.get, f"{url}/v1/server_info") for url in self.engines
        }
        failures = self._failures(futures)
        if failures:
            raise WeightsGroupError(self._sink.group_name, "initialisation", failures)
        return [futures[url].result().json()["tp_size"] for url in self.engines]

    def _post_all(self, path: str, bodies: dict[str, dict], timeout_s: float) -> dict:
        return {
            url: self._pool.submit(self._http.post, f"{url}{path}", json=body, timeout=timeout_s)
            for url, body in bodies.items()
        }

    @staticmethod
    def _failures(futures: dict[str, Future]) -> dict[str, str]:
        failures = {}
        for url, future in futures.items():
            try:
                response = future.result()
            except httpx.HTTPError as exc:
                failures[url] = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code != 200:
                failures[url] = _error_reason(response)
        return failures

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

        Returns:
            The committed version, its fingerprint and per-engine results.

        Raises:
            PushError: an engine refused, failed or timed out (each one named with its reason).
        """
        start = time.perf_counter()
        tick = start
        normalized = normalize_weights(weights, name_map)
        session = self._sessions.session(
            normalized, version, step, receivers=len(self.engines), verify=verify == "full"
        )
        phases = {"plan_s": time.perf_counter() - tick}
        tick = time.perf_counter()
        tensors = dict(normalized)
        progress_bar = PushProgress(version, session.plan.total_bytes)

        def advance(nbytes: int) -> None:
            progress_bar.advance(nbytes)
            if progress is not None:
                progress(nbytes)

        try:
            source = self._sink.prepare(session, tensors, advance)
            phases["prepare_s"] = time.perf_counter() - tick
            options = {
                "pause_mode": pause_mode,
                "atomic": atomic,
                "verify": self._sink.receiver_verify(verify),
                "force": force,
            }
            futures = self._request_all(self._body(session, source, options))
            for url, future in futures.items():
                future.add_done_callback(_abandon_on_answer(session, url))
            tick = time.perf_counter()
            stream_error = self._stream(session, tensors, advance)
            phases["stream_s"] = time.perf_counter() - tick
        finally:
            progress_bar.close()
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

    def _body(self, session: PushSession, source: dict, options: dict) -> dict:
        """The `/v1/update_weights` request of a session."""
        return {
            "version": session.version,
            "step": session.step,
            "transport": self.transport,
            "source": source,
            "plan_hash": session.plan.plan_hash,
            "timeout_s": self.timeout_s,
            **options,
        }

    def _request_all(self, body: dict) -> dict[str, Future]:
        # each engine learns its index ("group"): streaming sinks wait for every engine's ranks
        return {
            url: self._pool.submit(
                self._http.post,
                f"{url}/v1/update_weights",
                json={**body, "source": {**body["source"], "group": group}},
            )
            for group, url in enumerate(self.engines)
        }

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
        for url, future in futures.items():
            try:
                response = future.result()
            except httpx.HTTPError as exc:
                failures[url] = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code != 200:
                failures[url] = _error_reason(response)
                continue
            body = response.json()
            committed = body.get("fingerprint")
            if committed != pushed:
                failures[url] = f"committed fingerprint {committed} != pushed {pushed}"
                continue
            results.append(
                EngineResult(
                    url=url,
                    version=body["version"],
                    fingerprint=body["fingerprint"],
                    nbytes=body.get("bytes", 0),
                    seconds=body.get("seconds", 0.0),
                    phases=body.get("phases", {}),
                )
            )
        if stream_error and not failures:
            failures = dict.fromkeys(futures, stream_error)
        if failures:
            raise PushError(session.version, failures, stream_error)
        return results
