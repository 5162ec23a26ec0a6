"""`ShardedPublisher`: every rank of a sharded trainer pushes together, each sending the bytes it
holds, with no gather.

Every rank calls `push` with its own shards (an FSDP2 module, DTensors, `DeclaredShard`s, plain
tensors). The ranks first agree on the model (each reports what it holds and whether its shards
hold NaN/inf; every rank builds the same `TrainerLayout`, reused while it is unchanged). Rank 0
then runs the push as a `Publisher` does (orders, two-phase commit, results) with a sink whose
bytes every rank writes (`ShardedShmSink`), and announces the outcome; the other ranks copy
their pieces when told and return (or raise) what rank 0 does.
"""

import contextlib
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import torch
import torch.distributed as dist

from weightbus.core.finite import NOTHING_SENT, NonFiniteWeightsError, describe_nonfinite
from weightbus.core.fp8 import Fp8Block, describe, fp8_spec
from weightbus.core.lora import adapter_name_map, check_adapter
from weightbus.core.plan.planner import DEFAULT_BUCKET_BYTES
from weightbus.core.publisher.adapter import AdapterState
from weightbus.core.publisher.fleet import Fleet
from weightbus.core.publisher.push_session import PushRequest, PushRun, push_options
from weightbus.core.publisher.results import PushError, PushResult
from weightbus.core.publisher.session import NameMap, SessionFactory
from weightbus.core.publisher.targets import EngineTarget, HttpEngineTarget
from weightbus.core.sharded.control import ControlMessage, GroupControl, TrainerRankError
from weightbus.core.sharded.disk import GroupDisk, ShardedDiskSink
from weightbus.core.sharded.dist_send import GroupDist
from weightbus.core.sharded.dist_sink import ShardedDistSink
from weightbus.core.sharded.holdings import Holding, holdings_of, tied_heads
from weightbus.core.sharded.layout import HeldMeta, TrainerLayout, held_metas
from weightbus.core.sharded.nixl_sink import ShardedNixlSink
from weightbus.core.sharded.nixl_write import GroupNixlWriter
from weightbus.core.sharded.quantize import quantized_holdings, to_quantize
from weightbus.core.sharded.sink import ShardedShmSink, SharedPush
from weightbus.core.sharded.slots import GroupSlots
from weightbus.core.sharded.steps import (
    AnyStep,
    DiskStep,
    DistJoinStep,
    DistStep,
    NixlWriteStep,
    OutcomeStep,
    PackStep,
    SlotsStep,
    Step,
    WriteStep,
)
from weightbus.core.sharded.write import GroupWriter
from weightbus.core.wire import PauseMode, VerifyLevel
from weightbus.core.wire.adapter import AdapterSpec

logger = logging.getLogger(__name__)

SHARDED_TRANSPORTS = ("shm", "nixl", "dist", "disk")
# a follower waits this much longer than the push's bound for rank 0's outcome (rank 0 answers
# within the bound; a dead rank 0 is noticed at once, through the store's connection)
_OUTCOME_GRACE_S = 30.0
# rank 0's close waits this long for the other ranks to read the last outcome
_CLOSE_WAIT_S = 5.0


class _Ready(msgspec.Struct, frozen=True, kw_only=True):
    held: list[HeldMeta]
    nonfinite: list[str]
    tied: list[str]  # heads held bit-equal to their embeddings (`tied_heads`)


def _tied_everywhere(readies: list[_Ready]) -> set[str]:
    """Heads every rank holding them found bit-equal to their embeddings: not sent."""
    holders: dict[str, int] = {}
    for ready in readies:
        for meta in ready.held:
            holders[meta.name] = holders.get(meta.name, 0) + 1
    votes: dict[str, int] = {}
    for ready in readies:
        for name in ready.tied:
            votes[name] = votes.get(name, 0) + 1
    return {name for name, count in votes.items() if count == holders[name]}


@dataclass(frozen=True)
class ShardedPushResult:
    """A committed sharded push: the version, its fingerprint, the bytes each trainer rank
    copied (`sent_bytes[rank]`) and, on rank 0, the engines' results (`result`);
    `quantization` as `PushResult.quantization` (the fingerprint is of the quantized tensors);
    `adapter` as `PushResult.adapter` (a LoRA adapter push)."""

    version: str
    fingerprint: str
    sent_bytes: list[int]
    result: PushResult | None
    quantization: str | None = None
    adapter: AdapterSpec | None = None


class ShardedPublisher:
    """One handle per trainer rank on a fleet of engines (built collectively by every rank).

    Args:
        engines: the engines (URLs or targets); only rank 0 talks to them (the others may pass
            the same list or nothing).
        group: the trainer's process group (None: the default group).
        transport: `shm` (engines on this host, shared-memory weights), `nixl` (each rank
            writes into the engine ranks' memory), `dist` (each rank a member of the weights
            group, which forms on the first push: `transport_options` `master_addr`, rank
            0's address as every engine and rank reaches it) or `disk`.
        control_host: an address of rank 0 that every rank reaches.
        bucket_bytes, token, timeout_s: as `Publisher`.
        direct: write straight into the engine ranks' parameters where every rank offers them
            (else, and with False, every trainer rank packs its parts of each bucket into the
            shared slots: vLLM, engines started with `--no-shm-weights`).
        quantize: as `Publisher`: each rank quantizes its own shards to block FP8
            (`core/sharded/quantize.py`; a shard must cover whole blocks, else the push is
            refused naming the tensor and the rows and columns the rank holds).

    Raises:
        ValueError: a transport that cannot take sharded sources (naming the alternatives).
        TrainerRankError: the ranks could not form the control store in `timeout_s`.
    """

    def __init__(
        self,
        engines: list[str | EngineTarget] | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        transport: str = "shm",
        control_host: str = "127.0.0.1",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        token: str | None = None,
        timeout_s: float = 120.0,
        direct: bool = True,
        transport_options: dict[str, Any] | None = None,
        quantize: Fp8Block | str | None = None,
    ) -> None:
        if transport not in SHARDED_TRANSPORTS:
            raise ValueError(
                f"transport {transport!r} cannot take sharded sources yet; sharded trainers push "
                f"over {', '.join(SHARDED_TRANSPORTS)}, or gather the model to one process and "
                "use a Publisher (every transport)"
            )
        self.timeout_s = timeout_s
        self.quantize = fp8_spec(quantize)
        self._control = GroupControl(group, control_host, timeout_s)
        self._writer = GroupWriter(self._control)
        self._slots = GroupSlots(self._control, self._writer.pool)
        self._nixl: GroupNixlWriter | None = None
        self._disk = GroupDisk(self._control)
        self._dist = GroupDist(self._control)
        self._layouts: dict[bytes, TrainerLayout] = {}
        self._fleet: Fleet | None = None
        self._last_push: str | None = None
        self._http: httpx.Client | None = None
        # the base the engines serve (the last whole push's, or the last adapter's base)
        self._adapter_state = AdapterState()
        if self.rank == 0:
            if not engines:
                raise ValueError("engines: rank 0 needs at least one engine URL or target")
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            self._http = httpx.Client(headers=headers)
            targets = [
                HttpEngineTarget(e, client=self._http) if isinstance(e, str) else e for e in engines
            ]
            self._sink = self._make_sink(transport, direct, transport_options or {})
            self._fleet = Fleet(targets, self._sink, transport, {}, timeout_s)
            self._sessions = SessionFactory(bucket_bytes)

    def _make_sink(
        self, transport: str, direct: bool, options: dict[str, Any]
    ) -> ShardedShmSink | ShardedNixlSink | ShardedDistSink | ShardedDiskSink:
        if transport == "disk":
            return ShardedDiskSink(self._disk, **options)
        if transport == "dist":
            return ShardedDistSink(self._dist, self._control, **options)
        if transport == "nixl":
            return ShardedNixlSink(self._nixl_writer(), **options)
        return ShardedShmSink(self._writer, self._slots, direct=direct)

    def _nixl_writer(self) -> GroupNixlWriter:
        """This rank's NIXL writer (its agent starts on the first `nixl` push)."""
        if self._nixl is None:
            self._nixl = GroupNixlWriter(self._control)
        return self._nixl

    @property
    def rank(self) -> int:
        return self._control.rank

    @property
    def targets(self) -> list[EngineTarget]:
        """The engines, in push order (rank 0; the other ranks talk to none)."""
        return self._fleet.targets if self._fleet is not None else []

    def push(
        self,
        weights: Any,
        *,
        version: str,
        step: int | None = None,
        name_map: NameMap | None = None,
        pause_mode: PauseMode = "drain",
        atomic: bool = True,
        verify: VerifyLevel = "full",
        force: bool = False,
        two_phase: bool | None = None,
        keep_draft: bool = False,
        allow_nonfinite: bool = False,
        adapter: Any = None,
        base_fingerprint: str | None = None,
    ) -> ShardedPushResult:
        """Push what every rank holds as `version` (call it on every rank, with its shards).

        Args:
            weights: this rank's shards: an `nn.Module` (FSDP2), a state dict, or
                `(name, tensor)` pairs of DTensors, `DeclaredShard`s and plain tensors.
            version, step, name_map, pause_mode, atomic, verify, force, two_phase, keep_draft,
                allow_nonfinite: as `Publisher.push` (the push's options are rank 0's).
            adapter, base_fingerprint: as `Publisher.push`: each rank sends its shards of the
                LoRA adapter's matrices only (a peft model's `lora_A` / `lora_B`; the same on
                every rank).

        Returns:
            The same result on every rank (rank 0's also carries the engines' results).

        Raises:
            NonFiniteWeightsError: some rank's shards hold NaN/inf (each named with its rank);
                nothing was sent.
            PushError: an engine did not commit (as `Publisher.push`), raised on every rank.
            TrainerRankError: a rank failed, died or did not answer in time (named).
            ValueError: ranks disagree on the model, or some part of a tensor is held by no
                rank (named); an adapter as for `Publisher.push`.
        """
        options = {
            "pause_mode": pause_mode,
            "atomic": atomic,
            "verify": verify,
            "force": force,
            "two_phase": two_phase,
            "keep_draft": keep_draft,
        }
        spec = None
        if adapter is not None:
            spec, name_map = self._adapter(adapter, base_fingerprint, name_map)
        prefix = self._last_push = self._control.next_push()
        deadline = time.monotonic() + self.timeout_s
        holdings = self._ready(f"{prefix}/ready", weights, name_map, allow_nonfinite)
        layout = self._agree(f"{prefix}/ready", deadline, allow_nonfinite)
        # every rank reported on this push: all of them are done reading the earlier ones
        self._control.forget_earlier_pushes()
        names = {meta.name for meta in layout.metas}  # without tied heads
        held = {holding.name: holding for holding in holdings if holding.name in names}
        if self.rank == 0:
            result = self._lead(
                prefix,
                layout,
                held,
                version=version,
                step=step,
                allow_nonfinite=allow_nonfinite,
                options={**options, "adapter": spec},
            )
        else:
            result = self._follow(prefix, layout, held, version, deadline + _OUTCOME_GRACE_S)
        base = result.fingerprint if spec is None else spec.base_fingerprint
        self._adapter_state.base_fingerprint = base
        return dataclasses.replace(result, adapter=spec)

    def _adapter(
        self, config: Any, base_fingerprint: str | None, name_map: NameMap | None
    ) -> tuple[AdapterSpec, NameMap]:
        """An adapter push's spec and the name map keeping its matrices (peft's names).

        Raises:
            ValueError: a `name_map` or `quantize` with it, no base known, or a peft option
                the engines cannot serve.
        """
        if name_map is not None or self.quantize is not None:
            raise ValueError("an adapter push goes as trained: no name_map or quantize")
        return self._adapter_state.spec_for(config, base_fingerprint), adapter_name_map()

    def _ready(
        self, key: str, weights: Any, name_map: NameMap | None, allow: bool
    ) -> list[Holding]:
        try:
            holdings = holdings_of(weights, name_map)
            # matrices to quantize are checked whatever `allow` says (float8 has no inf)
            named = [
                (h.name, h.local)
                for h in holdings
                if not allow or (self.quantize is not None and to_quantize(h))
            ]
            found = list(describe_nonfinite(named).values())
            if self.quantize is not None and not found:
                holdings = quantized_holdings(holdings, self.quantize)
        except Exception as exc:
            self._control.report(
                key, ControlMessage(ok=False, error=f"{type(exc).__name__}: {exc}")
            )
            raise
        ready = _Ready(held=held_metas(holdings), nonfinite=found, tied=tied_heads(holdings))
        self._control.report(key, ControlMessage(body=msgspec.msgpack.encode(ready)))
        return holdings

    def _agree(self, key: str, deadline: float, allow_nonfinite: bool) -> TrainerLayout:
        reports = self._control.collect(key, "shards' metadata", deadline)
        readies = [msgspec.msgpack.decode(reports[r].body, type=_Ready) for r in sorted(reports)]
        found = [
            f"{f} on trainer rank {rank}"
            for rank, ready in enumerate(readies)
            for f in ready.nonfinite
        ]
        if found:
            raise NonFiniteWeightsError(
                f"the weights hold non-finite values: {', '.join(found)}; {NOTHING_SENT} "
                "(push with allow_nonfinite=True to send them anyway)"
            )
        tied = _tied_everywhere(readies)
        held = [[meta for meta in ready.held if meta.name not in tied] for ready in readies]
        encoded = msgspec.msgpack.encode(held)
        layout = self._layouts.get(encoded)
        if layout is None:
            layout = TrainerLayout(tuple(tuple(metas) for metas in held))
            self._layouts = {encoded: layout}
        return layout

    def _lead(
        self,
        prefix: str,
        layout: TrainerLayout,
        holdings: dict[str, Holding],
        *,
        version: str,
        step: int | None,
        allow_nonfinite: bool,
        options: dict[str, Any],
    ) -> ShardedPushResult:
        assert self._fleet is not None
        steps = itertools.count(1)

        def announce(message: Step) -> None:
            encoded = msgspec.msgpack.encode(message)
            self._control.announce(f"{prefix}/step/{next(steps)}", ControlMessage(body=encoded))

        deadline = time.monotonic() + self.timeout_s
        shared = SharedPush(f"{prefix}/write", layout, holdings, announce, deadline)
        self._sink.push = shared
        try:
            if isinstance(self._sink, ShardedDistSink):
                self._sink.ensure_group(self._fleet.targets)
            adapter = options.pop("adapter")
            order = push_options(
                self._fleet, version=version, step=step, allow_nonfinite=allow_nonfinite, **options
            )
            metas = {
                m.name: torch.empty(m.shape, dtype=m.dtype, device="meta") for m in layout.metas
            }
            if adapter is not None:
                check_adapter(metas, adapter)
                order = msgspec.structs.replace(order, adapter=adapter)
            request = PushRequest(metas, version, step, order)
            result = PushRun(self._fleet, self._sessions, request).run()
        except PushError as exc:
            announce(
                OutcomeStep(
                    ok=False,
                    message=str(exc),
                    failures=exc.failures,
                    transport_error=exc.transport_error,
                    aborted=exc.aborted,
                )
            )
            raise
        except BaseException as exc:
            announce(OutcomeStep(ok=False, message=f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            self._sink.push = None
        announce(OutcomeStep(ok=True, fingerprint=result.fingerprint, sent_bytes=shared.sent_bytes))
        return ShardedPushResult(
            version, result.fingerprint, shared.sent_bytes, result, self._quantization()
        )

    def _follow(
        self,
        prefix: str,
        layout: TrainerLayout,
        holdings: dict[str, Holding],
        version: str,
        deadline: float,
    ) -> ShardedPushResult:
        """Do what rank 0 announces until the outcome, and return or raise it."""
        try:
            for number in itertools.count(1):
                message = self._control.await_announcement(
                    f"{prefix}/step/{number}", "word on the push", deadline
                )
                step = msgspec.msgpack.decode(message.body, type=AnyStep)
                key = f"{prefix}/write"
                if isinstance(step, WriteStep):
                    self._writer.write(key, step.order, layout, holdings, deadline)
                    continue
                if isinstance(step, NixlWriteStep):
                    self._nixl_writer().write(key, step.order, layout, holdings, deadline)
                    continue
                if isinstance(step, DistJoinStep):
                    with contextlib.suppress(Exception):  # reported; rank 0's outcome follows
                        self._dist.join(f"{key}/join", step.order)
                    continue
                if isinstance(step, DistStep):
                    with contextlib.suppress(Exception):  # reported; rank 0's outcome follows
                        self._dist.run(key, step.order, layout, holdings, deadline)
                    continue
                if isinstance(step, DiskStep):
                    self._disk.write(key, step.order, layout, holdings, deadline)
                    continue
                if isinstance(step, SlotsStep):
                    self._slots.begin(key, step.order, layout, holdings, deadline)
                    continue
                if isinstance(step, PackStep):
                    self._slots.pack(key, step.bucket, step.slot, holdings, deadline)
                    continue
                if step.ok:
                    return ShardedPushResult(
                        version, step.fingerprint, step.sent_bytes, None, self._quantization()
                    )
                if step.failures or step.transport_error:
                    raise PushError(
                        version, step.failures, step.transport_error, aborted=step.aborted
                    )
                raise TrainerRankError(f"trainer rank 0 failed the push: {step.message}")
        finally:  # rank 0 keeps the store up until every rank read the outcome (`close`)
            self._control.report(f"{prefix}/read", ControlMessage())

    def _quantization(self) -> str | None:
        return None if self.quantize is None else describe(self.quantize)

    def close(self) -> None:
        """Free the sink, mapped files and the engines' clients (rank 0: once every rank read
        the last push's outcome, or `_CLOSE_WAIT_S` passed; its store serves them)."""
        if self.rank == 0 and self._last_push is not None:
            self._control.report(f"{self._last_push}/read", ControlMessage())
            try:
                deadline = time.monotonic() + _CLOSE_WAIT_S
                self._control.collect(f"{self._last_push}/read", "read of the outcome", deadline)
            except TrainerRankError as exc:
                logger.warning("closing the trainer group's store anyway: %s", exc)
        if self._fleet is not None:
            self._fleet.release()
            for target in self._fleet.targets:
                target.close()
        if self._http is not None:
            self._http.close()
        self._slots.close()
        self._writer.close()
        self._dist.close()

    def __enter__(self) -> "ShardedPublisher":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
