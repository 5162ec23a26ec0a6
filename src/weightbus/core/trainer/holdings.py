"""What one trainer rank holds: each tensor's HF name, its full metadata, and the box it holds.

Three kinds of source, in any mix (`holdings_of`): a plain tensor (held whole); a DTensor on a
1-D or 2-D mesh, `Shard(d)` and `Replicate` placements, uneven shards included (its box from
torch's `compute_local_shape_and_global_offset`); a `DeclaredShard`, a plain local tensor with
the full shape and offset the trainer states (Megatron-style tensor parallelism). A fused expert
tensor held in part (a DTensor or a `DeclaredShard` of the experts a rank holds: expert
parallelism) is held as the boxes of each expert's matrices it covers
(`weightbus.core.experts.fused_blocks`).
"""

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from weightbus.core.experts import fused_blocks, is_fused_experts
from weightbus.core.meta import TensorMeta, dtype_name
from weightbus.core.plan.bucket import byte_view
from weightbus.core.trainer.boxes import Box
from weightbus.core.weights import (
    NameMap,
    declares_tie,
    is_dtensor,
    named_sources,
    tied_head_names,
)


@dataclass(frozen=True, slots=True)
class DeclaredShard:
    """A plain tensor that is the block of `full_shape` starting at `offset` (one start per
    dimension; only the first two dimensions may be cut, any of a fused expert tensor's three).

    Megatron's column-parallel weight on TP rank r of t: `DeclaredShard(local, full_shape,
    (r * local.shape[0], 0))`; row-parallel: `(0, r * local.shape[1])`. An expert-parallel rank
    holding experts `[first, first + n)` of a fused `mlp.experts.gate_up_proj` `[E, 2I, H]`:
    `DeclaredShard(local, (E, 2I, H), (first, 0, 0))`.
    """

    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    offset: tuple[int, ...]

    @classmethod
    def split(
        cls, tensor: torch.Tensor, full_shape: tuple[int, ...], dim: int, index: int
    ) -> "DeclaredShard":
        """Part `index` of equal parts of `full_shape` along `dim` (what Megatron's TP rank
        `index` holds)."""
        offset = [0] * len(full_shape)
        offset[dim] = index * tensor.shape[dim]
        return cls(tensor, tuple(full_shape), tuple(offset))


def fused_shards(
    local: torch.Tensor, parts: Mapping[str, tuple[int, ...]], index: int, parts_count: int
) -> dict[str, DeclaredShard]:
    """A fused column-parallel projection's local tensor (`[q_r; k_r; v_r]` or `[gate_r; up_r]`
    on TP rank `index` of `parts_count`) as one `DeclaredShard` per HF tensor (views, no copy).

    Args:
        parts: each HF tensor's full shape, in the order the fused rows hold them.

    Raises:
        ValueError: the local rows are not the parts' rows divided by `parts_count`.
    """
    sizes = [shape[0] // parts_count for shape in parts.values()]
    if sum(sizes) != local.shape[0]:
        raise ValueError(
            f"a fused local tensor of {local.shape[0]} rows cannot hold 1/{parts_count} of "
            f"{dict(parts)}"
        )
    views = local.split(sizes, dim=0)
    return {
        name: DeclaredShard.split(view, shape, 0, index)
        for (name, shape), view in zip(parts.items(), views, strict=True)
    }


@dataclass(frozen=True)
class Holding:
    """One tensor this rank holds (part of): its full metadata, its box, and the local
    elements (`tensor`, in its local shape, read in place). `local` (flat, contiguous) and
    `raw` (its bytes) are made only when a path reads the box's elements by position."""

    meta: TensorMeta
    box: Box
    tensor: torch.Tensor

    def __post_init__(self) -> None:
        if self.tensor.device.type != "cpu":
            raise ValueError(
                f"tensor {self.meta.name!r} is on {self.tensor.device}: pushes read the "
                "trainer's CPU memory (move it to the CPU first)"
            )

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def whole(self) -> bool:
        """This rank holds the whole tensor."""
        return self.box == Box.whole(self.meta.shape)

    @functools.cached_property
    def local(self) -> torch.Tensor:
        """The box's elements, flat and row-major (a non-contiguous view costs one copy)."""
        return self.tensor.contiguous().reshape(-1)

    @functools.cached_property
    def raw(self) -> np.ndarray:
        """The bytes of `local`, read in place."""
        return byte_view(self.local).numpy()

    def matrix(self) -> torch.Tensor:
        """The box's elements as a `(rows, columns)` matrix (a view of `local`)."""
        return self.local.view(self.box.rows, self.box.cols)

    def bytes_of(self, start: int, numel: int) -> np.ndarray:
        """The bytes of local elements `[start, start + numel)`, in place."""
        size = self.meta.element_bytes
        return self.raw[start * size : (start + numel) * size]


Source = torch.Tensor | DeclaredShard


def whole_holding(name: str, tensor: torch.Tensor) -> Holding:
    """A tensor held whole, under `name`."""
    tensor = tensor.detach()
    shape = tuple(tensor.shape)
    return Holding(TensorMeta(name, tensor.dtype, shape), Box.whole(shape), tensor)


def _dtensor_block(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A DTensor's local tensor and its offset in the whole."""
    from torch.distributed.tensor import Partial

    if any(isinstance(placement, Partial) for placement in tensor.placements):
        raise ValueError(f"tensor {name!r} is Partial (unreduced values): reduce it before a push")
    shape = tuple(tensor.shape)
    local_shape, offset = _local_shape_and_offset(shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local().detach()
    if tuple(local.shape) != tuple(local_shape):
        raise ValueError(
            f"tensor {name!r}: local shape {tuple(local.shape)}, expected {local_shape}"
        )
    return local, tuple(offset)


@functools.lru_cache(maxsize=4096)
def _local_shape_and_offset(shape: tuple[int, ...], mesh: Any, placements: tuple) -> tuple:
    """torch's `compute_local_shape_and_global_offset`, once per layout (it reads torch's
    config on every call: ~1.4 ms, 0.35 s per push of 250 tensors)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(shape, mesh, placements)


def holdings(name: str, source: Source) -> list[Holding]:
    """The holdings of one source under its final name: one, or a fused expert tensor's
    per-expert boxes.

    Raises:
        TypeError: not a tensor or `DeclaredShard`.
        ValueError: a shard outside its tensor or cut along a dimension after the second (the
            third too for fused experts).
    """
    if isinstance(source, DeclaredShard):
        shape, local, offset = tuple(source.full_shape), source.tensor.detach(), source.offset
    elif is_dtensor(source):
        shape = tuple(source.shape)
        local, offset = _dtensor_block(name, source)
    elif isinstance(source, torch.Tensor):
        return [whole_holding(name, source)]
    else:
        raise TypeError(
            f"weight {name!r} is a {type(source).__name__}, not a tensor or DeclaredShard"
        )
    if is_fused_experts(name):
        return [
            Holding(
                TensorMeta(block.name, local.dtype, block.shape),
                Box.of_offsets(block.name, block.shape, tuple(block.view.shape), block.offset),
                block.view,
            )
            for block in fused_blocks(name, shape, local, tuple(offset))
        ]
    box = Box.of_offsets(name, shape, tuple(local.shape), tuple(offset))
    return [Holding(TensorMeta(name, local.dtype, shape), box, local)]


def _memory_of(source: Any) -> torch.Tensor | None:
    if isinstance(source, DeclaredShard):
        return source.tensor
    if is_dtensor(source):
        return source.to_local()
    return source if isinstance(source, torch.Tensor) else None


def holdings_of(weights: Any, name_map: NameMap | None = None) -> tuple[list[Holding], list[str]]:
    """This rank's holdings, in its order, and the heads it holds tied to their embeddings.

    `weights` is a state dict or `(name, source)` pairs; `name_map` as for a push. A head held
    bit-equal to its embeddings, in the same box, is reported tied (`tied_head_names`).

    Raises:
        TypeError: a value is neither a tensor nor a `DeclaredShard`.
        ValueError: as `holding`; a name twice; an unsupported dtype; a module whose config ties
            its head holds one that differs from its embeddings in the same box.
    """
    held = [
        each
        for name, source in named_sources(
            weights, name_map, memory_of=_memory_of, kinds="a tensor or DeclaredShard"
        )
        for each in holdings(name, source)
    ]
    for each in held:
        dtype_name(each.meta.dtype)  # raises ValueError on an unsupported dtype
    by_name = {h.name: h for h in held}

    def part(name: str) -> tuple[torch.Tensor | None, object]:
        found = by_name.get(name)
        return (None, None) if found is None else (found.tensor, found.box)

    tied = tied_head_names(part, declared_tied=declares_tie(weights))
    return held, sorted(tied)
