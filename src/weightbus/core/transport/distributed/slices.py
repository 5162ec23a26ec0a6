"""Which bytes of a bucket one engine rank needs (`dist` parts mode), and receiving them.

A rank's slice map (`RankLayout.slices`, from `LlamaForCausalLM.shard_copies`) says which rows
along which dimension of each full tensor it loads. An entry of a bucket is seen as a matrix:
its tensor's rows `(d0, d1 * ... * dn)`, or a column of bytes (a chunk of a tensor split at no
row boundary); the rank's region of it is a rectangle (`entry_box`, on both ends, so they agree
by construction), which the trainer ranks send in parts (`schedule.py`). Each trainer rank sends
one payload per bucket and receiving rank: its parts back to back, each at an aligned offset
(`aligned_offsets`, on both ends), then their xxh3-128. The engine rank copies each part into
its bucket buffer (`receive_parts`): `load_weights` reads only its regions.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import groupby
from math import prod
from operator import attrgetter

import torch
import xxhash

from weightbus.core.meta import TensorMeta
from weightbus.core.plan import BucketPlan
from weightbus.core.plan.bucket import BucketEntry, align_up
from weightbus.core.transport.distributed.group import DATA_TAG, WeightsGroup, wait
from weightbus.core.wire import ProtocolError
from weightbus.core.wire.messages import RankLayout, SentPart, SliceSpec

PART_DIGEST_BYTES = 16  # xxh3-128 of a payload's parts, after them

# rows [start, stop) x columns [start, stop) of a tensor's matrix `(d0, d1 * ... * dn)`
MatrixBox = tuple[int, int, int, int]


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


def check_slices(slices: Mapping[str, SliceSpec], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ValueError unless every slice lies inside its tensor (tensors this push does not
    carry, and 0-d tensors, sent whole, are not checked)."""
    for name, spec in slices.items():
        shape = shapes.get(name)
        if not shape:
            continue
        if spec.dim >= len(shape) or spec.start + spec.length > shape[spec.dim]:
            raise ValueError(
                f"slice of {name!r} (dim {spec.dim}, rows {spec.start}+{spec.length}) lies "
                f"outside its shape {list(shape)}"
            )


def _entry_rows(entry: BucketEntry) -> tuple[int, int] | None:
    """The rows `[first, last)` of its tensor's matrix that `entry` holds; None for a chunk
    that is no whole rows (it is then a column of bytes)."""
    shape = entry.shape
    if not entry.is_chunk:
        return 0, shape[0] if shape else 1
    row_bytes = TensorMeta(entry.name, entry.torch_dtype, shape).row_bytes
    if not shape or entry.tensor_offset % row_bytes or entry.nbytes % row_bytes:
        return None
    first = entry.tensor_offset // row_bytes
    return first, first + entry.nbytes // row_bytes


def entry_box(entry: BucketEntry, spec: SliceSpec | None) -> MatrixBox | None:
    """The part of its tensor's matrix that a rank with slice `spec` needs of `entry`, or None
    when it needs the entry's bytes whole (no slice, or a chunk of bytes).

    Raises:
        ValueError: a slice along a dimension after the second (not a rectangle).
    """
    rows = None if spec is None else _entry_rows(entry)
    if spec is None or rows is None:
        return None
    (first, last), shape = rows, entry.shape
    cols = prod(shape[1:])
    if not shape:
        return first, last, 0, cols
    if spec.dim == 0:
        start = min(max(spec.start, first), last)
        return start, min(max(spec.start + spec.length, start), last), 0, cols
    if spec.dim == 1:
        inner = prod(shape[2:])
        return first, last, spec.start * inner, (spec.start + spec.length) * inner
    raise ValueError(
        f"tensor {entry.name!r}: slices along dimension {spec.dim} cannot be sent in parts "
        "(dimension 0 or 1)"
    )


def rank_regions(
    bucket: BucketPlan, buffer: torch.Tensor, slices: Mapping[str, SliceSpec]
) -> list[torch.Tensor]:
    """Views of `buffer` (holding `bucket`) with the bytes a rank of this slice map needs, one
    per entry: its box of the entry's typed matrix (`entry_box`), or its bytes whole.

    Raises:
        ValueError: a slice along a dimension after the second.
    """
    regions = []
    for entry in bucket.entries:
        raw = buffer[entry.offset : entry.end]
        box = entry_box(entry, slices.get(entry.name))
        if box is None:
            regions.append(raw)
            continue
        row_start, row_stop, col_start, col_stop = box
        first, last = _entry_rows(entry)  # whole rows: it has a box
        matrix = raw.view(entry.torch_dtype).view(last - first, prod(entry.shape[1:]))
        regions.append(matrix[row_start - first : row_stop - first, col_start:col_stop])
    return regions


def region_matrix(region: torch.Tensor) -> torch.Tensor:
    """A region of `rank_regions` as the matrix its parts are rectangles of (bytes whole: a
    column)."""
    return region.unsqueeze(1) if region.dim() == 1 else region


def aligned_offsets(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Aligned offsets of parts of `sizes` bytes packed back to back, and where they end."""
    offsets, offset = [], 0
    for size in sizes:
        offset = align_up(offset)
        offsets.append(offset)
        offset += size
    return offsets, offset


def payload_digest(payload: torch.Tensor, end: int) -> torch.Tensor:
    """The xxh3-128 of `payload[:end]` as 16 bytes."""
    digest = xxhash.xxh3_128_digest(memoryview(payload[:end].numpy()))
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


def receive_parts(
    group: WeightsGroup,
    bucket: BucketPlan,
    buffer: torch.Tensor,
    parts: list[SentPart],
    deadline: float,
) -> int:
    """Receive this rank's regions of `bucket` into `buffer`, in `parts` from their senders;
    returns their bytes.

    Raises:
        ProtocolError: the parts do not cover the regions, or lie outside them.
        ValueError: a payload's bytes do not match its digest (corrupted).
    """
    regions = rank_regions(bucket, buffer, layout_slices(group.layouts[group.group_rank]))
    matrices = [region_matrix(region) for region in regions]
    _check_cover(bucket, matrices, parts)
    received = []
    for src, src_parts in groupby(sorted(parts, key=attrgetter("src")), attrgetter("src")):
        targets = [
            matrices[p.entry][p.row_start : p.row_stop, p.col_start : p.col_stop] for p in src_parts
        ]
        offsets, end = aligned_offsets(t.numel() * t.element_size() for t in targets)
        payload = group.buffer(("parts", src), end + PART_DIGEST_BYTES)
        work = group.pg.recv([payload], src, DATA_TAG)
        received.append((src, targets, offsets, end, payload, work))
    for src, targets, offsets, end, payload, work in received:
        wait(group, work, deadline, f"bucket {bucket.index} from group rank {src}")
        if not torch.equal(payload_digest(payload, end), payload[end:]):
            raise ValueError(
                f"bucket {bucket.index}: the bytes from group rank {src} are corrupted (digest)"
            )
        for target, offset in zip(targets, offsets, strict=True):
            size = target.numel() * target.element_size()
            target.copy_(payload[offset : offset + size].view(target.dtype).view(target.shape))
    return sum(matrix.numel() * matrix.element_size() for matrix in matrices)


def _check_cover(bucket: BucketPlan, matrices: list[torch.Tensor], parts: list[SentPart]) -> None:
    covered = [0] * len(matrices)
    for part in parts:
        if part.entry >= len(matrices):
            raise ProtocolError(
                f"bucket {bucket.index}: a part of entry {part.entry}, which it lacks"
            )
        rows, cols = matrices[part.entry].shape
        if not (
            part.row_start <= part.row_stop <= rows and part.col_start <= part.col_stop <= cols
        ):
            raise ProtocolError(f"bucket {bucket.index}: a part outside entry {part.entry}")
        covered[part.entry] += (part.row_stop - part.row_start) * (part.col_stop - part.col_start)
    for index, matrix in enumerate(matrices):
        if covered[index] != matrix.numel():
            raise ProtocolError(
                f"bucket {bucket.index}: the parts cover {covered[index]} of the "
                f"{matrix.numel()} elements of entry {index}"
            )
