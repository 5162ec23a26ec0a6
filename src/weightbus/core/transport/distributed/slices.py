"""Which bytes of a bucket one engine rank needs (`dist` parts mode), as views of the bucket.

A rank's slice map (`RankLayout.slices`, from `LlamaForCausalLM.shard_copies`) says which rows
along which dimension of each full tensor it loads. `rank_regions` turns it into views of a full
bucket buffer: the trainer ranks send those regions in parts (`schedule.py`), the engine rank
copies each part into its place in its own bucket buffer (`parts.receive_parts`) and hands the
bucket to the Receiver as usual: `load_weights` reads only those regions. One function computes
the regions on both ends, so they agree by construction.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from weightbus.core.meta import TensorMeta
from weightbus.core.plan import BucketPlan
from weightbus.core.plan.bucket import BucketEntry, align_up
from weightbus.core.wire.messages import RankLayout, SliceSpec


def layout_slices(layout: RankLayout) -> dict[str, SliceSpec]:
    """A rank's slice map by tensor name."""
    return {spec.name: spec for spec in layout.slices}


@dataclass(slots=True)
class SliceTarget:
    """Engine ranks that load the same slices: what is sent to one serves them all."""

    slices: dict[str, SliceSpec]
    group_ranks: list[int]


def slice_targets(layouts: Iterable[RankLayout]) -> list[SliceTarget]:
    """The engine ranks grouped by slice map, in group-rank order."""
    targets: dict[tuple, SliceTarget] = {}
    for layout in sorted(layouts, key=lambda layout: layout.group_rank):
        slices = layout_slices(layout)
        key = tuple(sorted(slices.items()))
        targets.setdefault(key, SliceTarget(slices, [])).group_ranks.append(layout.group_rank)
    return list(targets.values())


def _typed_rows(buffer: torch.Tensor, entry: BucketEntry) -> tuple[torch.Tensor, int] | None:
    """A typed view of the entry's rows and the index of its first row; None when the entry
    is a chunk of elements (rows larger than a bucket)."""
    raw = buffer[entry.offset : entry.end]
    dtype = entry.torch_dtype
    if not entry.is_chunk:
        return raw.view(dtype).view(entry.shape), 0
    row_bytes = TensorMeta(entry.name, dtype, entry.shape).row_bytes
    if not entry.shape or entry.tensor_offset % row_bytes or entry.nbytes % row_bytes:
        return None
    shape = (entry.nbytes // row_bytes, *entry.shape[1:])
    return raw.view(dtype).view(shape), entry.tensor_offset // row_bytes


def _narrow(rows: torch.Tensor, first_row: int, spec: SliceSpec) -> torch.Tensor:
    if rows.dim() == 0:
        return rows
    if spec.dim == 0:
        num_rows = rows.shape[0]
        start = min(max(spec.start - first_row, 0), num_rows)
        stop = min(max(spec.start + spec.length - first_row, start), num_rows)
        return rows[start:stop]
    return rows.narrow(spec.dim, spec.start, spec.length)


def rank_regions(
    bucket: BucketPlan, buffer: torch.Tensor, slices: Mapping[str, SliceSpec]
) -> list[torch.Tensor]:
    """Views of `buffer` (holding `bucket`) with the bytes a rank of this slice map needs.

    Entries without a slice, and chunks of elements, are needed whole.
    """
    regions = []
    for entry in bucket.entries:
        spec = slices.get(entry.name)
        typed = _typed_rows(buffer, entry)
        if spec is None or typed is None:
            regions.append(buffer[entry.offset : entry.end])
        else:
            regions.append(_narrow(*typed, spec))
    return regions


def aligned_offsets(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Aligned offsets of parts of `sizes` bytes packed back to back, and where they end."""
    offsets, offset = [], 0
    for size in sizes:
        offset = align_up(offset)
        offsets.append(offset)
        offset += size
    return offsets, offset


def check_slices(slices: Mapping[str, SliceSpec], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ValueError unless every slice lies inside its tensor."""
    for name, spec in slices.items():
        shape = shapes.get(name)
        if shape is None:
            continue  # a tensor this push does not carry
        if not shape:
            continue  # 0-d tensors are sent whole
        if spec.dim >= len(shape) or spec.start + spec.length > shape[spec.dim]:
            raise ValueError(
                f"slice of {name!r} (dim {spec.dim}, rows {spec.start}+{spec.length}) lies "
                f"outside its shape {list(shape)}"
            )
