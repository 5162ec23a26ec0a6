"""The worker side of backend `weightbus`: one vLLM worker (TP rank) receives a whole push,
every rank agrees it verified, and only then does vLLM load it.

A push arrives as `init_info.push` of `/init_weight_transfer_engine` (the publisher's target
says why not `/update_weights`; `update_weights` takes the same session for vLLM's own clients).
`receive_weights` runs the named steps: `_receive` (a weightbus `Receiver`
over the push's transport, staging every tensor in reusable buffers and checking every digest,
the plan and the fingerprint against the served checkpoint's tensor list), `gather_verdicts`
(all ranks' verdicts over vLLM's CPU TP group), `_load` (the blocks that changed, through
vLLM's layerwise reload, tied heads re-tied). A refusal raises before any parameter is touched
and says so (`UNTOUCHED`): the publisher's target resumes vLLM on the previous weights.

A draft model (speculative decoding, vLLM's `draft_model` method) is pushed in the same session
as the main model, its tensors under `draft.` + its own names, inside a draft session
(`/start_draft_weight_update`, which points `self.model` at the draft until
`/finish_weight_update`): the main model's tensors load into the default model, the draft's
(prefix stripped) into the draft. A server serving a draft refuses a push without its tensors
unless the push keeps the draft (`keep_draft`).
"""

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import torch
from vllm.distributed import get_tp_group
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightbus.core.meta import DRAFT_PREFIX, TensorMeta, is_draft_name
from weightbus.core.receiver import RankResult, Receiver
from weightbus.core.transport import decode_setup_request, open_source, rank_setup
from weightbus.core.wire.messages import SliceSpec
from weightbus.engines.vllm.experts import UnpreparableError, moe_layers, unpreparable
from weightbus.engines.vllm.messages import (
    UNTOUCHED,
    VllmDecision,
    VllmInitInfo,
    VllmRollback,
    VllmTransportSetup,
    VllmUpdateInfo,
)
from weightbus.engines.vllm.reload import reload_weights, unloaded
from weightbus.engines.vllm.slices import SliceMap, worker_slice_map
from weightbus.engines.vllm.staging import (
    HeldVersion,
    StagingBuffers,
    changed_tensors,
    checkpoint_metas,
)
from weightbus.engines.vllm.verdicts import gather_verdicts
from weightbus.engines.vllm.versions import WorkerVersions

T = TypeVar("T")

# a child of vLLM's logger: vLLM configures handlers for its own tree only
logger = logging.getLogger("vllm.weightbus")

# The one speculative method whose draft is a model of its own, updated by name (EAGLE and MTP
# heads share the target's layers and checkpoint).
DRAFT_METHOD = "draft_model"
DRAFT_MISSING = (
    "this vLLM server serves a draft model (speculative decoding): push the draft's tensors "
    f"under {DRAFT_PREFIX!r} in the same version (VllmEngineTarget opens the draft session), "
    "or set keep_draft to keep the draft served"
)
DRAFT_SESSION_WITHOUT_DRAFT = (
    "a draft session is open (/start_draft_weight_update) but the push carries no "
    f"{DRAFT_PREFIX!r} tensors: a push in a draft session carries both models (if a publisher "
    "died inside the session, POST /finish_weight_update closes it)"
)
ADAPTER_NOT_HERE = (
    "a LoRA adapter push does not go through vLLM's weight-transfer backend: vLLM loads "
    "adapters from a directory (VllmEngineTarget pushes them over 'hf_dir' or 'disk')"
)
DRAFT_OUTSIDE_SESSION = (
    f"the push carries {DRAFT_PREFIX!r} tensors outside a draft session: this vLLM server "
    f"serves no draft model (speculative method {DRAFT_METHOD!r}), or the push set keep_draft, "
    "or no /start_draft_weight_update opened the session"
)


@dataclass(frozen=True, slots=True)
class Unreadable:
    """An info that did not parse, and why (raised by the last rank only)."""

    error: str


class WeightbusRefusedError(RuntimeError):
    """A push the ranks did not all verify; the model was not touched."""


class WeightbusLoadError(RuntimeError):
    """vLLM's loader failed after the model was touched: the engine must not serve."""


class WeightbusWeightTransferEngine(
    WeightTransferEngine[WeightTransferInitInfo, WeightTransferUpdateInfo]
):
    """Backend `weightbus` on one vLLM worker."""

    supports_draft_weight_update = True

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.options = VllmInitInfo()
        self._versions = WorkerVersions()
        self._slice_map: SliceMap | None = None
        self._received_bytes = 0  # what the last push's transport brought this rank
        self._main_metas: dict[str, TensorMeta] | None = None
        self._draft_metas: dict[str, TensorMeta] | None = None  # `draft.` names
        self._unpreparable: list[str] | None = None  # MoE layers a load could not prepare

    # typed parsing (vLLM's default is `cls(**dict)`)
    # (vLLM parses on every rank: an unreadable info is raised by the last rank only, as every
    # refusal is, so that no rank's failure is left queued for the next call)
    def parse_init_info(self, init_dict: dict[str, Any]) -> VllmInitInfo | Unreadable:
        return _convert(init_dict, VllmInitInfo, "init_info")

    def parse_update_info(self, update_dict: dict[str, Any]) -> VllmUpdateInfo | Unreadable:
        return _convert(update_dict, VllmUpdateInfo, "update_info")

    # lifecycle
    def init_transfer_engine(self, init_info: VllmInitInfo | Unreadable) -> None:
        if isinstance(init_info, Unreadable):
            _raise_on_last_rank(ValueError(init_info.error))
            return
        self.options = init_info
        if init_info.keep_previous is not None:
            self._versions.resize(keep_previous=init_info.keep_previous)
        if init_info.setup is not None:
            self._setup_transport(init_info.setup)
        if init_info.push is not None:
            self.receive_weights(init_info.push)
        if init_info.commit is not None:
            self._commit(init_info.commit)
        if init_info.abort is not None:
            self._abort(init_info.abort)
        if init_info.rollback is not None:
            self._rollback(init_info.rollback)

    def _setup_transport(self, setup: VllmTransportSetup) -> None:
        """Run a transport's rank set-up (`dist`: join the weights group, reporting the part of
        each tensor this rank loads, so `dist` parts send it only that)."""
        tp = get_tp_group()
        try:
            request = decode_setup_request(setup.transport, setup.request)
            slices = self._slices().specs()
            rank_setup(setup.transport)(
                request, tp_rank=tp.rank_in_group, tp_size=tp.world_size, slices=slices
            )
            error = ""
        except (ValueError, OSError, RuntimeError, TimeoutError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        failures = _failures(gather_verdicts(not error, error, tp.cpu_group))
        if failures:
            _raise_on_last_rank(RuntimeError(f"{setup.transport} set-up failed: {failures}"))

    def start_weight_update(self) -> None:
        """Nothing to prepare: a push is staged whole before anything is loaded."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class synchronizes an accelerator, which raises on CPU-only hosts
        parsed = self.parse_update_info(update_info)
        if isinstance(parsed, Unreadable):
            _raise_on_last_rank(ValueError(parsed.error))
            return
        self.receive_weights(parsed)
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: VllmUpdateInfo) -> None:
        """Receive and verify a push on every rank; then load it, or (two-phase) stage it."""
        tp = get_tp_group()
        version = update_info.version
        start = time.perf_counter()
        buffers, result = self._receive(update_info, tp.rank_in_group, tp.world_size)
        self._received_bytes = result.nbytes
        verdicts = gather_verdicts(result.ok, "; ".join(result.errors), tp.cpu_group)
        received_s = time.perf_counter() - start
        refusals = _failures(verdicts)
        if refusals:
            _raise_on_last_rank(
                WeightbusRefusedError(f"{UNTOUCHED}: version {version!r}: {refusals}")
            )
            return
        assert result.fingerprint is not None
        held = HeldVersion(version, update_info.step, result.fingerprint, result.digests)
        skip = (update_info.skip_unchanged or update_info.delta is not None) and not (
            update_info.force
        )
        if update_info.two_phase:
            self._versions.stage(buffers, held, update_info.timeout_s, only_changed=skip)
            logger.info(
                "weightbus: version %s: received %d bytes in %.3f s; staged for its commit",
                version,
                result.nbytes,
                received_s,
            )
            return
        tick = time.perf_counter()
        loaded = self._load_verified(buffers, held, skip)
        logger.info(
            "weightbus: version %s: received %d bytes in %.3f s (wait %.3f s, verify %.3f s, "
            "staging %.3f s); vLLM loaded %d of %d tensors in %.3f s",
            version,
            result.nbytes,
            received_s,
            result.phases.get("wait_s", 0.0),
            result.phases.get("verify_s", 0.0),
            result.phases.get("load_s", 0.0),
            loaded,
            len(result.digests),
            time.perf_counter() - tick,
        )

    def _commit(self, decision: VllmDecision) -> None:
        """Load the staged version on every rank, once every rank has it staged (a rank that
        does not drops it on every rank)."""
        versions = self._versions
        staged = _agreed(
            lambda: versions.find_staged(decision.version, decision.fingerprint),
            f"{UNTOUCHED}: commit",
            on_refusal=versions.drop_staged,
        )
        if staged is None:
            return
        # no longer staged: a push's buffers hold a version again only once it loaded
        versions.drop_staged()
        self._load_verified(versions.buffers_of(staged), staged.held, staged.only_changed)
        logger.info("weightbus: version %s committed", decision.version)

    def _abort(self, decision: VllmDecision) -> None:
        if _agreed(lambda: self._versions.discard(decision.version), "abort") is not None:
            logger.info("weightbus: version %s discarded: %s", decision.version, decision.reason)

    def _rollback(self, order: VllmRollback) -> None:
        """Load (or, two-phase, stage) the previous version again, from its staging copy."""

        def find() -> tuple[StagingBuffers, HeldVersion]:
            self._refuse_with_draft("a rollback")
            return self._versions.find_previous(order.version, order.fingerprint)

        found = _agreed(find, f"{UNTOUCHED}: rollback")
        if found is None:
            return
        self._received_bytes = 0  # a rollback moves no bytes: the copy is held
        if order.two_phase:
            self._versions.stage(*found, order.timeout_s, owned=False, only_changed=True)
            return
        self._versions.drop_staged()  # the rollback replaces anything left undecided
        self._load_verified(*found, True)
        logger.info("weightbus: rolled back to version %s", order.version)

    def _load_verified(self, buffers: StagingBuffers, held: HeldVersion, only_changed: bool) -> int:
        """Load what every rank verified; a failure on any rank fails them all, and vLLM must
        then not serve. Returns how many tensors were loaded."""
        try:
            loaded, error = self._load(buffers, held, only_changed=only_changed), ""
        except WeightbusLoadError as exc:
            loaded, error = 0, str(exc)
        failures = _failures(gather_verdicts(not error, error, get_tp_group().cpu_group))
        if failures:
            self._versions.untrusted()
            _raise_on_last_rank(WeightbusLoadError(f"version {held.version!r}: {failures}"))
        return loaded

    def finish_weight_update(self) -> None:
        """Nothing left: the push was loaded whole once every rank verified it."""

    def shutdown(self) -> None:
        for buffers in self._versions.sets:
            buffers.release()

    def state(self) -> dict:
        """What this rank holds (`WorkerVersions.report`), for `weightbus_state`."""
        tp = get_tp_group()
        slice_map = self._slices()
        return {
            "rank": tp.rank_in_group,
            **self._versions.report(),
            "received_bytes": self._received_bytes,
            "whole_fallback": slice_map.whole,
        }

    def layout(self) -> list[list]:
        """The part of each main-model tensor this rank receives, `[name, dim, start, length]`
        (its slice, or the whole tensor), for `weightbus_layout`."""
        slices = self._slices().slices
        whole = {
            name: SliceSpec(name, 0, 0, meta.shape[0] if meta.shape else 1)
            for name, meta in self._metas_of_main().items()
        }
        return msgspec.to_builtins([slices.get(name, spec) for name, spec in whole.items()])

    def _metas_of_main(self) -> dict[str, TensorMeta]:
        if self._main_metas is None:
            self._main_metas = _metas(self._default_model_config)
        return self._main_metas

    def _slices(self) -> SliceMap:
        """The part of each main-model tensor this rank loads (read once from vLLM's layers),
        which its staging buffers hold from then on."""
        if self._slice_map is None:
            self._slice_map = worker_slice_map(self._default_model, self._metas_of_main())
            self._versions.use_slices(self._slice_map.slices)
        return self._slice_map

    # steps
    def _receive(
        self, info: VllmUpdateInfo, rank: int, tp_size: int
    ) -> tuple[StagingBuffers, RankResult]:
        """Receive `info` into staging buffers (for a delta: holding its base). A push this
        rank refuses for its delta base or its draft is still read to its end (into nothing),
        so no sender waits on this rank; one whose source cannot be opened is not. A version
        staged and left undecided is dropped on every rank: the new push replaces it."""
        self._versions.drop_staged()
        try:
            expected = self._expected_metas(info)
        except ValueError as exc:
            return StagingBuffers(), RankResult(ok=False, errors=[str(exc)])
        refusal = ""
        base = None if info.delta is None else info.delta.base_fingerprint
        try:
            if info.two_phase or info.delta is not None:
                self._refuse_with_draft("a two-phase push" if info.two_phase else "a delta")
            self._refuse_unpreparable()
            buffers = self._versions.receiving(base, expected)
        except (ValueError, OSError, RuntimeError) as exc:  # RuntimeError: out of memory
            buffers, refusal = StagingBuffers(), str(exc)
        # `shm` direct mode maps the staging's file; `nixl` registers its memory, any memory
        direct = buffers.placement(shared=info.transport != "nixl")
        try:
            source = open_source(
                info.transport, info.source, rank=rank, tp_size=tp_size, direct=direct
            )
        except (ValueError, OSError) as exc:
            return StagingBuffers(), RankResult(ok=False, errors=[refusal or str(exc)])
        if not refusal:
            tensors = [] if info.delta is None else info.delta.tensors
            whole = [tensor.name for tensor in tensors if tensor.kind == "full"]
            self._versions.begin_receive(buffers, base, whole)
        receiver = Receiver(
            load_weights=_discard if refusal else buffers.put,  # a refused push is read, not kept
            expected=expected,
            rank=rank,
            tp_size=tp_size,
            slices=buffers if info.delta is not None and not refusal else None,
        )
        result = receiver.receive(source, info)
        if refusal:
            result.ok = False
            result.errors[:] = [refusal]  # not also "this engine cannot apply a delta push"
        _explain_draft_names(result)
        return buffers, result

    def _refuse_with_draft(self, what: str) -> None:
        """Raises: ValueError: this server serves a draft model (`what` is not supported)."""
        if _served_draft_config(self.vllm_config) is not None:
            raise ValueError(
                f"{what} into a vLLM server that serves a draft model is not supported: push "
                "both models whole, one-phase"
            )

    def _refuse_unpreparable(self) -> None:
        """Raises: UnpreparableError: the served model has fused MoE layers whose preparation
        for their kernel weightbus cannot redo after loading (each named, with why)."""
        if self._unpreparable is None:
            layers = moe_layers(self._default_model, self._metas_of_main())
            self._unpreparable = unpreparable(layers)
        if self._unpreparable:
            raise UnpreparableError("; ".join(self._unpreparable))

    @property
    def _drafting(self) -> bool:
        """A draft session is open: vLLM pointed `self.model` at the draft model."""
        return self.model is not self._default_model

    def _expected_metas(self, info: VllmUpdateInfo) -> dict[str, TensorMeta]:
        """The tensors this push must carry: the main model's, and in a draft session the
        draft's under `draft.`.

        Raises:
            ValueError: the push's draft settings do not fit the draft served (the reason), or
                it carries a LoRA adapter.
        """
        if info.adapter is not None:
            raise ValueError(ADAPTER_NOT_HERE)
        self._slices()  # the staging buffers hold this rank's parts from the first push on
        draft_served = _served_draft_config(self.vllm_config) is not None
        if self._drafting and info.keep_draft:
            raise ValueError("keep_draft is set inside a draft session")
        if not self._drafting:
            if draft_served and not info.keep_draft:
                raise ValueError(DRAFT_MISSING)
            return self._metas_of_main()
        if not draft_served:
            method = self.vllm_config.speculative_config.method
            raise ValueError(
                f"a draft session on speculative method {method!r}: weightbus updates draft "
                f"models of method {DRAFT_METHOD!r} only"
            )
        if self._draft_metas is None:
            metas = _metas(self.model_config)
            self._draft_metas = {
                DRAFT_PREFIX + name: TensorMeta(DRAFT_PREFIX + name, meta.dtype, meta.shape)
                for name, meta in metas.items()
            }
        return {**self._metas_of_main(), **self._draft_metas}

    def _load(self, buffers: StagingBuffers, held: HeldVersion, *, only_changed: bool) -> int:
        served = self._versions.served
        previous = served.digests if only_changed and served is not None else None
        names = changed_tensors(held.digests, previous)
        if names:
            # from here on the models are touched: a failure must keep them from serving
            self._versions.untrusted()
            main = [name for name in names if not is_draft_name(name)]
            draft = [name for name in names if is_draft_name(name)]
            # the draft session retargeted `self.model`: the main model is the default one
            self._reload(self._default_model, self._default_model_config, buffers, main, main)
            if draft:
                assert self._drafting, "draft tensors are expected in a draft session only"
                local = [name.removeprefix(DRAFT_PREFIX) for name in draft]
                self._reload(self.model, self.model_config, buffers, draft, local)
        self._versions.loaded(buffers, held)
        return len(names)

    def _reload(
        self,
        model: torch.nn.Module,
        model_config: Any,
        buffers: StagingBuffers,
        staged: list[str],
        names: list[str],
    ) -> None:
        """Load the staged tensors `staged` into `model` under its own names `names`."""
        if not staged:
            return
        tensors = [tensor for _, tensor in buffers.pairs(staged)]
        pairs = list(zip(names, tensors, strict=True))
        try:
            loaded = reload_weights(
                model, model_config, pairs, retie_heads=self.options.retie_tied_heads
            )
        except Exception as exc:  # vLLM's loaders raise anything; the engine must fail closed
            raise WeightbusLoadError(
                f"vLLM's loader failed after the model was touched: {exc}"
            ) from exc
        not_loaded = unloaded(model, names, loaded)
        if not_loaded:
            raise WeightbusLoadError(f"vLLM's loader did not load {not_loaded}")


def _served_draft_config(vllm_config: Any) -> Any:
    """The model config of the draft model the server serves (None: none, or a speculative
    method whose draft is not a model of its own)."""
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is None or speculative.method != DRAFT_METHOD:
        return None
    return speculative.draft_model_config


def _metas(model_config: Any) -> dict[str, TensorMeta]:
    """The tensors of the checkpoint `model_config` serves (a tied head excepted)."""
    tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
    return checkpoint_metas(model_config.model, model_config.dtype, tied)


def _explain_draft_names(result: RankResult) -> None:
    """Say why a push whose `draft.` tensors do not fit the session is refused (the receiver
    lists them as unknown or missing)."""
    draft_names = any(is_draft_name(name) for name in result.bad_names)
    if result.ok or not draft_names:
        return
    if any(error.startswith("unknown tensors") for error in result.errors):
        result.errors.insert(0, DRAFT_OUTSIDE_SESSION)
    elif any(error.startswith("missing tensors") for error in result.errors):
        result.errors.insert(0, DRAFT_SESSION_WITHOUT_DRAFT)


def _agreed(
    action: Callable[[], T], what: str, on_refusal: Callable[[], None] | None = None
) -> T | None:
    """Run `action` on every rank; its result once every rank succeeded, else None: every
    rank runs `on_refusal`, the last one raises `WeightbusRefusedError` prefixed with `what`,
    naming each rank's reason."""
    try:
        value, error = action(), ""
    except ValueError as exc:
        value, error = None, str(exc)
    failures = _failures(gather_verdicts(not error, error, get_tp_group().cpu_group))
    if failures:
        if on_refusal is not None:
            on_refusal()
        _raise_on_last_rank(WeightbusRefusedError(f"{what}: {failures}"))
        return None
    return value


def _discard(pairs: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """A `Receiver` loader that keeps nothing (a push refused upfront is read to its end)."""
    return [name for name, _ in pairs]


def _failures(verdicts: list[tuple[bool, str]]) -> str:
    return "; ".join(
        f"rank {rank}: {reason}" for rank, (ok, reason) in enumerate(verdicts) if not ok
    )


def _raise_on_last_rank(error: Exception) -> None:
    """Raise `error` on the last TP rank only; the others return.

    vLLM's executor reads the ranks' answers in rank order and stops at the first failure,
    leaving the later answers queued for the next RPC (measured: the next call then failed
    with this push's error). Every rank knows the verdicts, so only the last one reports them.
    """
    tp = get_tp_group()
    if tp.rank_in_group == tp.world_size - 1:
        raise error
    logger.warning("weightbus: %s", error)


def _convert(raw: dict[str, Any], struct: type, what: str) -> Any:
    try:
        return msgspec.convert(raw, struct)
    except msgspec.ValidationError as exc:
        return Unreadable(f"{UNTOUCHED}: invalid {what}: {exc}")
