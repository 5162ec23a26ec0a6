"""This rank's weights: live parameters, optional staging copy, and the Receiver that fills them.

The worker calls these at step boundaries, on every rank alike:
- `begin_staged` starts receiving into the staging model in a background thread (atomic
  updates: generation goes on with the live weights meanwhile); `staged_result` polls it;
  `commit_staged` swaps staging and live parameters (pointer swaps, no copy); `discard_staged`
  forgets a failed attempt. After a swap the staging memory holds the version it replaced, so
  `roll_back` swaps it back in (until the next staged receive writes there).
- `load_in_place` receives straight into the live parameters (generation is paused).
- `release` / `resume` free and re-allocate memory (`weights`, `kv_cache`).
- `place_experts` moves a mixture-of-experts model's experts (live and staging alike) to a new
  expert map, then refreshes what this rank derived from its slice map.

A LoRA adapter push (`order.adapter`) carries the adapter's tensors only: the staging model
first gets the live base (copied, unless it holds it already: after one adapter push the
staging memory keeps the same base, so the next copies nothing), the swap moves the adapter's
`LoraState` (applied, scale) with the parameters, and a push of the base drops the adapter.

With `shm_weights` (the default) live and staging parameters live in shared-memory arenas, so a
co-located `shm` publisher can write updates straight into them (direct mode); where /dev/shm
cannot hold them they stay in private memory and updates stream through the slots. Each push
is offered the slice map of the tensors it carries (`_carried`: the adapter's for an adapter
push, the base's for a whole push), since a publisher writes directly only when the map names
exactly the push's tensors.
"""

import logging
import threading
import time
from collections.abc import Callable

import torch

from weightbus.core.meta import DRAFT_PREFIX, TensorMeta, is_draft_name
from weightbus.core.receiver import RankResult, Receiver
from weightbus.core.transport import (
    DirectPlacement,
    ParamArena,
    direct_placement,
    open_source,
    remove_stale_slots,
)
from weightbus.core.wire import UpdateOrder
from weightbus.core.wire.adapter import is_adapter_name
from weightbus.core.wire.messages import SliceSpec
from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.delta_slices import ModelSlices, copy_parameters
from weightbus.engines.reference.engine.draft_load import DraftLoads, draft_info
from weightbus.engines.reference.engine.model_runner import ModelRunner
from weightbus.engines.reference.engine.transport_setup import slice_specs
from weightbus.engines.reference.models.experts import ExpertMap
from weightbus.engines.reference.models.loader import create_model
from weightbus.engines.reference.models.served import ServedModels

logger = logging.getLogger(__name__)

DRAFT_MISSING = (
    "the push carries no draft model while this engine serves one: push the draft's tensors "
    f"under {DRAFT_PREFIX!r} in the same version, or set keep_draft to keep the draft served"
)


def expected_metas(served: ServedModels, dtype: torch.dtype) -> dict[str, TensorMeta]:
    """The tensors a complete update must carry (the draft's under `draft.`): full shapes, in
    the serving dtype."""
    dtypes = served.weight_dtypes(dtype)
    return {
        name: TensorMeta(name, dtypes[name], shape)
        for name, shape in served.weight_shapes().items()
    }


def _new_served(served: ServedModels, dtype: torch.dtype) -> ServedModels:
    """Unloaded models of `served`'s architectures, their experts placed as `served`'s are
    (a staging copy)."""
    draft = served.draft
    if draft is not None:
        draft = create_model(draft.config, dtype, draft.expert_map)
    return ServedModels(create_model(served.main.config, dtype, served.main.expert_map), draft)


def _prepare_staging(
    order: UpdateOrder,
    live: ServedModels,
    staging: ServedModels,
    *,
    base_held: bool,
    on_base_held: Callable[[], None],
) -> Callable[[], None]:
    """What the staging model must hold before a push writes into it: the live weights for a
    delta (it changes them), the live base for an adapter (unless `base_held`: the staging
    memory holds it already; `on_base_held` is called once it does), the live draft when the
    push keeps it, else nothing."""
    if order.delta:
        return lambda: copy_parameters(live.parameters(), staging.parameters())
    if order.adapter is not None:

        def copy_base() -> None:
            if not base_held:
                copy_parameters(live.base_parameters(), staging.base_parameters())
            on_base_held()

        return copy_base
    if order.keep_draft:
        return lambda: copy_parameters(live.draft_parameters(), staging.draft_parameters())
    return lambda: None


def _carried_kind(order: UpdateOrder) -> tuple[bool, bool]:
    """What kind of tensors `order`'s push carries: (the adapter's rather than the base's,
    the base's without the draft's)."""
    return order.adapter is not None, order.keep_draft


def _adapter_state(order: UpdateOrder) -> tuple[bool, float]:
    """Whether the model applies its adapter once `order` lands, and the scale (a push of
    the base drops the adapter: it was trained on the base replaced)."""
    spec = order.adapter
    return (False, 0.0) if spec is None else (spec.active, spec.scaling)


def _swap_parameters(live: ServedModels, staged: ServedModels) -> None:
    for live_param, staged_param in zip(live.parameters(), staged.parameters(), strict=True):
        live_param.data, staged_param.data = staged_param.data, live_param.data
    live.lora_state.swap(staged.lora_state)


class _StagedReceive:
    """A receive running in a background thread; `result` is set when it ends. `prepare`
    runs first in the same thread (a delta's base copied into the staging model)."""

    def __init__(
        self,
        receiver: Receiver,
        order: UpdateOrder,
        offer: tuple[DirectPlacement | None, list[SliceSpec]],
        prepare: Callable[[], None],
        on_done: Callable[[], None],
    ) -> None:
        self.result: RankResult | None = None
        self._receiver = receiver
        self._order = order
        self._direct, self._slices = offer
        self._prepare = prepare
        self._on_done = on_done
        self._thread = threading.Thread(target=self._run, name="staged-receive", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tick = time.perf_counter()
        self._prepare()
        prepare_s = time.perf_counter() - tick
        self.result = receive(self._receiver, self._order, self._direct, self._slices)
        self.result.phases["base_copy_s"] = prepare_s
        self._on_done()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


def receive(
    receiver: Receiver,
    order: UpdateOrder,
    direct: DirectPlacement | None = None,
    slices: list[SliceSpec] | None = None,
) -> RankResult:
    """Open the order's transport source and receive one session through `receiver`
    (offering `direct`, the target's parameters in shared memory, to transports that take it,
    and `slices`, this rank's slice map now, to those that check it against their set-up's)."""
    try:
        source = open_source(
            order.transport,
            order.source,
            rank=receiver.rank,
            tp_size=receiver.tp_size,
            direct=direct,
            slices=slices,
        )
    except Exception as exc:  # noqa: BLE001 - any failure must become this rank's verdict
        result = RankResult()
        result.fail(f"cannot open {order.transport} source: {type(exc).__name__}: {exc}")
        return result
    result = receiver.receive(source, order)
    _explain_missing_draft(result)
    return result


def _explain_missing_draft(result: RankResult) -> None:
    """Say why a push without the draft's tensors is refused (the receiver lists them)."""
    refused = any(error.startswith("missing tensors") for error in result.errors)
    if refused and any(is_draft_name(name) for name in result.bad_names):
        result.errors.insert(0, DRAFT_MISSING)


class WeightsManager:
    """Live and staged parameters of one rank.

    Args:
        runner: the rank's model runner (its `model` holds the live parameters).
        dtype: serving dtype; pushed tensors must have it.
        tp_rank, tp_size: this rank's place (digests are verified rank-split).
        shm_weights: keep parameters in shared-memory arenas (direct mode) where they fit.
        on_staged_done: called from the receive thread once a staged receive ended (the
            worker's wake-up: it waits for that instead of polling).
    """

    def __init__(
        self,
        runner: ModelRunner,
        dtype: torch.dtype,
        tp_rank: int,
        tp_size: int,
        *,
        shm_weights: bool = True,
        on_staged_done: Callable[[], None] = lambda: None,
    ) -> None:
        self.runner = runner
        self._on_staged_done = on_staged_done
        self.dtype = dtype
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.shm_weights = shm_weights
        self.served = runner.served
        self.expected = expected_metas(self.served, dtype)
        self._staging: ServedModels | None = None
        self._staged: _StagedReceive | None = None
        self._shapes = {name: p.shape for name, p in self.served.named_parameters()}
        # this rank's slice map, computed once (again after an expert re-placement)
        self._copies = self.served.shard_copies()
        # the same as wire data, with the tensors this rank holds none of (`dist`'s layout)
        self.slices = slice_specs(self.served)
        # what the draft's part of the latest receive loaded (`draft_info`)
        self._draft_loads = DraftLoads(self.served.load_weights)
        # (arena name, what a push carries: `_carried_kind`) -> its direct offer
        self._placements: dict[tuple[str, tuple[bool, bool]], DirectPlacement | None] = {}
        self._live_arena = self._place(self.served, copy=True)
        self._staging_arena: ParamArena | None = None
        self.weights_released = False
        # the staging memory holds the live base (an adapter push then copies none of it)
        self._staging_has_base = False
        self._staged_adapter = False  # the staged (or last swapped) push carried an adapter

    def _place(self, model: ServedModels, *, copy: bool) -> ParamArena | None:
        """Move `model`'s parameters into a new shared-memory arena (None: not possible)."""
        if not self.shm_weights:
            return None
        remove_stale_slots()
        layout = [
            (name, torch.empty(self._shapes[name], dtype=p.dtype, device="meta"))
            for name, p in model.named_parameters()
        ]
        try:
            arena = ParamArena(layout)
        except OSError as exc:
            logger.warning("parameters stay in private memory (no direct shm updates): %s", exc)
            return None
        arena.adopt(model, copy=copy)
        return arena

    def _placement(self, arena: ParamArena | None, order: UpdateOrder) -> DirectPlacement | None:
        """`arena` offered for direct writes of the tensors `order`'s push carries (None: the
        parameters are in private memory). Its slice map names those tensors only, as a
        publisher's layout check asks; one offer per arena and `_carried_kind`, made once."""
        if arena is None:
            return None
        key = (arena.name, _carried_kind(order))
        if key not in self._placements:
            carried = self._carried(order)
            copies = [copy for copy in self._copies if copy[0] in carried]
            held = {copy[0] for copy in copies}
            absent = [name for name in carried if name not in held]  # other ranks' experts
            self._placements[key] = direct_placement(arena, copies, absent)
        return self._placements[key]

    def _carried(self, order: UpdateOrder) -> dict[str, TensorMeta]:
        """The tensors `order`'s push must carry: the adapter's for an adapter push, else the
        base's (the draft's included unless the push keeps the draft served)."""
        adapter, keep_draft = _carried_kind(order)
        expected = {n: m for n, m in self.expected.items() if is_adapter_name(n) == adapter}
        if keep_draft:
            expected = {name: m for name, m in expected.items() if not is_draft_name(name)}
        return expected

    def _receiver(self, model: ServedModels, order: UpdateOrder) -> Receiver:
        self._draft_loads = DraftLoads(model.load_weights)
        return Receiver(
            load_weights=self._draft_loads,
            expected=self._carried(order),
            rank=self.tp_rank,
            tp_size=self.tp_size,
            slices=ModelSlices(model, self._copies),
        )

    # atomic: stage, then swap
    def begin_staged(self, order: UpdateOrder) -> None:
        """Start receiving into the staging model (allocated on first use, then reused)."""
        assert self._staged is None, "a staged receive is already running"
        if self._staging is None:
            self._staging = _new_served(self.served, self.dtype)
            self._staging_arena = self._place(self._staging, copy=False)
        staging = self._staging
        prepare = _prepare_staging(
            order,
            self.served,
            staging,
            base_held=self._staging_has_base,
            on_base_held=self._base_held,
        )
        self._staging_has_base = False  # until the receive thread copied the base (if it does)
        self._staged_adapter = order.adapter is not None
        staging.lora_state.set(*_adapter_state(order))
        self._staged = _StagedReceive(
            self._receiver(staging, order),
            order,
            (self._placement(self._staging_arena, order), self.slices),
            prepare,
            self._on_staged_done,
        )

    def _base_held(self) -> None:
        """The staging memory holds the live base (called from the receive thread)."""
        self._staging_has_base = True

    @property
    def receiving_staged(self) -> bool:
        """A staged receive runs on this rank (its end calls `on_staged_done`)."""
        return self._staged is not None and self._staged.result is None

    def staged_result(self) -> RankResult | None:
        """The staged receive's verdict once it ended, else None."""
        return None if self._staged is None else self._staged.result

    def commit_staged(self) -> None:
        """Make the staged weights live (the previous live ones become the next staging)."""
        assert self.staged_result() is not None
        self._swap()
        self._staged = None

    def roll_back(self) -> None:
        """Make the previous version live again: the staging memory holds it since the last
        swap (rank 0 checks that nothing wrote there since)."""
        assert self._staged is None, "a staged receive is running"
        self._swap()

    def _swap(self) -> None:
        assert self._staging is not None
        _swap_parameters(self.served, self._staging)
        self._live_arena, self._staging_arena = self._staging_arena, self._live_arena
        # a swap of adapters leaves the same base on both sides; a swap of bases does not
        self._staging_has_base = self._staged_adapter

    def discard_staged(self, timeout_s: float = 5.0) -> None:
        """Forget a staged receive (its thread ends by its own timeout if still running)."""
        if self._staged is not None:
            self._staged.join(timeout_s)
        self._staged = None

    # in place
    def load_in_place(self, order: UpdateOrder) -> RankResult:
        """Receive straight into the live parameters (re-allocated first if released)."""
        self.resume(["weights"])
        direct = self._placement(self._live_arena, order)
        result = receive(self._receiver(self.served, order), order, direct, self.slices)
        if order.adapter is None:
            self._staging_has_base = False  # the live base moved on
        if result.ok:
            self.served.lora_state.set(*_adapter_state(order))
        return result

    def draft_info(self, order: UpdateOrder, result: RankResult) -> messages.DraftInfo | None:
        """The draft a verified push carried and how it was loaded (None: the push carried
        no draft, or failed)."""
        if self.served.draft is None or order.keep_draft or not result.ok:
            return None
        if order.adapter is not None:
            return None  # an adapter push carries no draft: the draft served stays
        return draft_info(order.version, self.expected, result, self._draft_loads)

    # experts
    def place_experts(self, expert_map: ExpertMap) -> RankResult:
        """Move the experts of the live model, and of the staging model when there is one
        (it may hold the rollback version: it stays valid), to `expert_map`: a collective,
        every rank calls it with the same map. Then refresh what this rank derived from its
        slice map (the slices a receive loads, the direct-write offers).

        Returns:
            This rank's result, never raising: on a failure, `touched` says whether experts
            may have moved (the staging model, then out of step with the live one, is
            dropped).
        """
        result = RankResult()
        models = [self.served.main]
        if self._staging is not None:
            models.append(self._staging.main)
        moved = 0
        try:
            for model in models:
                model.place_experts(expert_map)
                moved += 1
        except (ValueError, RuntimeError) as exc:
            result.fail(f"cannot place the experts: {exc}")
            # a map that does not fit raises before anything moves
            result.touched = moved > 0 or not isinstance(exc, ValueError)
            self._drop_staging()
        self._copies = self.served.shard_copies()
        self.slices = slice_specs(self.served)
        self._placements.clear()
        return result

    def _drop_staging(self) -> None:
        """Forget the staging model and its arena (the next staged receive makes new ones)."""
        if self._staging_arena is not None:
            self._staging_arena.close()
        self._staging = self._staging_arena = None
        self._staging_has_base = False

    # memory
    def release(self, tags: list[str]) -> None:
        """Free the weights (live and staging) and/or the KV cache."""
        if "weights" in tags and not self.weights_released:
            # both models: the staging one may outlive this manager's reference (the last
            # receive's loader holds it), and its parameters would keep an arena mapped
            for model in (self.served, self._staging):
                for param in () if model is None else model.parameters():
                    param.data = torch.empty(0, dtype=param.dtype)
            self._staging = None
            self._staging_has_base = False
            self._close_arenas()
            self.weights_released = True
        if "kv_cache" in tags:
            self.runner.release_kv_cache()

    def resume(self, tags: list[str]) -> None:
        """Re-allocate what `release` freed; released weights come back uninitialised."""
        if "weights" in tags and self.weights_released:
            self._live_arena = self._place(self.served, copy=False)
            if self._live_arena is None:
                for name, param in self.served.named_parameters():
                    param.data = torch.empty(self._shapes[name], dtype=param.dtype)
            self.weights_released = False
        if "kv_cache" in tags:
            self.runner.resume_kv_cache()

    def _close_arenas(self) -> None:
        for arena in (self._live_arena, self._staging_arena):
            if arena is not None:
                for key in [key for key in self._placements if key[0] == arena.name]:
                    del self._placements[key]
                arena.close()
        self._live_arena = self._staging_arena = None

    def close(self) -> None:
        """Remove the shared-memory arenas (the process is ending)."""
        self._close_arenas()
