"""LoRA adapter pushes into vLLM: the part of `VllmEngineTarget` (target.py) that takes an
order with `adapter` set, and reads back the adapter vLLM serves.

vLLM loads adapters from a directory, so an adapter push never reaches the workers' backend:
the target checks that vLLM can load it and serves its base, writes it as a peft directory
whose bytes it verified against the trainer's (`adapters.py`), and, vLLM paused as the push
asked, has vLLM load it under the target's `lora_name` (`POST /v1/load_lora_adapter`,
`load_inplace`: the name moves to the new directory in one step). vLLM's answer is the commit
point: before it vLLM serves what it served; after it, the version is named and vLLM resumes.
A removal (`active` off) unloads the name; two-phase, the verified directory waits for
`commit`.

`AdapterPushes` is a mixin: it uses the target's `url`, `lora_name`, `start_fingerprint`,
HTTP client and calls (`_request`, `_pause`, `_resume`, `_name_version`, `_check_probe`,
`served_model`, `worker_states`, `_server_config`, `_refuse_served_version`) and keeps its
state in the target (`_adapter_dirs`, `_pending`, `_pending_adapter`).
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from weightbus.core.lora import check_adapter
from weightbus.core.publisher.targets.base import EngineResult, PushOrder
from weightbus.core.publisher.targets.http import HTTP_MARGIN_S, error_reason
from weightbus.core.transport.base import EngineRequestError
from weightbus.core.wire.adapter import AdapterSpec
from weightbus.engines.vllm import WORKER_EXTENSION
from weightbus.engines.vllm.adapters import (
    ADAPTER_UNTOUCHED,
    LORA_UPDATING_ENV,
    AdapterDirectories,
    AdapterIdentity,
    read_identity,
    read_pushed_adapter,
    refuse_other_transports,
)
from weightbus.engines.vllm.prefix_cache import reset_prefix_cache

if TYPE_CHECKING:
    from weightbus.engines.vllm.target import WorkerStates

# Bound of each LoRA route and read-back call (a load's own is the push's `timeout_s`).
CONTROL_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class AdapterChange:
    """An adapter push the target verified: load `directory` (`identity` holds what it is),
    or with none, remove the adapter and serve the base `order.adapter.base_fingerprint`."""

    order: PushOrder
    directory: Path | None = None
    identity: AdapterIdentity | None = None

    @property
    def spec(self) -> AdapterSpec:
        assert self.order.adapter is not None
        return self.order.adapter

    @property
    def fingerprint(self) -> str:
        """What vLLM serves once the change is loaded."""
        if self.identity is None:
            return self.spec.base_fingerprint
        return self.identity.served_fingerprint


def _result(
    url: str,
    version: str,
    start: float,
    phases: dict[str, float],
    fingerprint: str,
    *,
    staged: bool = False,
) -> EngineResult:
    """An adapter push's result: what vLLM serves (or staged) as one fingerprint; no bytes
    reached the workers."""
    seconds = time.perf_counter() - start
    return EngineResult(url, version, fingerprint, 0, seconds, phases, staged=staged)


class AdapterPushes:
    """The adapter pushes of `VllmEngineTarget` (module docstring)."""

    def _forget_pending(self) -> None:
        """Drop what is staged for a commit (a staged adapter's directory, never loaded)."""
        change, self._pending, self._pending_adapter = self._pending_adapter, None, None
        if change is not None and change.directory is not None and self._adapter_dirs:
            self._adapter_dirs.discard(change.directory)

    def _update_adapter(self, order: PushOrder) -> EngineResult:
        """An adapter push: checked against what vLLM serves, read from its file transport and
        written as a verified peft directory (nothing for a removal), then loaded (two-phase:
        kept for `commit`).

        Raises:
            EngineRequestError: a check failed or the bytes are not the trainer's (vLLM serves
                what it served), or vLLM refused the adapter (the same, resumed).
        """
        start = time.perf_counter()
        self._forget_pending()
        spec = order.adapter
        assert spec is not None
        self._refuse_adapter_order(order)
        self._refuse_served_version(order)
        self._check_lora_serving(spec)
        self._refuse_foreign_adapter_base(spec)
        phases = {"version_check_s": time.perf_counter() - start}
        tick = time.perf_counter()
        change = self._write_adapter(order) if spec.active else AdapterChange(order)
        phases["verify_s"] = time.perf_counter() - tick
        if not order.two_phase:
            return self._serve_adapter(change, start, phases)
        self._pending, self._pending_adapter = order, change
        return _result(self.url, order.version, start, phases, change.fingerprint, staged=True)

    def _refuse_adapter_order(self, order: PushOrder) -> None:
        """Raises: EngineRequestError: a transport or pause mode adapters cannot take."""
        try:
            refuse_other_transports(order.transport)
        except ValueError as exc:
            raise EngineRequestError(f"{self.url}: {exc}; {ADAPTER_UNTOUCHED}") from None
        if order.pause_mode == "in_place":
            raise EngineRequestError(
                f"{self.url}: pause_mode 'in_place' cannot apply an adapter in vLLM: a request "
                "it froze keeps the adapter directory it arrived with (vLLM resolves it then), "
                f"so it would not go on with the pushed adapter; push with 'drain' or 'abort'; "
                f"{ADAPTER_UNTOUCHED}"
            )

    def _check_lora_serving(self, spec: AdapterSpec) -> None:
        """Raises: EngineRequestError: the server cannot load this adapter at run time."""
        config = self._server_config(CONTROL_TIMEOUT_S)
        if config.max_lora_rank is None or not config.lora_updating:
            raise EngineRequestError(
                f"the vLLM server at {self.url} cannot load LoRA adapters at run time: start it "
                f"with --enable-lora --max-lora-rank R (R >= the adapter's rank {spec.r}) and "
                f"{LORA_UPDATING_ENV}=1; {ADAPTER_UNTOUCHED}"
            )
        if spec.active and spec.r > config.max_lora_rank:
            raise EngineRequestError(
                f"the adapter is {spec.describe()}; the vLLM server at {self.url} serves "
                f"adapters up to --max-lora-rank {config.max_lora_rank}; {ADAPTER_UNTOUCHED}"
            )

    def _base_of(self, states: "WorkerStates") -> str | None:
        """The base vLLM serves: its workers' last whole weightbus load, or the weights it
        started with (`start_fingerprint`) while no weightbus load touched them; None:
        unknown."""
        served = states.fingerprint()
        if served is None and not any(rank.get("touched", True) for rank in states.ranks):
            return self.start_fingerprint
        return served

    def _refuse_foreign_adapter_base(self, spec: AdapterSpec) -> None:
        """An adapter applies only onto the base it was trained on (the reference engine's
        409, naming both fingerprints).

        Raises:
            EngineRequestError: vLLM serves another base, or none weightbus knows.
        """
        version = self._request("GET", "/weight_info", CONTROL_TIMEOUT_S)["weight_version"]
        states = self.worker_states(CONTROL_TIMEOUT_S)
        if states is None:
            raise EngineRequestError(
                f"the vLLM server at {self.url} cannot say which base it serves: start it with "
                f"--worker-extension-cls {WORKER_EXTENSION}; {ADAPTER_UNTOUCHED}"
            )
        base = self._base_of(states)
        if base is None:
            raise EngineRequestError(
                f"the vLLM server at {self.url} serves no base weightbus knows (version "
                f"{version!r}: its last weightbus load failed, or none came and no "
                "start_fingerprint was given): push the base first, or give VllmEngineTarget "
                f"the start_fingerprint of the weights vLLM started with; {ADAPTER_UNTOUCHED}"
            )
        if spec.base_fingerprint != base:
            raise EngineRequestError(
                f"adapter base {spec.base_fingerprint} is not served here: the vLLM server at "
                f"{self.url} serves base {base} (version {version!r}); {ADAPTER_UNTOUCHED}"
            )

    def _write_adapter(self, order: PushOrder) -> AdapterChange:
        """The pushed adapter as a peft directory whose bytes verified against the trainer's.

        Raises:
            EngineRequestError: the session cannot be read, or its bytes (as written for vLLM)
                are not the trainer's: the tensor named, nothing loaded.
        """
        assert order.adapter is not None
        if self._adapter_dirs is None:
            self._adapter_dirs = AdapterDirectories(self._adapter_root)
        try:
            pushed = read_pushed_adapter(order, order.timeout_s)
            check_adapter(pushed.tensors, order.adapter)
            directory, identity = self._adapter_dirs.write(order.version, order.adapter, pushed)
        except (ValueError, OSError, TimeoutError) as exc:
            raise EngineRequestError(
                f"adapter {order.version!r} refused before loading: {exc}; {ADAPTER_UNTOUCHED}"
            ) from None
        return AdapterChange(order, directory, identity)

    def _commit_adapter(
        self, change: AdapterChange, fingerprint: str | None, start: float
    ) -> EngineResult:
        """Load the adapter staged for `commit` (the fleet's agreed `fingerprint`)."""
        if fingerprint is not None and fingerprint != change.fingerprint:
            self._forget_pending()
            raise EngineRequestError(
                f"{self.url}: the adapter staged for {change.order.version!r} is "
                f"{change.fingerprint}, not {fingerprint}; {ADAPTER_UNTOUCHED}"
            )
        self._pending = self._pending_adapter = None
        try:  # vLLM may have restarted or loaded another base since the adapter was staged
            self._refuse_foreign_adapter_base(change.order.adapter)
        except EngineRequestError:
            if change.directory is not None and self._adapter_dirs is not None:
                self._adapter_dirs.discard(change.directory)
            raise
        return self._serve_adapter(change, start, {})

    def _serve_adapter(
        self, change: AdapterChange, start: float, phases: dict[str, float]
    ) -> EngineResult:
        """vLLM paused as the push asked: load the adapter under `lora_name` (or unload it for
        a removal) -- the commit point --, name the version, resume; then read back what vLLM
        serves (its workers' base, and the adapter directory vLLM lists under the name)."""
        order = change.order
        tick = time.perf_counter()
        self._pause(order.pause_mode, order.timeout_s)
        phases["pause_s"] = time.perf_counter() - tick
        tick = time.perf_counter()
        try:
            if change.directory is None:
                self._unload_adapter()
            else:
                self._load_adapter(change.directory, order.timeout_s)
        except EngineRequestError as exc:
            self._refused_load(change, exc)
        phases["load_s"] = time.perf_counter() - tick
        if change.directory is not None:
            assert self._adapter_dirs is not None
            self._adapter_dirs.loaded(change.directory)
        self._name_version(order.version, phases)
        reset_prefix_cache(self._request, self.url, order, phases, requests_running=False)
        tick = time.perf_counter()
        self._resume()
        phases["resume_s"] = time.perf_counter() - tick
        if order.probe is not None:
            tick = time.perf_counter()
            model = self.lora_name if change.directory is not None else self.served_model()
            self._check_probe(order.probe, order.version, model)
            phases["probe_s"] = time.perf_counter() - tick
        tick = time.perf_counter()
        reported = self._read_back_adapter(order.version)
        phases["report_s"] = time.perf_counter() - tick
        return _result(self.url, order.version, start, phases, reported)

    def _refused_load(self, change: AdapterChange, error: EngineRequestError) -> None:
        """vLLM answered the load (or unload) with an error, or none in time. If it lists the
        name at the new directory (it loaded after all), or cannot say, it stays paused and the
        directory is kept; else it serves what it served: the directory is removed, vLLM
        resumed.

        Raises:
            EngineRequestError: always (`error`, and which case it is).
        """
        try:
            listed = self._listed_adapter(CONTROL_TIMEOUT_S)
        except EngineRequestError as asking:  # whether it loaded is unknown: keep it all
            raise EngineRequestError(
                f"{error}; and vLLM could not say which adapter it lists: {asking} (vLLM stays "
                "paused until a good push)"
            ) from None
        if change.directory is not None and listed == str(change.directory):
            assert self._adapter_dirs is not None
            self._adapter_dirs.loaded(change.directory)  # vLLM reads it: never remove it now
            raise EngineRequestError(
                f"{error}, yet vLLM lists adapter {self.lora_name!r} at {listed} (vLLM stays "
                "paused until a good push)"
            ) from None
        if change.directory is not None and self._adapter_dirs is not None:
            self._adapter_dirs.discard(change.directory)
        self._resume()
        raise EngineRequestError(f"{error}; {ADAPTER_UNTOUCHED}") from None

    def _read_back_adapter(self, version: str) -> str:
        """What vLLM serves after an adapter push (fail closed: vLLM paused if unknown)."""
        states = self.worker_states(CONTROL_TIMEOUT_S)
        try:
            served = self._served_fingerprint(states, CONTROL_TIMEOUT_S, strict=True)
        except EngineRequestError as exc:
            self._pause("abort", CONTROL_TIMEOUT_S)
            raise EngineRequestError(
                f"after loading {version!r}: {exc} (vLLM stays paused until a good push)"
            ) from None
        assert served is not None  # strict: raised instead
        return served

    def _load_adapter(self, directory: Path, timeout_s: float) -> None:
        """`/v1/load_lora_adapter` in place: vLLM's workers load and validate the directory,
        then the name points at it (one step: no request finds the name missing)."""
        body = {"lora_name": self.lora_name, "lora_path": str(directory), "load_inplace": True}
        self._lora_route("/v1/load_lora_adapter", body, timeout_s + HTTP_MARGIN_S)

    def _unload_adapter(self) -> None:
        """Unload `lora_name` if vLLM lists it (on a server that serves adapters)."""
        config = self._server_config(CONTROL_TIMEOUT_S)
        if config.max_lora_rank is None or not config.lora_updating:
            return
        if self._listed_adapter(CONTROL_TIMEOUT_S) is not None:
            body = {"lora_name": self.lora_name}
            self._lora_route("/v1/unload_lora_adapter", body, CONTROL_TIMEOUT_S)

    def _lora_route(self, path: str, body: dict, timeout_s: float) -> None:
        """One of vLLM's LoRA routes (they answer 200 with plain text).

        Raises:
            EngineRequestError: no answer within `timeout_s`, or another status (vLLM's reason).
        """
        try:
            response = self._http.post(f"{self.url}{path}", json=body, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise EngineRequestError(f"{path}: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise EngineRequestError(f"{path}: {error_reason(response)}")

    def completion_model(self, timeout_s: float) -> str:
        """The `model` a request names to sample what this target last pushed: `lora_name`
        while vLLM lists an adapter under it, else the base model's name."""
        if self._server_config(timeout_s).max_lora_rank is None:
            return self.served_model()
        return self.lora_name if self._listed_adapter(timeout_s) else self.served_model()

    def _listed_adapter(self, timeout_s: float) -> str | None:
        """The directory vLLM serves `lora_name` from (`GET /v1/models`), None: not listed."""
        for card in self._request("GET", "/v1/models", timeout_s).get("data", []):
            if card.get("id") == self.lora_name:
                return card.get("root")
        return None

    def _served_fingerprint(
        self, states: "WorkerStates | None", timeout_s: float, *, strict: bool = False
    ) -> str | None:
        """What vLLM serves as one fingerprint: its base (`_base_of` the workers' `states`),
        with the adapter it lists under `lora_name` (read from the directory's identity
        file).

        Returns:
            None: unknown (no worker extension, a base weightbus does not know, or an adapter
            not written by weightbus, unreadable here or trained on another base).

        Raises:
            EngineRequestError: with `strict`, where None would be returned.
        """
        base = None if states is None else self._base_of(states)
        config = self._server_config(timeout_s)
        listed = self._listed_adapter(timeout_s) if config.max_lora_rank is not None else None
        identity = None if listed is None else read_identity(listed)
        if listed is None:
            served = base
        elif identity is not None and identity.spec.base_fingerprint == base:
            served = identity.served_fingerprint
        else:
            served = None
        if served is None and strict:
            raise EngineRequestError(
                f"{self.url}: cannot read back what vLLM serves: base {base}, adapter "
                f"{self.lora_name!r} from {listed} ({identity})"
            )
        return served
