"""A vLLM server as an engine target: its weight-transfer routes (served with
`VLLM_SERVER_DEV_MODE=1`) driving the `weightbus` backend on its workers.

One update: `/pause` (drain -> `wait`, in_place -> `keep`, abort -> `abort`), then **one**
`/init_weight_transfer_engine` whose `init_info` carries the whole weightbus session (each
worker receives it, verifies every digest and the fingerprint, and loads only once every rank
agreed: `weightbus.engines.vllm.worker`), then `/update_weight_version` to name the version
(`/start_weight_update` + `/finish_weight_update` on a server with LoRA enabled), and
`/resume`. A delta's base is checked by the workers as it arrives (`delta_refusal`).

A push that carries a draft model (`draft.` tensors, speculative decoding with vLLM's
`draft_model` method) rides the same single `init` inside a draft session:
`/start_draft_weight_update` before it (which retargets each worker's backend at the draft
model), `/finish_weight_update` after it, always, even on a refusal -- vLLM's init route keeps
no session of its own, so a session left open would send every later push to the draft.

Why not `/update_weights`: vLLM's worker wrapper marks a session open on `start` and closes it
on `finish` or on a rank that raised. vLLM's executor stops reading the ranks' answers at the
first failure, so only the last rank may fail a call (the others' answers would be read by the
next call); a failed update then leaves the other ranks' sessions open, and the next `start`
fails on them -- for good, once a publisher died mid-push and cannot `finish`. The init route
has no session: a refused push leaves every rank as it was.

A push the workers refused leaves vLLM serving the previous weights and resumes it; a load that
failed after touching the model, or a failed logprob probe, leaves it paused (fail closed)
until a good push lands.

A LoRA adapter push (`order.adapter`) never reaches the workers' backend: vLLM loads adapters
from a directory (`adapter_pushes.py`, over a file transport). A whole push that lands unloads
the target's adapter: it was trained on the base it replaced.
"""

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import httpx
import msgspec

from weightbus.core.fixes import with_fix
from weightbus.core.meta import DRAFT_PREFIX
from weightbus.core.publisher.probe import LogprobProbe
from weightbus.core.publisher.targets.base import (
    EngineResult,
    EngineTarget,
    EngineWeights,
    PushOrder,
    RollbackOrder,
)
from weightbus.core.publisher.targets.http import HTTP_MARGIN_S, request_json
from weightbus.core.transport.base import EngineRequestError
from weightbus.core.wire import PauseMode
from weightbus.core.wire.messages import SliceSpec
from weightbus.engines.vllm import BACKEND, WORKER_EXTENSION
from weightbus.engines.vllm.adapter_pushes import AdapterChange, AdapterPushes
from weightbus.engines.vllm.adapters import LORA_UPDATING_ENV, AdapterDirectories
from weightbus.engines.vllm.messages import (
    UNTOUCHED,
    VllmDecision,
    VllmInitInfo,
    VllmRollback,
    VllmTransportSetup,
    VllmUpdateInfo,
)
from weightbus.engines.vllm.prefix_cache import reset_prefix_cache

# What each weightbus pause mode is called on vLLM's `/pause`.
PAUSE_MODES: dict[PauseMode, str] = {"drain": "wait", "in_place": "keep", "abort": "abort"}
_CONTROL_TIMEOUT_S = 30.0
# Routes vLLM serves without VLLM_SERVER_DEV_MODE=1: a 404 on them is not about the mode.
_PUBLIC_ROUTES = frozenset({"/v1/completions", "/v1/models"})
# vLLM's worker refuses a second session while one is open (a publisher died inside it).
_SESSION_OPEN = "already active"

logger = logging.getLogger(__name__)


def _server_fix(path: str, reason: str) -> str | None:
    """The fix of a refusal that says how the vLLM server was started, if it is one: a 404
    on the routes vLLM serves only with `VLLM_SERVER_DEV_MODE=1` (`/pause`, `/collective_rpc`,
    the weight-transfer routes...), no `--weight-transfer-config`, or backend `weightbus`
    unknown to vLLM's factory."""
    if "Weight transfer not configured" in reason:  # vLLM started without the backend
        return (
            f'start vLLM with --weight-transfer-config \'{{"backend": "{BACKEND}"}}\', '
            "weightbus installed in vLLM's environment (docs/vllm.md)"
        )
    if f"backend: {BACKEND}" in reason:  # vLLM: "Invalid weight transfer backend: ..."
        return (
            "install weightbus in vLLM's environment (`pip install weightbus`): its plugin "
            "registers backend 'weightbus' when vLLM starts (docs/vllm.md)"
        )
    if reason.startswith(f"{path}: HTTP 404") and path not in _PUBLIC_ROUTES:
        return (
            f"start vLLM with VLLM_SERVER_DEV_MODE=1: without it vLLM does not serve {path} "
            "(docs/vllm.md)"
        )
    return None


def update_info(order: PushOrder, *, skip_unchanged: bool = False) -> VllmUpdateInfo:
    """The `update_info` of one engine's order."""
    return msgspec.convert(
        {**order.engine_fields(), "skip_unchanged": skip_unchanged}, VllmUpdateInfo
    )


def _refuse_contradictory_draft(order: PushOrder) -> None:
    if order.carries_draft and order.keep_draft:
        raise EngineRequestError(
            f"keep_draft is set but the push carries {DRAFT_PREFIX!r} tensors: drop one or the "
            "other (nothing was changed)"
        )


def _committed(
    url: str,
    version: str,
    start: float,
    phases: dict[str, float],
    *,
    reported: tuple[str | None, Sequence[int]] = (None, ()),
    staged: bool = False,
) -> EngineResult:
    """A vLLM engine's result; `reported`: the fingerprint its workers report they serve (or
    staged) and the bytes each received (None, []: a server without weightbus's worker
    extension, whose ranks verified the fingerprint)."""
    fingerprint, rank_nbytes = reported
    return EngineResult(
        url=url,
        version=version,
        fingerprint=fingerprint,
        nbytes=sum(rank_nbytes),
        seconds=time.perf_counter() - start,
        phases=phases,
        staged=staged,
        rank_nbytes=list(rank_nbytes),
    )


def _rollback_of(states: "WorkerStates", version: str) -> tuple[dict | None, str]:
    """The version the workers hold for a rollback and why none: none while vLLM serves an
    adapter push made after the workers' last whole load (a rollback to the workers' previous
    version would skip back past that load; vLLM keeps no previous adapter)."""
    served = states.agreed("served")
    if served is not None and served["version"] != version:
        return None, (
            f"vLLM serves {version!r}, an adapter push after the workers' last whole load "
            f"{served['version']!r}: no rollback of adapters (push the previous adapter again)"
        )
    return states.agreed("previous"), states.previous_unavailable()


class WorkerStates(msgspec.Struct, frozen=True):
    """What every worker of a vLLM engine holds (`weightbus_state`, in rank order)."""

    ranks: list[dict[str, Any]]

    def agreed(self, key: str) -> dict | None:
        """The ranks' common `key` entry (`served`, `staged`, `previous`); None when any rank
        holds none or the ranks disagree."""
        values = [rank.get(key) for rank in self.ranks]
        first = values[0] if values else None
        return first if all(value == first for value in values) else None

    def fingerprint(self, key: str = "served") -> str | None:
        held = self.agreed(key)
        return None if held is None else held["fingerprint"]

    def previous_unavailable(self) -> str:
        reasons = sorted({rank.get("previous_unavailable", "") for rank in self.ranks} - {""})
        if reasons:
            return "; ".join(reasons)
        if self.agreed("previous") is None:
            return "the workers hold different previous versions"
        return ""


class ServerConfig(msgspec.Struct, frozen=True):
    """What the target reads of a vLLM server's configuration (`GET /server_info`, once).

    Attributes:
        worker_extension: its workers run weightbus's worker extension.
        max_lora_rank: `--max-lora-rank` (None: started without `--enable-lora`).
        lora_updating: `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is set (`/v1/load_lora_adapter`).
    """

    worker_extension: bool
    max_lora_rank: int | None
    lora_updating: bool

    @classmethod
    def of(cls, answer: dict) -> "ServerConfig":
        """The configuration in `/server_info?config_format=json`'s answer."""
        config = answer.get("vllm_config", {})
        lora = config.get("lora_config") or {}
        return cls(
            worker_extension=config.get("parallel_config", {}).get("worker_extension_cls")
            == WORKER_EXTENSION,
            max_lora_rank=lora.get("max_lora_rank"),
            lora_updating=bool(answer.get("vllm_env", {}).get(LORA_UPDATING_ENV)),
        )


class VllmEngineTarget(AdapterPushes, EngineTarget):
    """A vLLM server at `url` started with `--weight-transfer-config '{"backend": "weightbus"}'`.

    Args:
        url: the server's base URL.
        init_info: the backend's options (`VllmInitInfo`), sent with every push and set-up.
        skip_unchanged: ask the workers to reload only the blocks whose bytes changed since
            their last weightbus load (`VllmUpdateInfo.skip_unchanged`: only while nothing
            else writes the engine's weights).
        api_key: vLLM's `--api-key`, if set.
        client: an HTTP client to use (the target then does not close it).
        worker_extension: the server runs weightbus's worker extension (`WORKER_EXTENSION`):
            its workers report what they serve. None: read from the server's configuration
            (`GET /server_info`, once). Never probed by calling it: on a server without it
            every worker would fail the call, and vLLM would answer later calls with the
            queued failures.
        lora_name: the name vLLM serves pushed LoRA adapters under: requests select the
            adapter with it as their `model` (the base stays under its own name).
        adapter_root: where adapter directories are written: one vLLM's server can read (its
            host, or a filesystem shared with it). Default: a new directory under /dev/shm,
            for a server on this host running as this user.
        start_fingerprint: the fingerprint of the weights vLLM started with (in the dtype it
            serves): the base an adapter may apply to until a whole weightbus push loads.
    """

    reports_fingerprint = False  # None without the worker extension: its ranks verify it
    scores_probes = True
    supports_two_phase = True
    stages_before_loading = True  # it pauses to receive, and resumes untouched on a refusal

    def __init__(
        self,
        url: str,
        *,
        init_info: VllmInitInfo | None = None,
        skip_unchanged: bool = False,
        api_key: str | None = None,
        client: httpx.Client | None = None,
        worker_extension: bool | None = None,
        lora_name: str = "weightbus-adapter",
        adapter_root: str | Path | None = None,
        start_fingerprint: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.init_info = init_info or VllmInitInfo()
        self.skip_unchanged = skip_unchanged
        self._owns_client = client is None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.headers = headers  # what other clients of this server send (its API key)
        # no keep-alive: uvicorn drops a kept-alive connection after a route raised (500)
        self._http = client or httpx.Client(
            headers=headers, limits=httpx.Limits(max_keepalive_connections=0)
        )
        self._model: str | None = None
        self._pending: PushOrder | RollbackOrder | None = None  # staged, awaiting commit
        self._extension = worker_extension  # the workers answer `weightbus_state`
        self._config: ServerConfig | None = None
        self.lora_name = lora_name
        self.start_fingerprint = start_fingerprint
        self._adapter_root = adapter_root
        self._adapter_dirs: AdapterDirectories | None = None  # made by the first adapter push
        self._pending_adapter: AdapterChange | None = None  # staged, awaiting commit

    # requests
    def _request(self, method: str, path: str, timeout_s: float, **kwargs: Any) -> dict:
        try:
            return request_json(
                self._http, method, self.url, path, timeout_s, name_path=True, **kwargs
            )
        except EngineRequestError as exc:
            fix = _server_fix(path, str(exc))
            if fix is None:
                raise
            raise EngineRequestError(with_fix(str(exc), fix)) from None

    def _pause(self, mode: PauseMode, timeout_s: float) -> None:
        # the cache is dropped explicitly once new weights loaded (`prefix_cache.py`)
        params = {"mode": PAUSE_MODES[mode], "clear_cache": "false"}
        self._request("POST", "/pause", timeout_s, params=params)

    def _resume(self) -> None:
        self._request("POST", "/resume", _CONTROL_TIMEOUT_S)

    def _init(self, timeout_s: float, **fields: Any) -> None:
        """One `/init_weight_transfer_engine` with this target's options and `fields`."""
        init_info = msgspec.structs.replace(self.init_info, **fields)
        body = {"init_info": msgspec.to_builtins(init_info)}
        self._request("POST", "/init_weight_transfer_engine", timeout_s + HTTP_MARGIN_S, json=body)

    def worker_states(self, timeout_s: float) -> WorkerStates | None:
        """Every worker's `weightbus_state` (None: the server runs without weightbus's worker
        extension, `--worker-extension-cls` `WORKER_EXTENSION`).

        Raises:
            EngineRequestError: the server did not answer, or a worker failed (named).
        """
        if not self._has_extension(timeout_s):
            return None
        return WorkerStates(self._worker_call("weightbus_state", timeout_s))

    def _server_config(self, timeout_s: float) -> ServerConfig:
        if self._config is None:
            answer = self._request(
                "GET", "/server_info", timeout_s, params={"config_format": "json"}
            )
            self._config = ServerConfig.of(answer)
        return self._config

    def _has_extension(self, timeout_s: float) -> bool:
        if self._extension is None:
            self._extension = self._server_config(timeout_s).worker_extension
            if not self._extension:
                logger.warning(
                    "%s: the workers cannot report what they serve (no fingerprints read back, "
                    "rollbacks or deltas): start vLLM with --worker-extension-cls %s",
                    self.url,
                    WORKER_EXTENSION,
                )
        return self._extension

    def _worker_call(self, method: str, timeout_s: float) -> list:
        body = {"method": method, "timeout": timeout_s}
        answer = self._request("POST", "/collective_rpc", timeout_s + HTTP_MARGIN_S, json=body)
        results = answer.get("results")
        if not isinstance(results, list) or not all(isinstance(r, dict | list) for r in results):
            raise EngineRequestError(f"{self.url}: /collective_rpc {method}: unreadable {answer}")
        failed = [
            f"worker {rank}: {result['error']}"
            for rank, result in enumerate(results)
            if isinstance(result, dict) and "error" in result
        ]
        if failed:
            raise EngineRequestError(f"{self.url}: {method} failed: {'; '.join(failed)}")
        return results

    def _reported(self, key: str = "served") -> tuple[str | None, list[int]]:
        """The fingerprint every worker reports for `key` (`served`, `staged`) and the bytes
        each received in the last push; None, [] without the worker extension.

        Raises:
            EngineRequestError: the workers report none or different ones: for `served`, vLLM
                is paused (fail closed); for `staged`, the staged version is discarded.
        """
        states = self.worker_states(_CONTROL_TIMEOUT_S)
        if states is None:
            return None, []
        fingerprint = states.fingerprint(key)
        if fingerprint is None:
            disagreement = f"{self.url}: the vLLM workers do not report one {key} version: " + str(
                [rank.get(key) for rank in states.ranks]
            )
            if key == "served":
                self._pause("abort", _CONTROL_TIMEOUT_S)
                raise EngineRequestError(f"{disagreement} (vLLM stays paused until a good push)")
            error = EngineRequestError(
                f"{disagreement} (discarded; vLLM serves its previous weights)"
            )
            try:
                self._discard_staged("the workers staged different versions")
            except EngineRequestError as discarding:
                error.add_note(f"and discarding it failed: {discarding}")
            raise error
        return fingerprint, [int(rank.get("received_bytes", 0)) for rank in states.ranks]

    def _discard_staged(self, reason: str) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._init(_CONTROL_TIMEOUT_S, abort=VllmDecision(pending.version, reason=reason))

    # the EngineTarget seam
    def update(self, order: PushOrder) -> EngineResult:
        if order.adapter is not None:
            return self._update_adapter(order)
        start = time.perf_counter()
        self._forget_pending()  # the workers drop anything staged when a new push arrives
        _refuse_contradictory_draft(order)
        if order.two_phase and order.carries_draft:
            raise EngineRequestError(
                f"{self.url}: a push that carries a draft model ({DRAFT_PREFIX!r} tensors) is "
                "one-phase only (two_phase=False); nothing was changed"
            )
        self._refuse_served_version(order)
        info = update_info(order, skip_unchanged=self.skip_unchanged)
        phases: dict[str, float] = {"version_check_s": time.perf_counter() - start}
        with self._draft_session(order.carries_draft, phases):
            tick = time.perf_counter()
            self._pause(order.pause_mode, order.timeout_s)
            phases["pause_s"] = time.perf_counter() - tick
            tick = time.perf_counter()
            self._decide(order.timeout_s, push=info)
            phases["update_s"] = time.perf_counter() - tick
        if order.two_phase:
            # the workers staged it; vLLM serves the previous weights until the commit
            tick = time.perf_counter()
            self._resume()
            phases["resume_s"] = time.perf_counter() - tick
            self._pending = order
            reported = self._reported("staged")
            return _committed(
                self.url, order.version, start, phases, reported=reported, staged=True
            )
        return self._serve(order, order.probe, start, phases)

    def _serve(
        self,
        order: PushOrder | RollbackOrder,
        probe: LogprobProbe | None,
        start: float,
        phases: dict[str, float],
    ) -> EngineResult:
        """The workers loaded `version`: name it in vLLM, unload this target's adapter (it was
        trained on the base just replaced), resume, check the probe, and read back what the
        workers serve."""
        version = order.version
        self._name_version(version, phases)
        try:  # vLLM is paused still: no request meets the adapter of the replaced base
            self._unload_adapter()
        except EngineRequestError as exc:
            raise EngineRequestError(
                f"{version!r} loaded, but adapter {self.lora_name!r} of the replaced base could "
                f"not be unloaded: {exc} (vLLM stays paused until a good push)"
            ) from None
        running = order.pause_mode == "in_place"  # requests frozen, holding their blocks
        reset_prefix_cache(self._request, self.url, order, phases, requests_running=running)
        tick = time.perf_counter()
        self._resume()
        phases["resume_s"] = time.perf_counter() - tick
        if probe is not None:
            tick = time.perf_counter()
            self._check_probe(probe, version)
            phases["probe_s"] = time.perf_counter() - tick
        tick = time.perf_counter()
        reported = self._reported()
        phases["report_s"] = time.perf_counter() - tick
        return _committed(self.url, version, start, phases, reported=reported)

    def _name_version(self, version: str, phases: dict[str, float]) -> None:
        """vLLM's version: `/update_weight_version` (its engine core only); on a server with
        LoRA enabled a start/finish pair instead (the backend's are no-ops: nothing can fail),
        as vLLM's finish drops its workers' LoRA adapters, which reload from their directory
        (two calls to every worker more)."""
        tick = time.perf_counter()
        if self._server_config(_CONTROL_TIMEOUT_S).max_lora_rank is None:
            body = {"new_version": version}
            self._request("POST", "/update_weight_version", _CONTROL_TIMEOUT_S, json=body)
        else:
            self._request("POST", "/start_weight_update", _CONTROL_TIMEOUT_S)
            body = {"weight_version": version}
            self._request("POST", "/finish_weight_update", _CONTROL_TIMEOUT_S, json=body)
        phases["version_s"] = time.perf_counter() - tick

    def commit(self, version: str, fingerprint: str | None, timeout_s: float) -> EngineResult:
        """Load the version every worker staged, pausing vLLM as its push asked. A refusal
        (nothing staged, expired) leaves vLLM serving the previous weights; a load that fails
        leaves it paused (fail closed)."""
        start = time.perf_counter()
        pending = self._pending
        if pending is None or pending.version != version:
            raise EngineRequestError(f"{self.url}: nothing of version {version!r} is staged")
        if self._pending_adapter is not None:
            return self._commit_adapter(self._pending_adapter, fingerprint, start)
        tick = time.perf_counter()
        self._pause(pending.pause_mode, timeout_s)  # a failed pause leaves it pending
        self._pending = None
        phases = {"pause_s": time.perf_counter() - tick}
        tick = time.perf_counter()
        decision = VllmDecision(version=version, fingerprint=fingerprint)
        self._decide(timeout_s, commit=decision)
        phases["load_s"] = time.perf_counter() - tick
        probe = pending.probe if isinstance(pending, PushOrder) else None
        return self._serve(pending, probe, start, phases)

    def abort(self, version: str, reason: str, timeout_s: float) -> None:
        """Discard the staged version on every worker (vLLM kept serving the previous one), or
        a staged adapter's directory (vLLM never saw it)."""
        if self._pending is not None and self._pending.version == version:
            adapter = self._pending_adapter is not None
            self._forget_pending()
            if adapter:
                return
        self._init(timeout_s, abort=VllmDecision(version=version, reason=reason[:1000]))

    def rollback(self, order: RollbackOrder) -> EngineResult:
        """Load the previous version again from the workers' second staging copy
        (`VllmInitInfo.keep_previous`); two-phase: stage it for `commit`."""
        start = time.perf_counter()
        rollback = VllmRollback(
            version=order.version,
            fingerprint=order.fingerprint,
            two_phase=order.two_phase,
            timeout_s=order.timeout_s,
        )
        if order.two_phase:
            self._init(order.timeout_s, rollback=rollback)
            self._forget_pending()
            self._pending = order
            reported = self._reported("staged")
            return _committed(self.url, order.version, start, {}, reported=reported, staged=True)
        tick = time.perf_counter()
        self._pause(order.pause_mode, order.timeout_s)
        self._forget_pending()  # the workers drop anything staged for the rollback
        phases = {"pause_s": time.perf_counter() - tick}
        tick = time.perf_counter()
        self._decide(order.timeout_s, rollback=rollback)
        phases["load_s"] = time.perf_counter() - tick
        return self._serve(order, None, start, phases)

    def _decide(self, timeout_s: float, **action: Any) -> None:
        """A push, commit or rollback on every worker, vLLM paused: on failure resume when the
        workers said the model is untouched, else stay paused (fail closed: never serve a
        half-loaded model)."""
        try:
            self._init(timeout_s, **action)
        except EngineRequestError as exc:
            if UNTOUCHED in str(exc):
                self._resume()
                raise
            raise EngineRequestError(f"{exc} (vLLM stays paused until a good push)") from None

    def slice_maps(self, timeout_s: float) -> list[list[SliceSpec]] | None:
        """Each worker's part of every tensor (`weightbus_layout`); None without the worker
        extension (no delta can be checked then)."""
        if not self._has_extension(timeout_s):
            return None
        ranks = self._worker_call("weightbus_layout", timeout_s)
        try:
            return msgspec.convert(ranks, list[list[SliceSpec]])
        except msgspec.ValidationError as exc:
            raise EngineRequestError(f"{self.url}: unreadable worker layout: {exc}") from None

    def delta_refusal(self, base_version: str, base_fingerprint: str, timeout_s: float) -> str:
        """None asked here: each worker checks that it serves the base and still holds a copy
        of it when the delta arrives (a push that failed overwrote the copy of workers with
        one staging set), and refuses it untouched, after which the publisher pushes the whole
        version. A call to the workers here would cost more than the delta's own: vLLM's
        processes spin for 1 s after each one, starving the publisher's passes and the calls
        that follow on a small host."""
        return ""

    @contextmanager
    def _draft_session(self, carries_draft: bool, phases: dict[str, float]) -> Iterator[None]:
        """Around a push that carries a draft: a draft session, opened before the pause (a
        server without a draft refuses it, nothing changed) and always closed after the push."""
        if not carries_draft:
            yield
            return
        tick = time.perf_counter()
        self._start_draft_session()
        phases["draft_start_s"] = time.perf_counter() - tick
        try:
            yield
        except BaseException as exc:
            try:
                self._request("POST", "/finish_weight_update", _CONTROL_TIMEOUT_S)
            except EngineRequestError as closing:
                exc.add_note(f"and the draft session could not be closed: {closing}")
            raise
        tick = time.perf_counter()
        self._request("POST", "/finish_weight_update", _CONTROL_TIMEOUT_S)
        phases["draft_finish_s"] = time.perf_counter() - tick

    def _start_draft_session(self) -> None:
        """`/start_draft_weight_update`; a session left open by a publisher that died inside
        it is closed first (no route says whether one is open: vLLM's refusal does)."""
        try:
            self._request("POST", "/start_draft_weight_update", _CONTROL_TIMEOUT_S)
        except EngineRequestError as exc:
            if _SESSION_OPEN not in str(exc):
                raise EngineRequestError(
                    f"the push carries a draft model ({DRAFT_PREFIX!r} tensors) but the vLLM "
                    f"server at {self.url} cannot update one: it serves no draft model (start "
                    'it with --speculative-config \'{"method": "draft_model", ...}\') or '
                    f"its backend is not weightbus; nothing was changed ({exc})"
                ) from None
            logger.warning("%s: closing a weight-update session left open", self.url)
            self._request("POST", "/finish_weight_update", _CONTROL_TIMEOUT_S)
            self._request("POST", "/start_draft_weight_update", _CONTROL_TIMEOUT_S)

    def _refuse_served_version(self, order: PushOrder) -> None:
        served = self._request("GET", "/weight_info", _CONTROL_TIMEOUT_S).get("weight_version")
        if served == order.version and not order.force:
            raise EngineRequestError(
                f"the engine already serves version {order.version!r} (push with force=True "
                "to load it again)"
            )

    def _check_probe(self, probe: LogprobProbe, version: str, model: str | None = None) -> None:
        """Fail closed: a gap above the tolerance, a non-finite logprob on either side, or a
        scoring call that fails each pause vLLM (it stays paused until a good push). `model`:
        the name scored (default: the base model's)."""
        try:
            gap = probe.gap(self.score(probe.token_ids, model))
        except (EngineRequestError, KeyError, IndexError, TypeError, ValueError) as exc:
            self._pause("abort", _CONTROL_TIMEOUT_S)
            raise EngineRequestError(
                f"logprob probe failed after loading {version!r}: the engine could not score "
                f"the probe ({exc}) (vLLM stays paused until a good push)"
            ) from None
        if not gap <= probe.tolerance:
            self._pause("abort", _CONTROL_TIMEOUT_S)
            raise EngineRequestError(
                f"logprob probe failed after loading {version!r}: {probe.gap_reason(gap)}, so "
                "the engine does not serve the pushed weights (vLLM stays paused until a good "
                "push)"
            )

    def score(
        self, token_ids: tuple[int, ...] | list[int], model: str | None = None
    ) -> list[float]:
        """vLLM's logprob of each token after the first, teacher-forced (`prompt_logprobs`), by
        `model` (default: the base model; `lora_name`: with the adapter)."""
        body = {
            "model": model or self.served_model(),
            "prompt": list(token_ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        answer = self._request("POST", "/v1/completions", _CONTROL_TIMEOUT_S, json=body)
        scored = answer["choices"][0]["prompt_logprobs"][1:]
        return [
            entry[str(token)]["logprob"] for entry, token in zip(scored, token_ids[1:], strict=True)
        ]

    def served_model(self) -> str:
        """The name vLLM serves its model under (`GET /v1/models`)."""
        if self._model is None:
            self._model = self._request("GET", "/v1/models", _CONTROL_TIMEOUT_S)["data"][0]["id"]
        return self._model

    def weights(self, timeout_s: float) -> EngineWeights:
        """vLLM's version and pause state, what it serves (the workers' base, with the adapter
        listed under `lora_name`: `served_fingerprint`) and what the workers hold for a
        rollback (without the worker extension: no fingerprint, no rollback)."""
        version = self._request("GET", "/weight_info", timeout_s)["weight_version"]
        paused = self._request("GET", "/is_paused", timeout_s).get("is_paused", False)
        states = self.worker_states(timeout_s)
        fingerprint = self._served_fingerprint(states, timeout_s)
        if states is None:
            previous = None
            unavailable = f"start vLLM with --worker-extension-cls {WORKER_EXTENSION}"
        else:
            previous, unavailable = _rollback_of(states, version)
        return EngineWeights(
            url=self.url,
            version=version,
            fingerprint=fingerprint,
            status="PAUSED" if paused else "NORMAL",
            rollback=previous,
            rollback_unavailable=unavailable,
        )

    def tp_size(self, timeout_s: float) -> int:
        answer = self._request("GET", "/get_world_size", timeout_s, params={"include_dp": "false"})
        return int(answer["world_size"])

    def setup_transport(self, transport: str, info: msgspec.Struct, timeout_s: float) -> None:
        """Every worker runs `transport`'s set-up (`dist`: joins the weights group; the call
        blocks until the whole group formed or its timeout)."""
        setup = VllmTransportSetup(transport=transport, request=msgspec.to_builtins(info))
        self._init(timeout_s, setup=setup)

    def teardown_transport(self, transport: str, info: msgspec.Struct, timeout_s: float) -> None:
        self.setup_transport(transport, info, timeout_s)

    def close(self) -> None:
        """Close the HTTP client (if the target's) and drop a staged adapter's directory; the
        directories vLLM loaded stay (`AdapterDirectories`)."""
        self._forget_pending()
        if self._adapter_dirs is not None:
            self._adapter_dirs.close()
        if self._owns_client:
            self._http.close()


class WeightSyncClient(Protocol):
    """vLLM's trainer-side control-plane client (`VLLMWeightSyncClient`: HTTP, Ray, ...)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, update_info: dict[str, Any]) -> None: ...
    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class VllmClientTarget(EngineTarget):
    """A vLLM engine reached through one of vLLM's own weight-sync clients (the trainer API:
    `WeightbusTrainerEngine`). With vLLM's HTTP client (it has a `base_url`) the push pauses
    vLLM as the order asks (as `VllmEngineTarget` does: `/pause` with `clear_cache=false`),
    drops vLLM's prefix cache once the weights loaded (unless the order keeps it; in
    `in_place` the frozen requests are preempted and recompute on the new weights) and
    resumes; a failure leaves vLLM paused (fail closed: the client cannot say whether the
    model was touched). A caller that paused vLLM itself, as vLLM's trainer flow does, finds
    it resumed after the push. With another client (Ray) pausing and the cache are the
    caller's.

    Args:
        client: the client (`HTTPVLLMWeightSyncClient`, `RayVLLMWeightSyncClient`, ...).
        tp_size: the engine's number of workers (each one opens the push's source).
        name: names the engine in results and errors.
    """

    reports_fingerprint = False
    stages_before_loading = True

    def __init__(self, client: WeightSyncClient, *, tp_size: int, name: str = "vllm") -> None:
        self.url = name
        self._client = client
        self._tp_size = tp_size

    def update(self, order: PushOrder) -> EngineResult:
        start = time.perf_counter()
        self._pending = None  # the workers drop anything staged when a new push arrives
        _refuse_contradictory_draft(order)
        if order.carries_draft:
            raise EngineRequestError(
                f"{self.url}: vLLM's weight-sync clients open no draft session: push a draft "
                f"model ({DRAFT_PREFIX!r} tensors) with VllmEngineTarget (nothing was changed)"
            )
        if order.adapter is not None:
            raise EngineRequestError(
                f"{self.url}: vLLM's weight-sync clients cannot load LoRA adapters: push them "
                "with VllmEngineTarget (nothing was changed)"
            )
        info = update_info(order)
        init_info = msgspec.to_builtins(VllmInitInfo(push=info))
        phases: dict[str, float] = {}
        base_url = getattr(self._client, "base_url", None)
        if base_url is None:  # Ray: pausing and the prefix cache are the caller's
            self._load(init_info, order.version)
            return _committed(self.url, order.version, start, phases)
        with httpx.Client() as http:

            def request(method: str, path: str, timeout_s: float, **kwargs: Any) -> dict:
                return request_json(http, method, base_url, path, timeout_s, **kwargs)

            tick = time.perf_counter()
            params = {"mode": PAUSE_MODES[order.pause_mode], "clear_cache": "false"}
            request("POST", "/pause", order.timeout_s, params=params)
            phases["pause_s"] = time.perf_counter() - tick
            tick = time.perf_counter()
            try:
                self._load(init_info, order.version)
            except EngineRequestError as exc:
                raise EngineRequestError(f"{exc} (vLLM stays paused until a good push)") from None
            phases["update_s"] = time.perf_counter() - tick
            running = order.pause_mode == "in_place"  # requests frozen, holding their blocks
            reset_prefix_cache(request, self.url, order, phases, requests_running=running)
            tick = time.perf_counter()
            request("POST", "/resume", _CONTROL_TIMEOUT_S)
            phases["resume_s"] = time.perf_counter() - tick
        return _committed(self.url, order.version, start, phases)

    def _load(self, init_info: dict[str, Any], version: str) -> None:
        try:  # the push rides `init` (see the module's docstring); start/finish set the version
            self._client.init_weight_transfer_engine(init_info)
            self._client.start_weight_update()
            self._client.finish_weight_update(version)
        except Exception as exc:  # noqa: BLE001 - clients raise their transport's errors (requests, Ray)
            raise EngineRequestError(f"{type(exc).__name__}: {exc}") from None

    def weights(self, timeout_s: float) -> EngineWeights:
        raise EngineRequestError("a weight-sync client cannot read back the served version")

    def tp_size(self, timeout_s: float) -> int:
        return self._tp_size
