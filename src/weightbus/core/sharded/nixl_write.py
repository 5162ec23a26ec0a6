"""One sharded write over `nixl`, as every trainer rank runs it: each rank posts its own
one-sided WRITEs of the pieces it holds into the engine ranks' registered memory.

Rank 0 announces the engine ranks' hellos (agent, where their memory starts, their offered
parameters: `NixlWriteOrder`); every rank loads the agents into its own NIXL agent, computes
the same schedule as `shm` direct (`schedule.make_schedule`), and per batch of at most its send
buffer packs its pieces (each cell in row-major order) and posts one WRITE per engine rank: a
list of runs, one per row of a cell unless the cell spans whole rows of the parameter. The
digests are computed as for `shm` (`digests.compute`), and rank 0 answers the engines.
"""

import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import torch

from weightbus.core.meta import TensorMeta
from weightbus.core.plan.bucket import ALIGN_BYTES
from weightbus.core.sharded.boxes import matrix_shape
from weightbus.core.sharded.control import GroupControl
from weightbus.core.sharded.digests import compute
from weightbus.core.sharded.holdings import Holding
from weightbus.core.sharded.layout import TrainerLayout
from weightbus.core.sharded.schedule import Piece, cell_view
from weightbus.core.sharded.write import (
    COMPILED_KEPT,
    Compiled,
    WriteOutcome,
    WriteReport,
    collect_outcome,
)
from weightbus.core.transport.nixl.agent import DEFAULT_UCX_TLS, publisher_agent
from weightbus.core.transport.parts.layout import RegionCopy, checked_copies
from weightbus.core.wire import DirectTarget

_POLL_S = 0.0002  # between two looks at the WRITEs' state (NIXL has no blocking wait)
SEND_BUFFER_BYTES = 64 << 20


class NixlTarget(msgspec.Struct, frozen=True, kw_only=True):
    """One engine rank as its hello offered it."""

    agent_name: str
    agent_metadata: bytes
    memory_address: int
    target: DirectTarget


class NixlWriteOrder(msgspec.Struct, frozen=True, kw_only=True):
    """Rank 0's order to write: the engine ranks, in session order."""

    targets: list[NixlTarget]
    bucket_bytes: int
    plan_hash: str
    verify: bool
    ucx_tls: str = DEFAULT_UCX_TLS


# a write's schedule and digests, and each engine rank's checked slice map (its regions)
_Compiled = tuple[Compiled, list[dict[str, list[RegionCopy]]]]


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
    addresses = np.uint64(base) + (rows * np.uint64(param_cols) + np.uint64(first_col)) * np.uint64(
        size
    )
    return np.stack([addresses, np.full_like(addresses, cell.cols * size)], axis=1)


class GroupNixlWriter:
    """A trainer rank's side of sharded `nixl` writes: its agent, send buffer and schedules."""

    def __init__(self, control: GroupControl, send_buffer_bytes: int = SEND_BUFFER_BYTES) -> None:
        self._control = control
        self._agent = None
        self._buffer = torch.zeros(send_buffer_bytes, dtype=torch.uint8)
        self._compiled: dict[tuple, _Compiled] = {}
        self._loaded: dict[str, bytes] = {}

    def write(
        self,
        key: str,
        order: NixlWriteOrder,
        layout: TrainerLayout,
        holdings: dict[str, Holding],
        deadline: float,
    ) -> None:
        """Post this rank's WRITEs and report (`key`); a failure is reported, then raised."""

        def work() -> bytes:
            compiled = self._compile(layout, order)
            agent = self._ready_agent(order)
            sent = self._post_all(
                agent, order, compiled=compiled, layout=layout, holdings=holdings, deadline=deadline
            )
            schedule = compiled[0]
            digests = compute(schedule.digest_plan, holdings, self._control, key, deadline)
            report = WriteReport(
                schedule_hash=schedule.schedule_hash, sent_bytes=sent, digests=digests
            )
            return msgspec.msgpack.encode(report)

        self._control.answer(key, work)

    def outcome(
        self, key: str, layout: TrainerLayout, order: NixlWriteOrder, deadline: float
    ) -> WriteOutcome:
        """Rank 0: every rank's report, checked and combined (`write.collect_outcome`)."""
        schedule, _ = self._compile(layout, order)
        return collect_outcome(
            self._control, key, layout, schedule, num_targets=len(order.targets), deadline=deadline
        )

    def _ready_agent(self, order: NixlWriteOrder):
        if self._agent is None:
            self._agent = publisher_agent(ucx_tls=order.ucx_tls)
            self._agent.register(f"sharded-send-{id(self):x}", self._buffer)
        for target in order.targets:
            if self._loaded.get(target.agent_name) != target.agent_metadata:
                self._agent.load_remote(target.agent_name, target.agent_metadata)
                self._loaded[target.agent_name] = target.agent_metadata
        return self._agent

    def _compile(self, layout: TrainerLayout, order: NixlWriteOrder) -> _Compiled:
        key = (
            layout.layout_hash,
            order.plan_hash,
            order.verify,
            tuple((t.target.layout_hash, t.memory_address) for t in order.targets),
        )
        if key not in self._compiled:
            plan = layout.plan(order.bucket_bytes, order.plan_hash)
            metas = {meta.name: meta for meta in plan.metas}
            copies = [checked_copies(t.target, metas) for t in order.targets]
            slices = [{n: [rc.copy for rc in rcs] for n, rcs in c.items()} for c in copies]
            if len(self._compiled) >= COMPILED_KEPT:
                self._compiled.clear()
            self._compiled[key] = (Compiled.of(layout, slices, verify=order.verify), copies)
        return self._compiled[key]

    def _post_all(
        self,
        agent: Any,
        order: NixlWriteOrder,
        *,
        compiled: _Compiled,
        layout: TrainerLayout,
        holdings: dict[str, Holding],
        deadline: float,
    ) -> int:
        """Pack and WRITE this rank's pieces, a send buffer at a time; the bytes sent."""
        metas = {meta.name: meta for meta in layout.metas}
        schedule, copies = compiled
        mine = [piece for piece in schedule.pieces if piece.owner == self._control.rank]
        for batch in self._batches(mine, metas):
            self._write_batch(
                agent, order, batch, copies=copies, holdings=holdings, metas=metas,
                deadline=deadline,
            )  # fmt: skip
        return sum(piece.cell.numel * metas[piece.name].element_bytes for piece in mine)

    def _batches(
        self, pieces: list[Piece], metas: dict[str, TensorMeta]
    ) -> Iterator[list[tuple[Piece, int]]]:
        """The pieces in batches that fit the send buffer, each with its offset there."""
        batch: list[tuple[Piece, int]] = []
        used = 0
        for piece in pieces:
            nbytes = piece.cell.numel * metas[piece.name].element_bytes
            if nbytes > self._buffer.numel():
                raise ValueError(
                    f"tensor {piece.name!r}: a piece of {nbytes} bytes exceeds the send buffer"
                )
            if batch and used + nbytes > self._buffer.numel():
                yield batch
                batch, used = [], 0
            batch.append((piece, used))
            used = -(-(used + nbytes) // ALIGN_BYTES) * ALIGN_BYTES
        if batch:
            yield batch

    def _write_batch(
        self,
        agent: Any,
        order: NixlWriteOrder,
        batch: list[tuple[Piece, int]],
        *,
        copies: list[dict[str, list[RegionCopy]]],
        holdings: dict[str, Holding],
        metas: dict[str, TensorMeta],
        deadline: float,
    ) -> None:
        """Pack `batch` into the send buffer and WRITE it, one transfer per engine rank."""
        base = self._buffer.data_ptr()
        local: dict[int, list[np.ndarray]] = defaultdict(list)
        remote: dict[int, list[np.ndarray]] = defaultdict(list)
        for piece, offset in batch:
            holding, meta = holdings[piece.name], metas[piece.name]
            source = cell_view(
                holding.local.view(holding.box.rows, holding.box.cols), holding.box, piece.cell
            )
            nbytes = piece.cell.numel * meta.element_bytes
            packed = (
                self._buffer[offset : offset + nbytes]
                .view(meta.dtype)
                .view(piece.cell.rows, piece.cell.cols)
            )
            packed.copy_(source)
            target = order.targets[piece.target]
            each = copies[piece.target][piece.name][piece.copy]
            runs = _runs(piece, each, target.memory_address, meta)
            starts = np.concatenate(([0], np.cumsum(runs[:, 1])[:-1])).astype(np.uint64)
            local[piece.target].append(np.uint64(base + offset) + starts)
            remote[piece.target].append(runs)
        nixl = agent.nixl
        handles = []
        try:
            for index, parts in remote.items():
                runs = np.concatenate(parts)
                zeros = np.zeros(len(runs), dtype=np.uint64)
                local_rows = np.ascontiguousarray(
                    np.stack([np.concatenate(local[index]), runs[:, 1], zeros], axis=1)
                )
                remote_rows = np.ascontiguousarray(
                    np.stack([runs[:, 0], runs[:, 1], zeros], axis=1)
                )
                handle = nixl.initialize_xfer(
                    "WRITE",
                    nixl.get_xfer_descs(local_rows, "DRAM"),
                    nixl.get_xfer_descs(remote_rows, "DRAM"),
                    order.targets[index].agent_name,
                )
                handles.append((index, handle))
                if nixl.transfer(handle) == "ERR":
                    raise RuntimeError(f"nixl: the WRITE to engine rank {index} failed to start")
            for index, handle in handles:
                while (state := nixl.check_xfer_state(handle)) == "PROC":
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"nixl: the WRITE to engine rank {index} did not complete in time"
                        )
                    time.sleep(_POLL_S)
                if state != "DONE":
                    raise RuntimeError(f"nixl: the WRITE to engine rank {index} failed ({state})")
        finally:
            for _, handle in handles:
                handle.release()
