"""The Publisher: pushes a model version into every engine and waits for their commits.

`Publisher` is a facade: it checks and normalizes what the trainer gives, and delegates.
`Publisher.push` turns its arguments into one `PushRequest` (the normalized tensors and the
order every engine's is made from) and hands it to `push_version` (`push_session.py`): a delta
when every engine can take one, else the whole version, each a `PushRun` (one session to every
engine: plan → prepare → order → stream → collect). The engines, their sink, the two-phase
commit, `rollback` and `add_engine` / `remove_engine` are the `Fleet`'s (`fleet.py`); a
newcomer is brought to the fleet's version first by `catch_up`, a push of its own on a sibling
fleet.
"""

import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from weightbus.core.delta import version_digests
from weightbus.core.finite import (
    NOTHING_SENT,
    NOTHING_SERVED,
    NonFiniteWeightsError,
    refuse_nonfinite,
)
from weightbus.core.fp8 import (
    Fp8Block,
    describe,
    fp8_spec,
    quantize_weights,
    refuse_nonfinite_to_quantize,
)
from weightbus.core.plan import DEFAULT_BUCKET_BYTES
from weightbus.core.publisher.adapter import AdapterState, push_adapter
from weightbus.core.publisher.delta import (
    DEFAULT_MAX_RATIO,
    DeltaMode,
    DeltaState,
    check_delta_mode,
)
from weightbus.core.publisher.fleet import Fleet
from weightbus.core.publisher.probe import LogprobProbe
from weightbus.core.publisher.push_session import (
    PushRequest,
    catch_up,
    push_options,
    push_version,
    stream_refuses_nonfinite,
)
from weightbus.core.publisher.results import FleetVersion, PushResult
from weightbus.core.publisher.session import NameMap, SessionFactory, Weights, normalize_weights
from weightbus.core.publisher.targets import (
    EngineResult,
    EngineTarget,
    EngineWeights,
    HttpEngineTarget,
    PushOrder,
)
from weightbus.core.transport import BucketSink, WeightsGroupInfo
from weightbus.core.transport.base import Progress
from weightbus.core.wire import PauseMode, VerifyLevel
from weightbus.core.wire.adapter import AdapterSpec

logger = logging.getLogger(__name__)

# Bound of reading the version every engine serves (`engine_weights`).
_CONTROL_TIMEOUT_S = 10.0


class Publisher:
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
        quantize: `Fp8Block()` (or "fp8-block": 128x128 blocks) quantizes every decoder-layer
            matrix to block FP8 before the bytes leave (`weightbus.core.fp8`): the engines
            serve FP8 (`weightbus serve --quantization fp8-block`), the wire carries about
            half of bf16, and fingerprints, deltas and `PushResult.nbytes` are of the
            quantized tensors (`PushResult.quantization` says so). None: as given.

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
        quantize: Fp8Block | str | None = None,
    ) -> None:
        if not engines:
            raise ValueError("engines: give at least one engine URL or target")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.quantize = fp8_spec(quantize)
        self.delta = check_delta_mode(delta)
        self._delta = DeltaState(delta_max_ratio, delta_sparse)
        self.bucket_bytes = bucket_bytes
        self._sessions = SessionFactory(bucket_bytes)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(headers=headers)
        targets = [self._target(engine) for engine in engines]
        try:
            options = dict(transport_options or {})
            self._fleet = Fleet.build(targets, transport, options, timeout_s)
        except Exception:
            self._http.close()
            raise
        self._lock = threading.RLock()
        self._adapter = AdapterState()

    def _target(self, engine: str | EngineTarget) -> EngineTarget:
        return HttpEngineTarget(engine, client=self._http) if isinstance(engine, str) else engine

    @property
    def targets(self) -> list[EngineTarget]:
        """The members, in push order."""
        return self._fleet.targets

    @property
    def engines(self) -> list[str]:
        """The members' URLs, in push order."""
        return self._fleet.urls

    @property
    def transport(self) -> str | dict[str, str]:
        """The transport's name, or each routed engine's by URL."""
        return self._fleet.transport

    @property
    def transports(self) -> set[str]:
        """The transports pushes take (one, or each routed engine's)."""
        return self._fleet.transports

    @property
    def timeout_s(self) -> float:
        """Bound of one push on every engine."""
        return self._fleet.timeout_s

    @property
    def fleet_version(self) -> FleetVersion | None:
        """What every member serves since this Publisher's last commit (None before the
        first)."""
        return self._fleet.version

    @property
    def delta_base_nbytes(self) -> int:
        """Host memory held to encode deltas: a copy of the last version pushed (0 with
        deltas off)."""
        return self._delta.base_nbytes

    @property
    def sink(self) -> BucketSink:
        """The transport's sink (e.g. `DistSink.rank_sent_bytes`: per rank, the last push)."""
        return self._fleet.sink

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the transport (files, shared memory, sockets, its set-up on the engines), the
        targets and the HTTP connections."""
        self._fleet.close()
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
            return self._fleet.setup(**options)

    def teardown_transport(self, timeout_s: float = 60.0) -> None:
        """Undo `setup_transport` here and on every engine."""
        with self._lock:
            self._fleet.teardown(timeout_s)

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
        return self._fleet.engine_weights(timeout_s)

    def fingerprint(self, weights: Weights, name_map: NameMap | None = None) -> str:
        """The fingerprint engines report after a push of `weights` (computed locally; of the
        quantized tensors with `quantize`)."""
        return self._sessions.fingerprint(self._served(weights, name_map).items())

    def _served(self, weights: Weights, name_map: NameMap | None) -> dict[str, Any]:
        """The tensors engines serve: `weights` renamed, quantized with `quantize`.

        Raises:
            NonFiniteWeightsError: `quantize` is set and matrices to quantize hold NaN or inf
                (each named with its counts; float8_e4m3fn has none to carry, whatever
                `allow_nonfinite` says): nothing was sent.
        """
        tensors = dict(normalize_weights(weights, name_map))
        if self.quantize is None:
            return tensors
        refuse_nonfinite_to_quantize(tensors, NOTHING_SENT)
        return dict(quantize_weights(tensors.items(), self.quantize))

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
            tensors = self._served(weights, name_map)
            digests, fingerprint = version_digests(tensors)
            self._delta.committed_full(tensors, version, fingerprint, digests)
            self._adapter.base_fingerprint = fingerprint
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
        allow_nonfinite: bool = False,
        adapter: Any = None,
        base_fingerprint: str | None = None,
    ) -> PushResult:
        """Push `weights` as `version` into every engine; block until all committed.

        Args:
            weights: an `nn.Module`, a state dict, or `(name, tensor)` pairs with HF names;
                with `adapter`, a `PeftModel` or an adapter's state dict (peft's names).
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
            allow_nonfinite: send NaN and infinite values (a diverged step is refused
                otherwise, and engines refuse one in their verify pass). The check reads
                every byte before any is sent; an atomic whole-version push over `shm` into
                engines that stage while serving (the reference engine; not vLLM) checks in
                its copy pass instead (cheaper: the bytes it reads are in cache), so engines
                may have staged part of it when it is refused (and discarded it; the version
                their staging memory held for `rollback` is gone then).
            adapter: a LoRA adapter push (`weightbus.core.lora`): the peft `LoraConfig` (or
                its dict) of the adapter in `weights`. Only the adapter's `lora_A` / `lora_B`
                travel; engines apply it to the base they serve (started with
                `--lora-rank` / `--lora-targets`, or vLLM's `--enable-lora`).
                `PushResult.fingerprint` is then base and adapter's (`served_fingerprint`).
            base_fingerprint: with `adapter`, the base model's fingerprint
                (`fingerprint(base_weights(peft_model))`); default: this Publisher's last
                whole push. Engines serving another base refuse the adapter (409, naming both).

        Returns:
            The committed version, its fingerprint and per-engine results; `gone` names engines
            that failed after the commit point (removed from this Publisher).

        Raises:
            PushError: an engine refused, failed or timed out (each one named with its reason);
                two-phase: no engine committed.
            NonFiniteWeightsError: a tensor holds NaN or inf (each named with its counts) and
                `allow_nonfinite` is off, or with `quantize` a matrix to quantize does (always);
                no engine serves any of it: nothing was sent, or (checked in the copy pass)
                every engine discarded what it had staged.
            ValueError: a probe for targets that cannot score one; `two_phase` with an in-place
                push or targets that cannot stage and commit on a later word; an adapter with
                no base fingerprint known, with peft options engines cannot serve, or with
                `delta`, `name_map` or `quantize` (adapters go whole, as trained).
        """
        with self._lock:
            options = push_options(
                self._fleet,
                version=version,
                step=step,
                pause_mode=pause_mode,
                atomic=atomic,
                verify=verify,
                force=force,
                probe=probe,
                two_phase=two_phase,
                keep_draft=keep_draft,
                allow_nonfinite=allow_nonfinite,
            )
            if adapter is not None:
                if delta not in (None, "never") or name_map is not None or self.quantize:
                    raise ValueError(
                        "an adapter push goes whole and as trained: no delta, name_map or quantize"
                    )
                spec = self._adapter.spec_for(adapter, base_fingerprint)
                return self._push_adapter(weights, spec, options, progress)
            tensors = self._served(weights, name_map)
            mode = self.delta if delta is None else check_delta_mode(delta)
            in_stream = self._checks_nonfinite_in_stream(options, mode)
            if not allow_nonfinite and not in_stream:
                refuse_nonfinite(tensors.items())
            request = PushRequest(
                tensors, version, step, options, progress, nonfinite_in_stream=in_stream
            )
            try:
                result = push_version(self._fleet, self._sessions, self._delta, request, mode)
            except NonFiniteWeightsError:
                # the stream named the first bad tensor it met: name them all, with counts
                refuse_nonfinite(tensors.items(), NOTHING_SERVED)
                raise
            self._adapter.base_fingerprint = result.fingerprint
            if self.quantize is None:
                return result
            return dataclasses.replace(result, quantization=describe(self.quantize))

    def _push_adapter(
        self, weights: Weights, spec: AdapterSpec, options: PushOrder, progress: Progress | None
    ) -> PushResult:
        tensors, result = push_adapter(
            self._fleet,
            sessions=self._sessions,
            weights=weights,
            spec=spec,
            options=options,
            progress=progress,
        )
        self._adapter.committed(tensors, spec)
        return result

    def remove_adapter(
        self,
        *,
        version: str,
        step: int | None = None,
        pause_mode: PauseMode = "drain",
        atomic: bool = True,
        two_phase: bool | None = None,
    ) -> PushResult:
        """Make every engine serve the base alone again, as `version` (a push of zeros of the
        last adapter's shapes, with `AdapterSpec.active` off: as atomic, two-phase and
        versioned as any push; the engines report the base's fingerprint).

        Raises:
            ValueError: this Publisher pushed no adapter.
            PushError: as for `push`.
        """
        with self._lock:
            zeros, spec = self._adapter.removal()
            options = push_options(
                self._fleet,
                version=version,
                step=step,
                pause_mode=pause_mode,
                atomic=atomic,
                two_phase=two_phase,
            )
            return self._push_adapter(zeros, spec, options, None)

    def _checks_nonfinite_in_stream(self, options: PushOrder, mode: DeltaMode) -> bool:
        """Whether this push's NaN/inf check runs in the sink's copy pass, so the pre-pass over
        every byte is skipped (`stream_refuses_nonfinite`). Only for a push that cannot go as a
        delta (deltas off, or no base yet): a delta streams encoded bits, not weights, and
        whether one goes is known only once engines are asked."""
        may_go_as_delta = mode != "never" and self._delta.base is not None
        return stream_refuses_nonfinite(self._fleet, options, delta=may_go_as_delta)

    def rollback(
        self, *, pause_mode: PauseMode = "drain", timeout_s: float | None = None
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
            return self._fleet.rollback(pause_mode, timeout_s)

    def add_engine(
        self,
        engine: str | EngineTarget,
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
        route = self._fleet.newcomer_route(target.url, transport)
        current = self._fleet.version
        result = None
        if current is not None:
            result = catch_up(
                self._fleet,
                target,
                weights=None if weights is None else self._served(weights, name_map),
                name_map=None,
                route=route,
                current=current,
                bucket_bytes=self.bucket_bytes,
            )
        with self._lock:
            self._fleet.admit(target, route, current)
        logger.info("engine %s joined the fleet", target.url)
        return result

    def remove_engine(self, url: str) -> None:
        """Stop pushing to an engine (alive or not); it keeps serving what it serves.

        Raises:
            ValueError: no member has this URL, or it is the last one.
            WeightsGroupError: a `dist` group could not re-form over the other members (the
                next push says so too; `init_weights_group` re-forms it).
        """
        with self._lock:
            self._fleet.remove(url)
