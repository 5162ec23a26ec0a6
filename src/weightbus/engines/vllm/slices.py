"""Which part of each checkpoint tensor one vLLM worker loads, read from vLLM's own layers.

vLLM's loaders take a whole checkpoint tensor and narrow it to the worker's part: a
`ColumnParallelLinear` keeps rows `[tp_rank * n, (tp_rank + 1) * n)` (fused layers per part:
q, k, v of `QKVParallelLinear`, with k and v shared by `num_kv_head_replicas` ranks when there
are fewer KV heads than ranks; gate and up of `MergedColumnParallelLinear`), a
`RowParallelLinear` the same range of columns, a `VocabParallelEmbedding` (and the LM head) its
`shard_indices` rows; replicated layers (norms, `ReplicatedLinear`) and row-parallel biases keep
everything; a fused MoE layer each expert's TP rows (gate, up) or columns (down), or, under
expert parallelism, whole experts it holds and nothing of the others (`experts.py`). This
module reads those figures from the live layers, so a worker receives only its part
(`SliceSpec`) and stages it where vLLM's loader will read it. A parallel layer this module
does not know is received whole for that tensor only (`SliceMap.whole`: logged and
reported), which is always correct, only larger. A server started with `--enable-lora` wraps
its layers (`MergedQKVParallelLinearWithLoRA`, ...): the part is its `base_layer`'s, whose
loaders vLLM's load goes through.
"""

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from weightbus.core.meta import TensorMeta
from weightbus.core.wire.messages import SliceSpec
from weightbus.engines.vllm.experts import expert_slice, expert_tensor

logger = logging.getLogger("vllm.weightbus")


@dataclass(slots=True)
class SliceMap:
    """A worker's part of each checkpoint tensor (tensors absent from `slices` whole).

    Attributes:
        slices: name -> the rows (or columns) this worker loads, for tensors it loads a part of
            (length 0: none of it, an expert another expert-parallel rank holds).
        whole: tensors of parallel layers this module cannot map, received whole.
    """

    slices: dict[str, SliceSpec] = field(default_factory=dict)
    whole: list[str] = field(default_factory=list)

    def specs(self) -> list[SliceSpec]:
        return list(self.slices.values())


def worker_slice_map(model: torch.nn.Module, metas: Mapping[str, TensorMeta]) -> SliceMap:
    """The part of each tensor of `metas` (checkpoint names, full shapes) that `model`'s
    layers load on this worker."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    fused_of = {part: (fused, index) for fused, parts in packed.items() for index, part in
                enumerate(parts)}  # fmt: skip
    result = SliceMap()
    for name, meta in metas.items():
        try:
            expert = expert_tensor(model, name)
            if expert is not None:
                spec = expert_slice(name, meta.shape, expert)
            else:
                module, part = _module_of(model, name, fused_of)
                spec = _slice(name, meta.shape, module, part)
        except (_UnmappedError, ValueError) as exc:
            result.whole.append(name)
            logger.warning("weightbus: %s is received whole: %s", name, exc)
            continue
        if spec is not None and spec.length != meta.shape[spec.dim]:
            result.slices[name] = spec
    return result


class _UnmappedError(Exception):
    """A parallel layer whose part this module cannot read (the tensor goes whole)."""


def _module_of(
    model: torch.nn.Module, name: str, fused_of: Mapping[str, tuple[str, int]]
) -> tuple[torch.nn.Module | None, int | None]:
    """The layer that loads checkpoint tensor `name`, and its part index in a fused layer."""
    path = name.rsplit(".", 1)[0].split(".")
    fused = fused_of.get(path[-1])
    part = None
    if fused is not None:
        path[-1], part = fused
    try:
        return _unwrapped(model.get_submodule(".".join(path))), part
    except AttributeError:
        return None, part


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The layer a LoRA wrapper of vLLM's (`BaseLayerWithLoRA`, `--enable-lora`) loads its
    weights through: its `base_layer`; any other module itself."""
    from vllm.lora.layers import BaseLayerWithLoRA

    while isinstance(module, BaseLayerWithLoRA):
        module = module.base_layer
    return module


def _rows(name: str, start: int, length: int, shape: tuple[int, ...], dim: int = 0) -> SliceSpec:
    if len(shape) <= dim or start < 0 or start + length > shape[dim]:
        where = f"part [{start}, {start + length}) of dimension {dim}"
        raise _UnmappedError(f"{where} is outside {shape}")
    return SliceSpec(name, dim, start, length)


def _slice(
    name: str, shape: tuple[int, ...], module: torch.nn.Module | None, part: int | None
) -> SliceSpec | None:
    """This worker's part of tensor `name` loaded by `module` (None: all of it).

    Raises:
        _UnmappedError: `module` is a parallel layer of a kind or setting not mapped here.
    """
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if module is None or isinstance(module, ReplicatedLinear):
        return None  # replicated, or not a layer of the model (vLLM's loader decides)
    if isinstance(module, VocabParallelEmbedding):
        indices = module.shard_indices
        start = indices.org_vocab_start_index
        return _rows(name, start, indices.org_vocab_end_index - start, shape)
    tp_size = getattr(module, "tp_size", 1)
    if tp_size == 1:
        return None
    if type(module) is RowParallelLinear:
        length = module.input_size_per_partition
        is_bias = name.endswith(".bias")  # not split: rank 0 adds it before the reduction
        return None if is_bias else _rows(name, module.tp_rank * length, length, shape, dim=1)
    if isinstance(module, ColumnParallelLinear):
        return _column_slice(name, shape, module, part)
    if hasattr(module, "tp_rank"):
        raise _UnmappedError(f"{type(module).__name__} on {tp_size} ranks is not mapped")
    return None  # a replicated layer (norms): every worker loads all of it


def _column_slice(
    name: str, shape: tuple[int, ...], module: torch.nn.Module, part: int | None
) -> SliceSpec:
    """Rows of a column-parallel layer (weight and bias alike), per part of a fused one."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
    )

    # exact types: subclasses (fused indexers, gates) bring loaders of their own
    if type(module) is QKVParallelLinear:
        return _qkv_slice(name, shape, module, part)
    if type(module) is MergedColumnParallelLinear:
        if part is None:
            raise _UnmappedError("a merged layer loaded from one checkpoint tensor")
        length = module.output_sizes[part] // module.tp_size
        return _rows(name, module.tp_rank * length, length, shape)
    if type(module) is not ColumnParallelLinear:
        raise _UnmappedError(f"{type(module).__name__} is not mapped")
    length = module.output_size_per_partition
    return _rows(name, module.tp_rank * length, length, shape)


def _qkv_slice(
    name: str, shape: tuple[int, ...], module: torch.nn.Module, part: int | None
) -> SliceSpec:
    if part is None:
        raise _UnmappedError("q, k and v loaded from one checkpoint tensor")
    if part == 0:
        length = module.num_heads * module.head_size
        return _rows(name, module.tp_rank * length, length, shape)
    head_size = module.head_size if part == 1 else module.v_head_size
    length = module.num_kv_heads * head_size
    shard_rank = module.tp_rank // module.num_kv_head_replicas
    return _rows(name, shard_rank * length, length, shape)


def slice_bytes(metas: Iterable[TensorMeta], slice_map: SliceMap) -> int:
    """The bytes this worker receives of `metas` (its parts, and whole tensors)."""
    total = 0
    for meta in metas:
        spec = slice_map.slices.get(meta.name)
        if spec is None:
            total += meta.nbytes
        else:
            total += meta.nbytes // meta.shape[spec.dim] * spec.length
    return total
