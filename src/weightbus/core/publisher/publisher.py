"""The Publisher: pushes a model version from a trainer into every engine and waits for their
commits.

The trainer side is a group of ranks: one process holding every tensor is the group of one
(`Publisher(engines)`), every rank of a sharded trainer (FSDP2, Megatron shards, pipeline
stages, replicas) builds one with its process group (`Publisher(engines, group=...)`) and
calls it collectively, each rank sending what it holds. `Publisher` is a facade: it checks
what the caller gives and delegates to `Pushes` (`pushes.py`: the collective calls, rank by
rank), which runs each push as a `PushRun` (`push_session.py`) on the leader's `Fleet`
(`fleet.py`).
"""

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from weightbus.core.fp8 import Fp8Block, fp8_spec
from weightbus.core.plan import DEFAULT_BUCKET_BYTES
from weightbus.core.publisher.delta import DEFAULT_MAX_RATIO, DeltaMode, DeltaState
from weightbus.core.publisher.probe import LogprobProbe
from weightbus.core.publisher.push_session import PushArgs
from weightbus.core.publisher.pushes import Pushes
from weightbus.core.publisher.ranks import TrainerRanks
from weightbus.core.publisher.results import FleetVersion, PushResult
from weightbus.core.publisher.targets import EngineResult, EngineTarget, EngineWeights
from weightbus.core.trainer.group import TrainerGroup
from weightbus.core.transport import BucketSink, WeightsGroupInfo
from weightbus.core.transport.base import Progress
from weightbus.core.weights import NameMap, Weights
from weightbus.core.wire import PauseMode, VerifyLevel
from weightbus.core.wire.order import RunningKV

logger = logging.getLogger(__name__)

_CONTROL_TIMEOUT_S = 10.0  # bound of reading the version every engine serves


class Publisher:
    """Trainer-side handle on a fleet of engines (one rank or many: docs/sharded.md).

    Args:
        engines: the engines: URLs of engines speaking weightbus's HTTP API, or
            `EngineTarget`s, in any mix. Only the leader (rank 0) talks to them: the other
            ranks may pass nothing. `close` closes every target.
        group: the trainer's process group when every rank pushes what it holds (FSDP2,
            Megatron, pipeline stages, replicas): every rank builds the Publisher and calls
            it collectively. None: this process holds every tensor (a group of one).
        transport: a registered transport (`transport_names()`), or each engine's by URL
            (`{url: "shm", url2: "nixl"}`: one push, each engine over its own transport).
        bucket_bytes: bucket size of the plan (and of transport buffers).
        token: bearer token of the engines' admin routes, if they require one.
        timeout_s: bound of one push (and of every other call) on every engine and rank.
        transport_options: keyword arguments of the transport's sink (with routes, by
            transport name).
        delta, delta_max_ratio, delta_sparse: how pushes go by default (docs/delta.md):
            `never`, `always` or `auto` (a delta when it carries at most `delta_max_ratio`
            of the bytes); each rank keeps a host copy of what it pushed last.
        quantize: `Fp8Block()` or "fp8-block": each rank quantizes what it holds to block FP8
            before a byte leaves (docs/fp8.md).
        control_host: with `group`, an address of rank 0 every rank reaches.
        progress: each push draws a tqdm bar on stderr (bytes, rate, ETA), on the leader and
            when stderr is a terminal; the bar follows the same bytes as `push`'s `progress`.

    Raises:
        ValueError: the leader has no engines, an unknown transport, or a non-positive timeout.
        TrainerRankError: with `group`, the ranks could not form their store in `timeout_s`.
    """

    def __init__(
        self,
        engines: Sequence[str | EngineTarget] | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        transport: str | Mapping[str, str] = "disk",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        token: str | None = None,
        timeout_s: float = 120.0,
        transport_options: dict[str, Any] | None = None,
        delta: DeltaMode = "never",
        delta_max_ratio: float = DEFAULT_MAX_RATIO,
        delta_sparse: bool = True,
        quantize: Fp8Block | str | None = None,
        control_host: str = "127.0.0.1",
        progress: bool = False,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.quantize = fp8_spec(quantize)
        self.bucket_bytes = bucket_bytes
        self.progress = progress
        trainer = (
            TrainerGroup.local()
            if group is None
            else TrainerGroup.of(group, control_host, timeout_s)
        )
        self._pushes = Pushes.build(
            engines,
            TrainerRanks(trainer, bucket_bytes),
            transport=transport,
            token=token,
            timeout_s=timeout_s,
            transport_options=dict(transport_options or {}),
            deltas=DeltaState.of(delta, delta_max_ratio, delta_sparse),
            delta_mode=delta,
            quantize=self.quantize,
        )
        self._lock = threading.RLock()

    @property
    def rank(self) -> int:
        """This process's rank in the trainer group (0: the leader, which talks to engines)."""
        return self._pushes.ranks.rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the trainer group (1: this process holds every tensor)."""
        return self._pushes.ranks.group.world_size

    @property
    def targets(self) -> list[EngineTarget]:
        """The members, in push order (on the leader; none on the other ranks)."""
        return self._pushes.fleet.targets if self._pushes.fleet is not None else []

    @property
    def engines(self) -> list[str]:
        """The members' URLs, in push order (on the leader)."""
        return [target.url for target in self.targets]

    @property
    def transport(self) -> str | dict[str, str]:
        """The transport's name, or each routed engine's by URL (`transports`: the set of
        them); on the leader."""
        return self._pushes.leader_fleet.transport

    @property
    def transports(self) -> set[str]:
        return self._pushes.leader_fleet.transports

    @property
    def timeout_s(self) -> float:
        """Bound of one push on every engine and rank."""
        return self._pushes.timeout_s

    @property
    def fleet_version(self) -> FleetVersion | None:
        """What every member serves since the last commit (on the leader)."""
        return None if self._pushes.fleet is None else self._pushes.fleet.version

    @property
    def delta_base_nbytes(self) -> int:
        """Host memory this rank holds to encode deltas (0 with deltas off)."""
        return self._pushes.deltas.base_nbytes

    @property
    def sink(self) -> BucketSink:
        return self._pushes.leader_fleet.sink

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the transport (and its set-up on the engines), targets, senders, connections."""
        self._pushes.close()

    def setup_transport(self, **options: Any) -> Any:
        """Set the transport up on every engine and trainer rank (again on a second call: the
        `dist` group's `master_addr`, `master_port`, `backend`, `timeout_s`); returns its report
        (`WeightsGroupInfo`; routed: by transport). ValueError: the transport needs none."""
        with self._lock:
            return self._pushes.setup_transport(options)

    def teardown_transport(self, timeout_s: float = 60.0) -> None:
        """Undo `setup_transport` here and on every engine."""
        with self._lock:
            self._pushes.teardown_transport(timeout_s)

    def init_weights_group(
        self, master_addr: str, master_port: int = 0, *, backend: str = "gloo",
        timeout_s: float = 60.0,
    ) -> WeightsGroupInfo:  # fmt: skip
        """`setup_transport` of `dist` (SGLang's name): the trainer ranks first, rank r of
        engine i at `offset_i + r`. Raises `WeightsGroupError` naming who could not join."""
        if self._pushes.fleet is not None and "dist" not in self.transports:
            raise ValueError(f"init_weights_group needs transport 'dist', not {self.transport!r}")
        return self.setup_transport(
            master_addr=master_addr, master_port=master_port, backend=backend, timeout_s=timeout_s
        )

    def destroy_weights_group(self, timeout_s: float = 60.0) -> None:
        """Leave the `dist` weights group here and on every engine (`teardown_transport`)."""
        self.teardown_transport(timeout_s)

    def engine_weights(self, timeout_s: float = _CONTROL_TIMEOUT_S) -> list[EngineWeights]:
        """What every engine serves now (on the leader; `EngineRequestError`: no answer)."""
        return self._pushes.leader_fleet.engine_weights(timeout_s)

    def fingerprint(self, weights: Weights, name_map: NameMap | None = None) -> str:
        """The fingerprint engines report after a push of `weights` (quantized with
        `quantize`); with a group, collectively: each rank digests what it holds."""
        with self._lock:
            return self._pushes.fingerprint(weights, name_map)

    def set_delta_base(
        self, weights: Weights, *, version: str, name_map: NameMap | None = None
    ) -> str:
        """Take `weights` as the version the engines serve (e.g. the checkpoint they started
        from): the next push with deltas on may be a delta against it. Returns its
        fingerprint."""
        with self._lock:
            return self._pushes.set_delta_base(weights, version, name_map)

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
        running_kv: RunningKV = "keep",
        keep_prefix_cache: bool = False,
    ) -> PushResult:
        """Push `weights` as `version` into every engine; block until all committed. With a
        group, every rank calls it with what it holds.

        Args:
            weights: an `nn.Module`, a state dict or `(name, tensor)` pairs (HF names); on a
                rank of a group, its shards (DTensors, `DeclaredShard`s, plain tensors); with
                `adapter`, a `PeftModel` or an adapter's state dict.
            version, step: the new version (refused if served, unless `force`) and an
                optional increasing training step.
            pause_mode, atomic, two_phase: how engines pause, stage and commit
                (docs/engine.md, docs/fleet.md).
            verify: `full` checks every digest on the engines; `none` skips digests only.
            name_map: renames applied before sending (a name mapped to None is dropped).
            progress: called with the bytes of each part handed to the transport (the
                bar of `Publisher(progress=True)` counts the same).
            probe: logprobs every engine must reproduce once it serves the version (run
                `LogprobProbe.of_model` on every rank of a group); a failed one rolls back.
            delta: `never`, `always` or `auto` (None: the Publisher's), docs/delta.md.
            keep_draft: `weights` hold no draft model: engines serving one keep it.
            allow_nonfinite: send NaN and inf (refused otherwise, before any engine serves
                them).
            adapter, base_fingerprint: the peft `LoraConfig` of the adapter in `weights`, and
                its base's fingerprint (default: the last whole push's), docs/lora.md.
            running_kv: `pause_mode="in_place"`: the running requests keep the KV their old
                version computed (`keep`) or recompute it on the new weights (`recompute`).
            keep_prefix_cache: engines keep their prefix cache of the old weights (default:
                dropped once the new weights serve), docs/serving.md.

        Returns:
            The committed version, its fingerprint, per-engine results and the bytes each
            trainer rank sent (`rank_sent_bytes`); the same on every rank.

        Raises:
            PushError: an engine refused, failed or timed out (each named); two-phase: no
                engine committed.
            NonFiniteWeightsError: a tensor holds NaN or inf (named, with its rank); no engine
                serves any of it.
            TrainerRankError: a trainer rank failed, died or did not answer in time (named).
            ValueError: options the engines cannot take, or ranks that disagree on the model.
        """
        args = PushArgs(
            version=version, step=step, pause_mode=pause_mode, atomic=atomic, verify=verify,
            force=force, name_map=name_map, progress=progress, progress_bar=self.progress,
            probe=probe, two_phase=two_phase, delta=delta, keep_draft=keep_draft,
            allow_nonfinite=allow_nonfinite, adapter=adapter, base_fingerprint=base_fingerprint,
            running_kv=running_kv, keep_prefix_cache=keep_prefix_cache,
        )  # fmt: skip
        with self._lock:
            return self._pushes.push(weights, args)

    def remove_adapter(
        self,
        *,
        version: str,
        step: int | None = None,
        pause_mode: PauseMode = "drain",
        atomic: bool = True,
        two_phase: bool | None = None,
    ) -> PushResult:
        """Make every engine serve the base alone again, as `version` (docs/lora.md).
        ValueError: this Publisher pushed no adapter; PushError: as for `push`."""
        args = PushArgs(
            version=version, step=step, pause_mode=pause_mode, atomic=atomic, two_phase=two_phase
        )
        with self._lock:
            return self._pushes.remove_adapter(args)

    def rollback(
        self, *, pause_mode: PauseMode = "drain", timeout_s: float | None = None
    ) -> PushResult:
        """Swap every engine back to the previous version its staging memory holds, moving no
        weights (two-phase with several engines; docs/fleet.md). PushError: an engine holds
        no rollback version or another one, refused, or did not answer (named); none swapped."""
        with self._lock:
            return self._pushes.rollback(pause_mode, timeout_s)

    def add_engine(
        self,
        engine: str | EngineTarget | None,
        weights: Weights | None = None,
        *,
        name_map: NameMap | None = None,
        transport: str | None = None,
    ) -> EngineResult | None:
        """Add an engine, brought to the fleet's version first by a push of its own (every
        rank sends it what it holds; in a group of one, pushes to the members go on meanwhile).

        Args:
            engine: the newcomer's URL or target (the leader's counts).
            weights, name_map: the weights of `fleet_version` (checked by fingerprint).
            transport: the newcomer's transport on a routed Publisher.

        Returns:
            Its catch-up result (None when the fleet has no version yet).

        Raises:
            ValueError: already a member, weights missing or not the fleet's version.
            PushError: the catch-up failed (not added), or the fleet moved meanwhile.
        """
        target = None if engine is None else self._pushes.target(engine)
        return self._pushes.add_engine(target, weights, name_map, transport, self._lock)

    def remove_engine(self, url: str) -> None:
        """Stop pushing to an engine (alive or not); it keeps serving what it serves.
        ValueError: no member has this URL, or it is the last one."""
        with self._lock:
            self._pushes.remove_engine(url)
