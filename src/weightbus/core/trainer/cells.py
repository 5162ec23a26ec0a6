"""The resharding schedule of the tensors no trainer rank holds whole: which rank copies which
rectangle into which engine rank (a tensor some rank holds whole is its `sender`'s, whole).

For every engine rank's slice of such a tensor (its `ShardCopy`, as the rank offered it), the
slice is cut along the edges of the trainer ranks' boxes into cells; each cell is held whole by
one or more trainer ranks, and exactly one of them (the least loaded so far, in a fixed order)
copies it. So each trainer rank sends exactly what it holds of what the engines need, a
replicated byte leaves once, and no engine byte is written twice. The schedule depends only on
the trainer layout and the engines' slice maps, so every trainer rank computes the same one;
`schedule_hash` lets the leader check that they did.
"""

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from math import prod

import msgspec
import torch
import xxhash

from weightbus.core.meta import TensorMeta
from weightbus.core.plan.shard import ShardCopy
from weightbus.core.trainer.boxes import Box
from weightbus.core.trainer.layout import TrainerLayout


@dataclass(frozen=True, slots=True)
class Piece:
    """Trainer rank `owner` copies `cell` (of tensor `name`) into copy `copy` of engine rank
    `target`'s slice, whose box in the tensor is `slice_box`."""

    target: int
    name: str
    copy: int
    slice_box: Box
    cell: Box
    owner: int


def slice_box(meta: TensorMeta, copy: ShardCopy) -> Box:
    """The box of the tensor that `copy` takes."""
    return range_box(meta, copy.src_dim, copy.src_start, copy.length)


def range_box(meta: TensorMeta, dim: int, start: int, length: int) -> Box:
    """The box of `length` indices from `start` along dimension `dim` of the tensor.

    Raises:
        ValueError: `dim` is after the second (not a rectangle of its matrix).
    """
    whole = Box.whole(meta.shape)
    if not meta.shape:
        return whole
    if dim == 0:
        return Box(start, start + length, whole.col_start, whole.col_stop)
    if dim == 1:
        inner = prod(meta.shape[2:])
        return Box(0, whole.row_stop, start * inner, (start + length) * inner)
    raise ValueError(f"tensor {meta.name!r}: engine slices along dimension {dim} are not supported")


def _cuts(start: int, stop: int, edges: Iterable[tuple[int, int]]) -> list[int]:
    """`start`, `stop` and every edge strictly between them, sorted."""
    return sorted({start, stop} | {v for edge in edges for v in edge if start < v < stop})


def cells(box: Box, holders: list[tuple[int, Box]]) -> list[Box]:
    rows = _cuts(box.row_start, box.row_stop, ((h.row_start, h.row_stop) for _, h in holders))
    cols = _cuts(box.col_start, box.col_stop, ((h.col_start, h.col_stop) for _, h in holders))
    return [Box(r0, r1, c0, c1) for r0, r1 in pairwise(rows) for c0, c1 in pairwise(cols)]


def make_schedule(
    layout: TrainerLayout, slices: Sequence[dict[str, list[ShardCopy]]]
) -> list[Piece]:
    """Every piece of the tensors sent in cells (no `sender`), for engine ranks' `slices`
    (per engine rank: tensor name -> its copies)."""
    metas = layout.metas_by_name
    load: dict[int, int] = defaultdict(int)
    pieces = []
    for target, copies_by_name in enumerate(slices):
        for name in sorted(copies_by_name):
            if name not in metas or layout.sender(name) is not None:
                continue
            meta, holders = metas[name], layout.holders(name)
            for index, copy in enumerate(copies_by_name[name]):
                box = slice_box(meta, copy)
                for cell in cells(box, holders):
                    if not cell.numel:  # an empty tensor: nothing to copy
                        continue
                    owners = [rank for rank, held in holders if cell.intersect(held) == cell]
                    owner = min(owners, key=lambda rank: (load[rank], rank))
                    load[owner] += cell.numel * meta.element_bytes
                    pieces.append(Piece(target, name, index, box, cell, owner))
    return pieces


def schedule_hash(layout: TrainerLayout, pieces: Sequence[Piece]) -> str:
    rows = [(p.target, p.name, p.copy, p.cell, p.owner) for p in pieces]
    return xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode([layout.layout_hash, rows]))


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """A view of `tensor` as its `(rows, columns)` matrix."""
    if tensor.dim() == 0:
        return tensor.view(1, 1)
    if tensor.dim() == 1:
        return tensor.unsqueeze(1)
    return tensor if tensor.dim() == 2 else tensor.view(tensor.shape[0], -1)


def cell_view(matrix: torch.Tensor, outer: Box, cell: Box) -> torch.Tensor:
    """The part of `matrix` (holding `outer`) that is `cell`."""
    inner = cell.within(outer)
    return matrix[inner.row_start : inner.row_stop, inner.col_start : inner.col_stop]
