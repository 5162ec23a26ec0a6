"""Parts of a tensor as boxes: every tensor seen as a matrix, every shard as a rectangle of it.

A tensor of shape `(d0, d1, ..., dn)` is the matrix `(d0, d1 * ... * dn)` (a vector `(n, 1)`, a
scalar `(1, 1)`): `Shard(0)` is a range of rows, `Shard(1)` of columns, a 2-D mesh a rectangle;
a shard of a later dimension is refused. A *region* is a box read in its own row-major order;
`runs` cuts its elements into runs of the whole tensor's, `held_runs` finds them in a holder.
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import pairwise
from math import prod

import msgspec


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The `(rows, columns)` a tensor of `shape` is seen as."""
    if not shape:
        return 1, 1
    return shape[0], prod(shape[1:])


def _cuts(start: int, stop: int, edges: Iterable[tuple[int, int]]) -> list[int]:
    """`start`, `stop` and every edge strictly between them, sorted."""
    return sorted({start, stop} | {v for edge in edges for v in edge if start < v < stop})


class Box(msgspec.Struct, frozen=True, array_like=True):
    """Rows `[row_start, row_stop)` x columns `[col_start, col_stop)` of a tensor's matrix."""

    row_start: int
    row_stop: int
    col_start: int
    col_stop: int

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> "Box":
        rows, cols = matrix_shape(shape)
        return cls(0, rows, 0, cols)

    @classmethod
    def of_offsets(
        cls,
        name: str,
        shape: tuple[int, ...],
        local_shape: tuple[int, ...],
        offset: tuple[int, ...],
    ) -> "Box":
        """The box of a block of `local_shape` at `offset` (per dimension) in a tensor of
        `shape`.

        Raises:
            ValueError: the block is outside the tensor, or cut along a dimension after the
                second (not a rectangle of the matrix), naming the tensor.
        """
        if len(local_shape) != len(shape) or len(offset) != len(shape):
            raise ValueError(f"tensor {name!r}: a shard of rank {len(local_shape)} in {shape}")
        for dim, (size, start, full) in enumerate(zip(local_shape, offset, shape, strict=True)):
            if start < 0 or start + size > full:
                raise ValueError(
                    f"tensor {name!r}: shard {local_shape} at {offset} is outside {shape}"
                )
            if dim >= 2 and size != full:
                raise ValueError(
                    f"tensor {name!r}: shards along dimension {dim} are not supported "
                    "(shard dimension 0 or 1)"
                )
        if not shape:
            return cls(0, 1, 0, 1)
        inner = prod(shape[2:])
        cols = (
            (offset[1] * inner, (offset[1] + local_shape[1]) * inner) if len(shape) > 1 else (0, 1)
        )
        return cls(offset[0], offset[0] + local_shape[0], *cols)

    @property
    def rows(self) -> int:
        return self.row_stop - self.row_start

    @property
    def cols(self) -> int:
        return self.col_stop - self.col_start

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def intersect(self, other: "Box") -> "Box | None":
        row_start, row_stop = (
            max(self.row_start, other.row_start),
            min(self.row_stop, other.row_stop),
        )
        col_start, col_stop = (
            max(self.col_start, other.col_start),
            min(self.col_stop, other.col_stop),
        )
        if row_start >= row_stop or col_start >= col_stop:
            return None
        return Box(row_start, row_stop, col_start, col_stop)

    def cut_by(self, boxes: Iterable["Box"]) -> list["Box"]:
        """This box in cells, cut along every edge of `boxes` inside it (row-major order)."""
        boxes = list(boxes)
        rows = _cuts(self.row_start, self.row_stop, ((b.row_start, b.row_stop) for b in boxes))
        cols = _cuts(self.col_start, self.col_stop, ((b.col_start, b.col_stop) for b in boxes))
        return [Box(r0, r1, c0, c1) for r0, r1 in pairwise(rows) for c0, c1 in pairwise(cols)]

    def within(self, outer: "Box") -> "Box":
        """This box in the coordinates of `outer` (which contains it)."""
        return Box(
            self.row_start - outer.row_start,
            self.row_stop - outer.row_start,
            self.col_start - outer.col_start,
            self.col_stop - outer.col_start,
        )


@dataclass(frozen=True, slots=True)
class Run:
    """Elements `[start, stop)` of a tensor's flattened matrix (`cols` wide)."""

    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def runs(region: Box, cols: int, start: int, stop: int) -> Iterator[Run]:
    """Elements `[start, stop)` of `region` (in its row-major order) as runs of the whole
    tensor's flattened matrix, `cols` columns wide, in order."""
    if region.col_start == 0 and region.col_stop == cols:  # whole rows: one run
        base = region.row_start * cols
        yield Run(base + start, base + stop)
        return
    width = region.cols
    index = start
    while index < stop:
        row, col = divmod(index, width)
        take = min(width - col, stop - index)
        first = (region.row_start + row) * cols + region.col_start + col
        yield Run(first, first + take)
        index += take


def held_runs(holder: Box, cols: int, run: Run) -> Iterator[tuple[Run, int]]:
    """The parts of `run` inside `holder`, each with its offset in the holder's local
    (row-major, contiguous) elements."""
    first_row, last_row = run.start // cols, (run.stop - 1) // cols
    rows = range(max(first_row, holder.row_start), min(last_row + 1, holder.row_stop))
    if holder.col_start == 0 and holder.col_stop == cols and rows:  # whole rows: one part
        low = max(run.start, rows.start * cols)
        high = min(run.stop, rows.stop * cols)
        yield Run(low, high), low - holder.row_start * cols
        return
    for row in rows:
        low = max(run.start, row * cols + holder.col_start)
        high = min(run.stop, row * cols + holder.col_stop)
        if low < high:
            local = (row - holder.row_start) * holder.cols + (low - row * cols - holder.col_start)
            yield Run(low, high), local
