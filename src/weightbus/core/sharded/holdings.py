"""What one trainer rank holds: each tensor's HF name, its full metadata, and the box it holds.

Three kinds of source, in any mix (`holdings_of`):

- a DTensor (FSDP2's `fully_shard`, `distribute_tensor`, tensor parallelism) on a 1-D or 2-D
  mesh, `Shard(d)` and `Replicate` placements, uneven shards included: its box comes from
  torch's own `compute_local_shape_and_global_offset`;
- a `DeclaredShard`: a plain local tensor with the full shape and offset the trainer states
  (Megatron-style tensor parallelism; `fused_shards` splits a fused projection);
- a plain tensor: held whole (replicated when several ranks hold it; a pipeline stage holds
  only its own tensors).
"""

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from weightbus.core.meta import DRAFT_PREFIX, TensorMeta
from weightbus.core.plan.bucket import byte_view
from weightbus.core.publisher.session import (
    TIED_HEADS,
    NameMap,
    Weights,
    memory_key,
    named_pairs,
    rename,
)
from weightbus.core.sharded.boxes import Box


@dataclass(frozen=True, slots=True)
class DeclaredShard:
    """A plain tensor that is the block of `full_shape` starting at `offset` (one start per
    dimension; only the first two dimensions may be cut).

    Megatron's column-parallel weight on TP rank r of t: `DeclaredShard(local, full_shape,
    (r * local.shape[0], 0))`; row-parallel: `(0, r * local.shape[1])`.
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


@dataclass(frozen=True, slots=True)
class Holding:
    """One tensor this rank holds (part of): its full metadata, its box, and the local elements
    (contiguous, row-major over the box; `raw`: their bytes, read in place)."""

    meta: TensorMeta
    box: Box
    local: torch.Tensor  # flat, box.numel elements
    raw: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.local.device.type != "cpu":
            raise ValueError(
                f"tensor {self.meta.name!r} is on {self.local.device}: sharded pushes read the "
                "trainer's CPU memory (move the shards to the CPU first)"
            )
        object.__setattr__(self, "raw", byte_view(self.local).numpy())

    @property
    def name(self) -> str:
        return self.meta.name

    def bytes_of(self, start: int, numel: int) -> np.ndarray:
        """The bytes of local elements `[start, start + numel)`, in place."""
        size = self.meta.element_bytes
        return self.raw[start * size : (start + numel) * size]


Source = torch.Tensor | DeclaredShard


def _dtensor_holding(name: str, tensor: torch.Tensor) -> Holding:
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
    box = Box.of_offsets(name, shape, tuple(local_shape), tuple(offset))
    return Holding(TensorMeta(name, tensor.dtype, shape), box, _flat(local))


@functools.lru_cache(maxsize=4096)
def _local_shape_and_offset(shape: tuple[int, ...], mesh: Any, placements: tuple) -> tuple:
    """torch's `compute_local_shape_and_global_offset`, once per layout (it reads torch's
    config on every call: ~1.4 ms, 0.35 s per push of 250 tensors)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(shape, mesh, placements)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """Contiguous row-major elements (a non-contiguous view costs one copy of it)."""
    return tensor.detach().contiguous().reshape(-1)


def holding(name: str, source: Source) -> Holding:
    """The holding of one source under its final name.

    Raises:
        TypeError: not a tensor or `DeclaredShard`.
        ValueError: a shard outside its tensor or cut along a dimension after the second.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(source, DeclaredShard):
        shape = tuple(source.full_shape)
        box = Box.of_offsets(name, shape, tuple(source.tensor.shape), tuple(source.offset))
        return Holding(TensorMeta(name, source.tensor.dtype, shape), box, _flat(source.tensor))
    if isinstance(source, DTensor):
        return _dtensor_holding(name, source)
    if isinstance(source, torch.Tensor):
        shape = tuple(source.shape)
        return Holding(TensorMeta(name, source.dtype, shape), Box.whole(shape), _flat(source))
    raise TypeError(f"weight {name!r} is a {type(source).__name__}, not a tensor or DeclaredShard")


def holdings_of(
    weights: Weights | Mapping[str, Source] | Iterable[tuple[str, Source]],
    name_map: NameMap | None = None,
) -> list[Holding]:
    """This rank's holdings, in its order: a module's state dict (FSDP2: DTensors), a state
    dict, or `(name, source)` pairs; `name_map` as `Publisher.push`. A source that is the very
    memory of an earlier one (tied embeddings) is held once, under its first name.

    Raises:
        TypeError, ValueError: as `holding`; a name twice.
    """
    result: dict[str, Holding] = {}
    seen: set[tuple] = set()
    for name, source in named_pairs(weights):
        new_name = rename(name_map, name)
        if new_name is None:
            continue
        if new_name in result:
            raise ValueError(f"duplicate tensor name {new_name!r}")
        if not isinstance(source, torch.Tensor | DeclaredShard):
            raise TypeError(
                f"weight {name!r} is a {type(source).__name__}, not a tensor or DeclaredShard"
            )
        key = memory_key(_local_of(source))
        if key is not None and key in seen:
            continue
        seen.add(key)
        result[new_name] = holding(new_name, source)
    return list(result.values())


def tied_heads(holdings: list[Holding]) -> list[str]:
    """The LM heads this rank holds bit-equal to their embeddings, in the same box: a head
    that every rank holding it reports so is tied and not sent (`drop_tied_heads`, by value,
    as a `Publisher` does)."""
    held = {holding.name: holding for holding in holdings}
    tied = []
    for head, embeddings in TIED_HEADS:
        for prefix in ("", DRAFT_PREFIX):
            a, b = held.get(prefix + head), held.get(prefix + embeddings)
            if a is None or b is None or a.box != b.box:
                continue
            same_kind = (a.meta.dtype, a.meta.shape) == (b.meta.dtype, b.meta.shape)
            if same_kind and _same_bytes(a.raw, b.raw):
                tied.append(a.name)
    return tied


_COMPARE_BYTES = 4 << 20  # compared at a time: no copy of a whole head to compare it


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two byte arrays are equal, chunk by chunk: an untied head differs in its first
    chunk (no full read per push), and no comparison allocates more than one chunk."""
    if a.size != b.size:
        return False
    return all(
        np.array_equal(a[start : start + _COMPARE_BYTES], b[start : start + _COMPARE_BYTES])
        for start in range(0, a.size, _COMPARE_BYTES)
    )


def _local_of(source: Source) -> torch.Tensor:
    if isinstance(source, DeclaredShard):
        return source.tensor
    to_local: Callable[[], torch.Tensor] | None = getattr(source, "to_local", None)
    return to_local() if to_local is not None else source
