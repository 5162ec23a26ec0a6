"""vLLM's fused MoE layers as a worker sees them: which part of each per-expert checkpoint
tensor it loads, the parameter vLLM reports that tensor loaded into, and the preparation a
reload leaves undone.

A push carries each expert's matrices apart (`mlp.experts.17.gate_proj.weight`, `up_proj`,
`down_proj`). vLLM holds a layer's experts fused in its routed-experts module
(`mlp.experts.routed_experts`: `w13_weight [local experts, 2 * I / tp, H]`, gate rows then up
rows, and `w2_weight [local experts, H, I / tp]`), and its `weight_loader` places a checkpoint
tensor by shard id: gate (`w1`) and up (`w3`) rows `[tp_rank * I / tp, ...)` into the first and
second half of `w13_weight[local]`, down (`w2`) the same columns into `w2_weight[local]`.
`local` is the layer's live `expert_map[physical]` (-1: not on this rank), where physical
experts are the checkpoint's experts followed by EPLB's redundant copies
(`physical % logical`). Without expert parallelism the map is None and every rank holds every
expert; with it, the MoE layer's TP size is 1 and a rank holds whole experts, or none of one
(an absent tensor: a part of length 0).

At start-up vLLM prepares each MoE layer for its kernel after loading
(`UnquantizedFusedMoEMethod.process_weights_after_loading`): the first time, it builds the
kernel and lets the kernel's experts prepare the weights
(`moe_kernel.fused_experts.process_weights_after_loading`: the CPU experts pad the
intermediate dimension and prepack both matrices into their grouped-GEMM layout). vLLM's
layerwise reload re-runs the method, which then skips that step (the kernel exists), so the
reloaded, unpacked weights would be read as prepacked ones. `prepare_reloaded` runs the step
again, for the layers the reload touched only (a layer it did not touch holds its prepacked
weights: packing them twice would scramble them).
"""

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from weightbus.core.wire.messages import SliceSpec

# `<layer>.experts.<expert>.<projection>.weight`: a checkpoint's per-expert matrix
_EXPERT_NAME = re.compile(
    r"^(?P<layer>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>[^.]+)\.weight$"
)
FUSED_PARAMS = {"w1": "w13_weight", "w3": "w13_weight", "w2": "w2_weight"}


class UnpreparableError(ValueError):
    """An MoE layer whose post-load preparation weightbus cannot redo after a reload."""


@dataclass(frozen=True, slots=True)
class ExpertTensor:
    """A per-expert checkpoint tensor and the fused layer that loads it.

    Attributes:
        path: the routed-experts module's name in the model (`...mlp.experts.routed_experts`).
        layer: that module (vLLM's `RoutedExperts`, or any module with its attributes).
        expert: the checkpoint's (logical) expert index.
        shard_id: vLLM's shard id: `w1` (gate), `w3` (up) or `w2` (down).
    """

    path: str
    layer: torch.nn.Module
    expert: int
    shard_id: str

    @property
    def param_name(self) -> str:
        """The parameter vLLM reports loaded for this tensor (`...routed_experts.w13_weight`)."""
        return f"{self.path}.{FUSED_PARAMS[self.shard_id]}"


def expert_block(name: str) -> str | None:
    """The block holding the MoE layer of a per-expert tensor (`model.layers.3.mlp` for
    `model.layers.3.mlp.experts.17.gate_proj.weight`); None for any other tensor. vLLM's
    reload prepares a fused layer once every expert of it arrived, so a layer's experts load
    together, with its router."""
    match = _EXPERT_NAME.match(name)
    return None if match is None else match["layer"].rsplit(".", 1)[0]


def expert_tensor(model: torch.nn.Module, name: str) -> ExpertTensor | None:
    """The fused layer that loads checkpoint tensor `name` (None: not a per-expert tensor of a
    fused MoE layer of `model`)."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        return None
    try:
        module = model.get_submodule(match["layer"])
    except AttributeError:
        return None
    path = match["layer"]
    if hasattr(module, "routed_experts"):  # vLLM 0.32's MoERunner holds the experts' module
        module, path = module.routed_experts, f"{path}.routed_experts"
    if not (hasattr(module, "w13_weight") and hasattr(module, "w2_weight")):
        return None
    shard_ids = {
        getattr(module, "ckpt_gate_proj_name", "gate_proj"): "w1",
        getattr(module, "ckpt_up_proj_name", "up_proj"): "w3",
        getattr(module, "ckpt_down_proj_name", "down_proj"): "w2",
    }
    shard_id = shard_ids.get(match["projection"])
    if shard_id is None:
        return None
    return ExpertTensor(path, module, int(match["expert"]), shard_id)


def holds_expert(layer: torch.nn.Module, expert: int) -> bool:
    """Whether this rank holds checkpoint expert `expert` in a slot of `layer`: some physical
    expert of it (the expert itself, or an EPLB copy) maps to a local slot in the live
    `expert_map` (None: every expert is local)."""
    expert_map = getattr(layer, "_expert_map", None)  # vLLM 0.32 (`expert_map` may be a mask)
    if expert_map is None:
        expert_map = getattr(layer, "expert_map", None)
    if expert_map is None:
        return True
    logical = layer.moe_config.num_logical_experts
    physical = range(expert, int(expert_map.numel()), logical)
    return any(int(expert_map[index]) != -1 for index in physical)


def expert_slice(name: str, shape: tuple[int, ...], part: ExpertTensor) -> SliceSpec:
    """The part of per-expert tensor `name` (full `shape`) this rank loads: its TP rows (gate,
    up) or columns (down), the whole expert under expert parallelism (MoE TP size 1), or
    nothing (length 0) for an expert it does not hold.

    Raises:
        ValueError: the layer's parameters are transposed (GPTQ/AWQ layouts), or the
            sharded dimension does not split evenly (the message names the tensor).
    """
    layer = part.layer
    if not holds_expert(layer, part.expert):
        return SliceSpec(name, 0, 0, 0)
    if getattr(getattr(layer, FUSED_PARAMS[part.shard_id]), "is_transposed", False):
        raise ValueError(f"{part.path}: transposed expert parameters are not mapped")
    tp_size, tp_rank = layer.moe_config.tp_size, layer.moe_config.tp_rank
    dim = 1 if part.shard_id == "w2" else 0
    if len(shape) != 2 or shape[dim] % tp_size:
        raise ValueError(f"{name}: {list(shape)} does not split over {tp_size} MoE TP ranks")
    length = shape[dim] // tp_size
    return SliceSpec(name, dim, tp_rank * length, length)


def moe_layers(model: torch.nn.Module, names: Iterable[str]) -> dict[str, torch.nn.Module]:
    """The fused layers (by module name) that load any of the checkpoint tensors `names`."""
    layers: dict[str, torch.nn.Module] = {}
    for name in names:
        part = expert_tensor(model, name)
        if part is not None:
            layers.setdefault(part.path, part.layer)
    return layers


def unpreparable(layers: Mapping[str, torch.nn.Module]) -> list[str]:
    """Why each of `layers` could not be prepared again after a reload (empty: all can)."""
    problems = []
    for path, layer in layers.items():
        try:
            _experts_of(path, layer)
        except UnpreparableError as exc:
            problems.append(str(exc))
    return problems


def prepare_reloaded(model: torch.nn.Module, loaded: Iterable[str]) -> list[str]:
    """Redo the start-up preparation vLLM's reload skipped, for each fused MoE layer a
    parameter of which `loaded` names (vLLM's loaded parameter names); returns their names.

    Raises:
        UnpreparableError: a touched layer whose preparation is not known here (names it).
    """
    loaded = set(loaded)
    touched = [
        (path, layer)
        for path, layer in _fused_layers(model).items()
        if f"{path}.w13_weight" in loaded or f"{path}.w2_weight" in loaded
    ]
    for path, layer in touched:
        _experts_of(path, layer).process_weights_after_loading(layer)
    return [path for path, _ in touched]


def _fused_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {
        path: module
        for path, module in model.named_modules()
        if hasattr(module, "w13_weight") and hasattr(module, "quant_method")
    }


def _experts_of(path: str, layer: torch.nn.Module) -> object:
    """The kernel experts whose `process_weights_after_loading` start-up ran on `layer` and a
    reload skips.

    Raises:
        UnpreparableError: `layer` is quantized (each quantized method prepares its own
            way, not mapped here), has no kernel yet, or the kernel padded its weights (a
            reload cannot restore that shape).
    """
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    method = layer.quant_method
    if type(method) is not UnquantizedFusedMoEMethod:
        raise UnpreparableError(
            f"{path}: weightbus cannot prepare MoE experts of {type(method).__name__} after "
            "a reload (unquantized experts only)"
        )
    kernel = getattr(method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
        raise UnpreparableError(f"{path}: the MoE layer has no kernel to prepare for")
    rows = layer.w13_weight.shape[1]
    expected = layer.moe_config.w13_num_shards * layer.moe_config.intermediate_size_per_partition
    if rows != expected:
        raise UnpreparableError(
            f"{path}: {type(experts).__name__} padded w13_weight to {rows} rows (loaded: "
            f"{expected}); a reload cannot restore that layout"
        )
    return experts
