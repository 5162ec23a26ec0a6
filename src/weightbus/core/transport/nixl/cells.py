"""A trainer rank's WRITEs of its cells of the tensors no rank holds whole (`trainer.cells`).

The rank packs its pieces (each cell in row-major order) into one of its two registered send
buffers and posts one WRITE per engine rank of the batch: a list of runs, one per row of a cell
unless the cell spans whole rows of the parameter. The next batch packs into the other buffer
while that WRITE is in flight. A cell larger than a buffer goes in parts of whole rows. The
cells' digests are computed apart, in blocks (`trainer.digests`).
"""

import dataclasses
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from weightbus.core.meta import TensorMeta
from weightbus.core.plan.bucket import ALIGN_BYTES
from weightbus.core.trainer.boxes import matrix_shape
from weightbus.core.trainer.cells import Piece, cell_view
from weightbus.core.trainer.holdings import Holding
from weightbus.core.transport.nixl.agent import Agent
from weightbus.core.transport.nixl.hooks import Rank
from weightbus.core.transport.parts.layout import RegionCopy

# each of the two send buffers at most (a row larger than that gets a buffer of its size)
SEND_BUFFER_BYTES = 32 << 20
_POLL_S = 0.0002  # between two looks at the WRITEs' state (NIXL has no blocking wait)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


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


class CellWrites:
    """A trainer rank's send buffers for its cells, kept across pushes.

    Args:
        agent: the rank's NIXL agent.
        key: names the buffers' registrations in the (shared) agent.
    """

    def __init__(self, agent: Agent, key: str) -> None:
        self._agent, self._key = agent, key
        self._buffers: list[torch.Tensor] = []

    def write(
        self,
        pieces: Sequence[Piece],
        *,
        ranks: Sequence[Rank],
        memory: Sequence[int],
        copies: Sequence[Mapping[str, list[RegionCopy]]],
        holdings: Mapping[str, Holding],
        deadline: float,
    ) -> list[int]:
        """Pack and WRITE `pieces` (this rank's), into engine ranks `ranks` whose memory starts
        at `memory` and whose checked slice maps are `copies`; the bytes written into each.

        Raises:
            TimeoutError: a WRITE did not complete by `deadline` (it names the engine rank).
            RuntimeError: NIXL failed a WRITE (the same).
        """
        written = [0] * len(ranks)
        if not pieces:
            return written
        metas = {piece.name: holdings[piece.name].meta for piece in pieces}
        buffers = self._ready(pieces, metas)
        pending: list[tuple[Rank, Any]] = []
        try:
            for number, batch in enumerate(self._batches(pieces, metas, buffers[0].numel())):
                buffer = buffers[number % len(buffers)]  # its last WRITE was waited for below
                runs = self._pack(
                    batch,
                    buffer,
                    memory=memory,
                    copies=copies,
                    holdings=holdings,
                    metas=metas,
                    written=written,
                )
                self._wait(pending, deadline)
                pending = self._post(runs, ranks)
            self._wait(pending, deadline)
        finally:
            for _, handle in pending:
                handle.release()
        return written

    def _ready(self, pieces: Sequence[Piece], metas: dict[str, TensorMeta]) -> list[torch.Tensor]:
        """Two registered buffers large enough for a batch (each row fits one)."""
        total = sum(
            _aligned(piece.cell.numel * metas[piece.name].element_bytes) for piece in pieces
        )
        widest = max(piece.cell.cols * metas[piece.name].element_bytes for piece in pieces)
        nbytes = _aligned(min(total, max(SEND_BUFFER_BYTES, widest)))
        if not self._buffers or self._buffers[0].numel() < nbytes:
            self.close()
            for index in range(2):
                buffer = torch.zeros(nbytes, dtype=torch.uint8)  # pages faulted in once, here
                self._agent.register(f"{self._key}-cells-{index}", buffer)
                self._buffers.append(buffer)
        return self._buffers

    @staticmethod
    def _batches(
        pieces: Sequence[Piece], metas: dict[str, TensorMeta], limit: int
    ) -> Iterator[list[tuple[Piece, int]]]:
        """The pieces (large ones in parts) in batches that fit a buffer of `limit` bytes,
        each with its offset there."""
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
                used = _aligned(used + nbytes)
        if batch:
            yield batch

    @staticmethod
    def _pack(
        batch: list[tuple[Piece, int]],
        buffer: torch.Tensor,
        *,
        memory: Sequence[int],
        copies: Sequence[Mapping[str, list[RegionCopy]]],
        holdings: Mapping[str, Holding],
        metas: dict[str, TensorMeta],
        written: list[int],
    ) -> dict[int, tuple[list[np.ndarray], list[np.ndarray]]]:
        """Pack `batch` into `buffer`; per engine rank, the (local, remote) runs to WRITE."""
        base = buffer.data_ptr()
        runs: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = defaultdict(lambda: ([], []))
        for piece, offset in batch:
            holding, meta = holdings[piece.name], metas[piece.name]
            nbytes = piece.cell.numel * meta.element_bytes
            packed = buffer[offset : offset + nbytes].view(meta.dtype)
            packed.view(piece.cell.rows, piece.cell.cols).copy_(
                cell_view(holding.matrix(), holding.box, piece.cell)
            )
            each = copies[piece.target][piece.name][piece.copy]
            remote = _runs(piece, each, memory[piece.target], meta)
            starts = np.concatenate(([0], np.cumsum(remote[:, 1])[:-1])).astype(np.uint64)
            local, remotes = runs[piece.target]
            local.append(np.uint64(base + offset) + starts)
            remotes.append(remote)
            written[piece.target] += nbytes
        return runs

    def _post(
        self, runs: dict[int, tuple[list[np.ndarray], list[np.ndarray]]], ranks: Sequence[Rank]
    ) -> list[tuple[Rank, Any]]:
        """One WRITE per engine rank of a packed batch; the transfers posted."""
        posted: list[tuple[Rank, Any]] = []
        try:
            for index, (local, remote) in runs.items():
                posted.append((ranks[index], self._start(ranks[index], local, remote)))
        except BaseException:
            for _, handle in posted:
                handle.release()
            raise
        return posted

    def _start(self, rank: Rank, local: list[np.ndarray], remote: list[np.ndarray]) -> Any:
        """The WRITE of `local` runs (addresses here) onto `remote` runs of `rank`, started.

        Raises:
            RuntimeError: NIXL refused it (the transfer released).
        """
        nixl = self._agent.nixl
        remote_rows = np.concatenate(remote)
        lengths = remote_rows[:, 1]
        zeros = np.zeros(len(remote_rows), dtype=np.uint64)
        handle = nixl.initialize_xfer(
            "WRITE",
            nixl.get_xfer_descs(
                np.ascontiguousarray(np.stack([np.concatenate(local), lengths, zeros], 1)), "DRAM"
            ),
            nixl.get_xfer_descs(
                np.ascontiguousarray(np.stack([remote_rows[:, 0], lengths, zeros], 1)), "DRAM"
            ),
            rank.agent_name,
        )
        if nixl.transfer(handle) == "ERR":
            handle.release()
            raise RuntimeError(f"NIXL refused a write of cells to {rank.describe()}")
        return handle

    def _wait(self, pending: list[tuple[Rank, Any]], deadline: float) -> None:
        """Until every transfer of `pending` completed; then released (and `pending` empty)."""
        nixl = self._agent.nixl
        while pending:
            rank, handle = pending[0]
            state = nixl.check_xfer_state(handle)
            if state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"NIXL writes of cells not complete in time: {rank.describe()}"
                    )
                time.sleep(_POLL_S)
                continue
            pending.pop(0)
            handle.release()
            if state != "DONE":
                raise RuntimeError(f"NIXL write of cells to {rank.describe()} failed ({state})")

    def close(self) -> None:
        """Deregister and free the buffers."""
        for index in range(len(self._buffers)):
            self._agent.forget(f"{self._key}-cells-{index}")
        self._buffers = []
