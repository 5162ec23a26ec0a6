"""A trainer rank's WRITEs of its cells of the tensors no rank holds whole (`trainer.cells`):
its pieces (each cell in row-major order, one larger than a buffer in parts of whole rows) are
packed in batches into its two send buffers in turn, each batch in one WRITE per engine rank (a
run per row of a cell, or one when the cell spans whole rows of the parameter). The cells'
digests are computed apart, in blocks (`trainer.digests`).
"""

import dataclasses
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from weightbus.core.finite import refuse_nonfinite_chunk
from weightbus.core.meta import TensorMeta
from weightbus.core.plan.bucket import align_up
from weightbus.core.trainer.boxes import matrix_shape
from weightbus.core.trainer.cells import Piece, cell_view
from weightbus.core.trainer.holdings import Holding
from weightbus.core.transport.nixl.agent import Agent, SendBuffers, release
from weightbus.core.transport.nixl.schedule import descriptor_rows, run_starts
from weightbus.core.transport.nixl.writes import NixlTarget
from weightbus.core.transport.parts.layout import RegionCopy

# each of the two send buffers at most (a row larger than that gets a buffer of its size)
SEND_BUFFER_BYTES = 32 << 20


def _runs(piece: Piece, each: RegionCopy, memory: int, meta: TensorMeta) -> np.ndarray:
    """`[address, bytes]` of the cell's rows in the engine rank's memory, in row-major order."""
    region = each.region
    _, param_cols = matrix_shape(tuple(region.shape))
    size = meta.element_bytes
    copy, inner = each.copy, int(np.prod(meta.shape[2:])) if len(meta.shape) > 2 else 1
    row_offset = copy.dst_start - copy.src_start if copy.src_dim == 0 and meta.shape else 0
    col_offset = (copy.dst_start - copy.src_start) * inner if copy.src_dim == 1 else 0
    cell = piece.cell
    first_col = cell.col_start + col_offset
    base = memory + region.offset
    rows = np.arange(cell.row_start + row_offset, cell.row_stop + row_offset, dtype=np.uint64)
    if first_col == 0 and cell.cols == param_cols:  # whole rows of the parameter: one run
        start = base + int(rows[0]) * param_cols * size
        return np.array([[start, cell.numel * size]], dtype=np.uint64)
    columns = rows * np.uint64(param_cols) + np.uint64(first_col)
    addresses = np.uint64(base) + columns * np.uint64(size)
    return np.stack([addresses, np.full_like(addresses, cell.cols * size)], axis=1)


def _parts(piece: Piece, row_bytes: int, limit: int) -> Iterator[Piece]:
    """`piece`, or its parts of whole rows when it is larger than `limit` bytes."""
    rows = max(1, limit // row_bytes)
    cell = piece.cell
    if cell.rows <= rows:
        yield piece
        return
    for start in range(cell.row_start, cell.row_stop, rows):
        part = msgspec.structs.replace(
            cell, row_start=start, row_stop=min(start + rows, cell.row_stop)
        )
        yield dataclasses.replace(piece, cell=part)


def write_cells(
    agent: Agent,
    buffers: SendBuffers,
    pieces: Sequence[Piece],
    *,
    targets: Sequence[NixlTarget],
    copies: Sequence[Mapping[str, list[RegionCopy]]],
    holdings: Mapping[str, Holding],
    deadline: float,
    refuse_nonfinite: bool = False,
) -> list[int]:
    """Pack and WRITE `pieces` (this rank's), from `buffers`, into engine ranks `targets`
    whose checked slice maps are `copies`; the bytes written into each. With
    `refuse_nonfinite`, each piece is refused once packed if it holds NaN/inf.

    Raises:
        TimeoutError: a WRITE did not complete by `deadline` (it names the engine rank).
        RuntimeError: NIXL failed a WRITE (the same).
    """
    written = [0] * len(targets)
    if not pieces:
        return written
    metas = {piece.name: holdings[piece.name].meta for piece in pieces}
    total = sum(align_up(piece.cell.numel * metas[piece.name].element_bytes) for piece in pieces)
    widest = max(piece.cell.cols * metas[piece.name].element_bytes for piece in pieces)
    pair = buffers.ready(2, align_up(min(total, max(SEND_BUFFER_BYTES, widest))))
    pending: list[tuple[Any, str]] = []
    try:
        for number, batch in enumerate(_batches(pieces, metas, pair[0].numel())):
            buffer = pair[number % 2]  # its last WRITE was waited for below
            runs = _pack(
                batch,
                buffer,
                written,
                targets=targets,
                copies=copies,
                holdings=holdings,
                metas=metas,
                refuse_nonfinite=refuse_nonfinite,
            )
            agent.wait(pending, deadline)
            for index, (local, remote) in runs.items():
                what = f"cells to {targets[index].describe()}"
                rows = descriptor_rows(np.concatenate(local), np.concatenate(remote))
                pending.append((agent.write(*rows, targets[index].agent_name, what), what))
        agent.wait(pending, deadline)
    finally:
        for handle, _ in pending:
            release(handle)
    return written


def _batches(
    pieces: Sequence[Piece], metas: dict[str, TensorMeta], limit: int
) -> Iterator[list[tuple[Piece, int]]]:
    """The pieces (large ones in parts) in batches that fit a buffer of `limit` bytes, each
    with its offset there."""
    batch: list[tuple[Piece, int]] = []
    used = 0
    for whole in pieces:
        size = metas[whole.name].element_bytes
        for piece in _parts(whole, whole.cell.cols * size, limit):
            nbytes = piece.cell.numel * size
            if batch and used + nbytes > limit:
                yield batch
                batch, used = [], 0
            batch.append((piece, used))
            used = align_up(used + nbytes)
    if batch:
        yield batch


def _pack(
    batch: list[tuple[Piece, int]],
    buffer: torch.Tensor,
    written: list[int],
    *,
    targets: Sequence[NixlTarget],
    copies: Sequence[Mapping[str, list[RegionCopy]]],
    holdings: Mapping[str, Holding],
    metas: dict[str, TensorMeta],
    refuse_nonfinite: bool,
) -> dict[int, tuple[list[np.ndarray], list[np.ndarray]]]:
    """Pack `batch` into `buffer`; per engine rank, the (local addresses, remote runs) to
    WRITE."""
    base = buffer.data_ptr()
    runs: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = defaultdict(lambda: ([], []))
    for piece, offset in batch:
        holding, meta = holdings[piece.name], metas[piece.name]
        nbytes = piece.cell.numel * meta.element_bytes
        packed = buffer[offset : offset + nbytes].view(meta.dtype)
        packed.view(piece.cell.rows, piece.cell.cols).copy_(
            cell_view(holding.matrix(), holding.box, piece.cell)
        )
        if refuse_nonfinite and packed.is_floating_point():
            refuse_nonfinite_chunk(piece.name, packed)
        each = copies[piece.target][piece.name][piece.copy]
        remote = _runs(piece, each, targets[piece.target].memory_address, meta)
        local, remotes = runs[piece.target]
        local.append(np.uint64(base + offset) + run_starts(remote[:, 1]))
        remotes.append(remote)
        written[piece.target] += nbytes
    return runs
