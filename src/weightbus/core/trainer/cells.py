"""The resharding schedule of the tensors no trainer rank holds whole: which rank copies which
rectangle into which engine rank (a tensor some rank holds whole is its `sender`'s, whole).

Each engine rank's slice (`ShardCopy`) is cut along the edges of the trainer ranks' boxes into
cells, each copied by one of the ranks holding it whole (the least loaded so far): a replicated
byte leaves once, no engine byte is written twice. Every trainer rank computes the same
schedule; `schedule_hash` lets the leader check that they did.
"""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
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


def cells(box: Box, holders: list[tuple[int, Box]]) -> list[Box]:
    """`box` cut along the edges of the holders' boxes."""
    return box.cut_by(h for _, h in holders)


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
