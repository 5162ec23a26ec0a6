"""Loading verified tensors into a live vLLM model, through vLLM's own loaders.

vLLM's CPU (and quantized) layers post-process their weights after loading (repacked GEMM
weights, scales): a plain `model.load_weights` into a running model either fails (parameters
emptied by the repack) or leaves the repacked copy stale. The layerwise reload re-runs that
processing per layer; `retie_tied_heads` and `experts.prepare_reloaded` (fused MoE layers:
the kernel's own preparation, which the reload skips) fix the layers it misses.
"""

import logging
from collections.abc import Iterable

import torch

from weightbus.engines.vllm.experts import expert_tensor, prepare_reloaded

logger = logging.getLogger(__name__)


def reload_weights(
    model: torch.nn.Module,
    model_config: object,
    pairs: Iterable[tuple[str, torch.Tensor]],
    *,
    retie_heads: bool = True,
) -> set[str]:
    """Load `(hf_name, tensor)` pairs with vLLM's layerwise reload, then prepare the fused MoE
    layers it touched for their kernel as start-up does; returns the names the model loaded.
    Layers that receive nothing keep their weights (vLLM puts them back).

    Raises:
        UnpreparableError: a touched MoE layer's preparation is not known (names the layer).
    """
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    try:
        loaded = set(model.load_weights(pairs))
    finally:
        finalize_layerwise_reload(model, model_config)
    prepared = prepare_reloaded(model, loaded)
    if prepared:
        logger.debug("prepared %d MoE layers for their kernel", len(prepared))
    if retie_heads:
        retie_tied_heads(model)
    return loaded


def unloaded(model: torch.nn.Module, names: Iterable[str], loaded: set[str]) -> list[str]:
    """The checkpoint names among `names` whose parameter vLLM did not report loaded.

    vLLM reports its own parameter names: fused ones (`qkv_proj` for `q_proj`, `k_proj`,
    `v_proj`) come from the model's `packed_modules_mapping`, an expert's matrices are its
    MoE layer's `w13_weight` (gate, up) and `w2_weight` (down).
    """
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    fused_of = {part: fused for fused, parts in packed.items() for part in parts}

    def vllm_name(name: str) -> str:
        expert = expert_tensor(model, name)
        if expert is not None:
            return expert.param_name
        parts = name.split(".")
        return ".".join(fused_of.get(part, part) for part in parts)

    return sorted(name for name in names if vllm_name(name) not in loaded)


def tied_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules with their own weight post-processing (`quant_method`) whose `weight` is another
    module's parameter: the LM head of a tied-embedding model."""
    owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is not None and weight.numel():
            owners.setdefault(weight.data_ptr(), []).append((name, module))
    return [
        (name, module)
        for sharing in owners.values()
        if len(sharing) > 1
        for name, module in sharing
        if getattr(module, "quant_method", None) is not None
    ]


def retie_tied_heads(model: torch.nn.Module) -> None:
    """Re-run the weight post-processing of every tied module.

    A tied LM head shares its embedding's parameter but receives no tensor of its own, so the
    layerwise reload puts it back untouched, with the repacked GEMM weight it built from the
    *previous* embedding (measured on vLLM-CPU fp32: the head kept scoring with the old
    embedding while the body ran the new weights). Re-processing rebuilds it from the shared,
    now updated, parameter.
    """
    for name, module in tied_modules(model):
        module.quant_method.process_weights_after_loading(module)
        logger.debug("re-processed tied module %s", name)
