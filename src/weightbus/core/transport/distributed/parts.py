"""`dist` parts mode, engine-rank side: a rank's regions of a bucket arrive in parts, each
part from the trainer rank that sends it (`BucketSent.parts`, computed by `schedule.py`).

A region (`slices.rank_regions`) is seen as a matrix (`region_matrix`): a typed region as its
tensor's matrix rows and columns, a chunk of bytes (a tensor split across buckets at no row
boundary) as a column of bytes. A part is a rectangle of it. Each trainer rank sends one payload
per bucket and receiving rank: its parts back to back in the order listed (each at an aligned
offset), then the xxh3-128 of those bytes. Both ends lay the payload out with
`slices.aligned_offsets`, so they agree by construction.
"""

from collections import defaultdict
from math import prod

import torch
import xxhash

from weightbus.core.meta import TensorMeta
from weightbus.core.plan import BucketPlan
from weightbus.core.plan.bucket import BucketEntry
from weightbus.core.transport.distributed.group import DATA_TAG, WeightsGroup, wait
from weightbus.core.transport.distributed.slices import (
    aligned_offsets,
    layout_slices,
    rank_regions,
)
from weightbus.core.wire import ProtocolError
from weightbus.core.wire.messages import SentPart, SliceSpec

PART_DIGEST_BYTES = 16  # xxh3-128 of a payload's parts, after them

# rows [start, stop) x columns [start, stop) of a tensor's matrix `(d0, d1 * ... * dn)`
MatrixBox = tuple[int, int, int, int]


def entry_box(entry: BucketEntry, spec: SliceSpec | None) -> MatrixBox | None:
    """The part of its tensor's matrix that a rank with slice `spec` needs of `entry` (what
    `rank_regions` takes), or None when it needs the entry's bytes whole (no slice, or a chunk
    of bytes: its region is then a column of bytes).

    Raises:
        ValueError: a slice along a dimension after the second (not a rectangle).
    """
    if spec is None:
        return None
    shape = entry.shape
    rows, cols = (1, 1) if not shape else (shape[0], prod(shape[1:]))
    first, last = 0, rows
    if entry.is_chunk:
        row_bytes = TensorMeta(entry.name, entry.torch_dtype, shape).row_bytes
        if not shape or entry.tensor_offset % row_bytes or entry.nbytes % row_bytes:
            return None
        first = entry.tensor_offset // row_bytes
        last = first + entry.nbytes // row_bytes
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


def region_matrix(region: torch.Tensor) -> torch.Tensor:
    """A view of a region as the matrix its parts are rectangles of."""
    if region.dim() == 0:
        return region.view(1, 1)
    if region.dim() == 1:
        return region.unsqueeze(1)
    return region if region.dim() == 2 else region.view(region.shape[0], -1)


def part_nbytes(part: SentPart, element_bytes: int) -> int:
    return (part.row_stop - part.row_start) * (part.col_stop - part.col_start) * element_bytes


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
    by_src: dict[int, list[SentPart]] = defaultdict(list)
    for part in parts:
        by_src[part.src].append(part)
    received = []
    for src, src_parts in sorted(by_src.items()):
        sizes = [part_nbytes(p, matrices[p.entry].element_size()) for p in src_parts]
        offsets, end = aligned_offsets(sizes)
        payload = group.buffer(("parts", src), end + PART_DIGEST_BYTES)
        work = group.pg.recv([payload], src, DATA_TAG)
        received.append((src, src_parts, offsets, end, payload, work))
    for src, src_parts, offsets, end, payload, work in received:
        wait(group, work, deadline, f"bucket {bucket.index} from group rank {src}")
        if not torch.equal(payload_digest(payload, end), payload[end:]):
            raise ValueError(
                f"bucket {bucket.index}: the bytes from group rank {src} are corrupted (digest)"
            )
        for part, offset in zip(src_parts, offsets, strict=True):
            matrix = matrices[part.entry]
            rows, cols = part.row_stop - part.row_start, part.col_stop - part.col_start
            size = rows * cols * matrix.element_size()
            source = payload[offset : offset + size].view(matrix.dtype).view(rows, cols)
            matrix[part.row_start : part.row_stop, part.col_start : part.col_stop].copy_(source)
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
