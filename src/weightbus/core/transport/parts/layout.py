"""A rank's direct-write layout, checked on the publisher: where each tensor's slice lands.

A rank that offers its parameters for direct writes (`DirectTarget`: `shm` direct mode and
`nixl`) names every parameter's region in its memory and its slice map. Before writing a byte,
the publisher checks the offer against the plan: regions aligned, disjoint and inside the
memory; every slice's dtype equal and its ranges inside both shapes.
"""

from dataclasses import dataclass
from itertools import pairwise

import torch

from weightbus.core.meta import TensorMeta, dtype_from_name
from weightbus.core.plan.shard import ShardCopy
from weightbus.core.wire import DirectTarget, ParamRegion


@dataclass(frozen=True, slots=True)
class RegionCopy:
    """One slice of a full tensor into one parameter region of a rank."""

    copy: ShardCopy
    region: ParamRegion

    @property
    def meta(self) -> TensorMeta:
        """The whole parameter (its name, dtype and shape)."""
        return region_meta(self.region)


def region_meta(region: ParamRegion) -> TensorMeta:
    return TensorMeta(region.name, dtype_from_name(region.dtype), tuple(region.shape))


def region_view(memory: torch.Tensor, region: ParamRegion) -> torch.Tensor:
    """The parameter of `region`, typed, as a view into `memory` (`uint8`)."""
    meta = region_meta(region)
    return memory[region.offset : region.offset + meta.nbytes].view(meta.dtype).view(meta.shape)


def _check_regions(target: DirectTarget, memory_bytes: int) -> None:
    spans = []
    for region in target.params:
        meta = region_meta(region)
        if region.offset % meta.dtype.itemsize:
            raise ValueError(f"parameter {region.name!r} is misaligned in {target.file}")
        spans.append((region.offset, region.offset + meta.nbytes, region.name))
    spans.sort()
    for (_, end, name), (start, _, other) in pairwise(spans):
        if start < end:
            raise ValueError(f"parameters {name!r} and {other!r} overlap in {target.file}")
    if spans and spans[-1][1] > memory_bytes:
        raise ValueError(f"parameter {spans[-1][2]!r} lies beyond the end of {target.file}")


def _check_copy(meta: TensorMeta, param: TensorMeta, copy: ShardCopy) -> None:
    dim = copy.src_dim
    where = f"slice of {meta.name!r} into {param.shape}"
    if param.dtype != meta.dtype:
        raise ValueError(f"{where}: parameter dtype {param.dtype} != tensor dtype {meta.dtype}")
    if len(meta.shape) == 0:
        if param.shape != ():
            raise ValueError(f"{where}: a 0-d tensor needs a 0-d parameter")
        return
    if dim >= len(meta.shape) or len(param.shape) != len(meta.shape):
        raise ValueError(f"{where}: dimension {dim} does not exist on both sides")
    outside = [i for i in range(len(meta.shape)) if i != dim and meta.shape[i] != param.shape[i]]
    if outside:
        raise ValueError(f"{where}: shapes differ outside dimension {dim}")
    if copy.src_start + copy.length > meta.shape[dim]:
        raise ValueError(f"{where}: source range ends beyond {meta.shape[dim]}")
    if copy.dst_start + copy.length > param.shape[dim]:
        raise ValueError(f"{where}: destination range ends beyond {param.shape[dim]}")


def slot_region(region: ParamRegion, slot: int) -> ParamRegion:
    """`region[slot]`: one slot of a parameter's leading dimension, as a region of its own.

    Raises:
        ValueError: the parameter has no such slot.
    """
    if not region.shape or not 0 <= slot < region.shape[0]:
        raise ValueError(f"parameter {region.name!r} {tuple(region.shape)} has no slot {slot}")
    slot_bytes = region_meta(region).nbytes // region.shape[0]
    return ParamRegion(
        f"{region.name}[{slot}]", region.dtype, region.shape[1:], region.offset + slot * slot_bytes
    )


def checked_copies(
    target: DirectTarget, metas: dict[str, TensorMeta], *, partial: bool = False
) -> dict[str, list[RegionCopy]]:
    """Every slice `target` asks for, by full tensor name, checked against `metas`; a tensor
    the rank holds no part of (`target.absent`) maps to no slice. A slice into a slot of a
    parameter (`WireShardCopy.slot`) comes with that slot as its region.

    With `partial`, slices of tensors that `metas` lacks are left out (a session that carries
    some parameters only, e.g. a delta push over `nixl`); else they make the layout unknown.

    Raises:
        ValueError: the layout is inconsistent (the message names the tensor or parameter).
    """
    _check_regions(target, target.nbytes)
    regions = {region.name: region for region in target.params}
    copies: dict[str, list[RegionCopy]] = {}
    for wire in target.copies:
        if partial and wire.hf_name not in metas and wire.param in regions:
            continue
        if wire.hf_name not in metas or wire.param not in regions:
            raise ValueError(f"slice map names unknown {wire.hf_name!r} or {wire.param!r}")
        copy = ShardCopy(wire.dim, wire.src_start, wire.dim, wire.dst_start, wire.length)
        region = regions[wire.param]
        if wire.slot is not None:
            region = slot_region(region, wire.slot)
        _check_copy(metas[wire.hf_name], region_meta(region), copy)
        copies.setdefault(wire.hf_name, []).append(RegionCopy(copy, region))
    for name in target.absent:
        if name in copies:
            raise ValueError(f"slice map names {name!r} both held and absent")
        if name in metas:
            copies[name] = []
    return copies
