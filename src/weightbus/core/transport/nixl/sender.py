"""`nixl` on every trainer rank: the leader's order (`NixlOrder`) names the engine ranks; the
rank loads their agents into its own (`agent.publisher_agent`) and WRITEs the tensors it sends
whole (`TrainerLayout.sender`) bucket by bucket (`writes.py`), then its cells of the tensors no
rank holds whole (`cells.py`), and reports its digests and bytes (`NixlReport`).
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import torch

from weightbus.core.trainer.layout import TrainerLayout
from weightbus.core.trainer.writes import Cells, WriteReport
from weightbus.core.transport.nixl.agent import DEFAULT_UCX_TLS, Agent, SendBuffers, publisher_agent
from weightbus.core.transport.nixl.cells import write_cells
from weightbus.core.transport.nixl.schedule import Schedule
from weightbus.core.transport.nixl.writes import BucketWrites, NixlTarget, WriteHooks
from weightbus.core.transport.parts.layout import RegionCopy, checked_copies
from weightbus.core.transport.sending import RankSender, RankWork

# schedules kept: an atomic engine alternates between two arenas, a fleet has several engines
COMPILED_KEPT = 8


class NixlOrder(msgspec.Struct, frozen=True, kw_only=True):
    """The leader's order: write your part of the session into these engine ranks (in
    session order).

    `ucx_devices` is the sink's setting ("": each rank keeps UCX to the interface that
    reaches `host`, the leader's address towards the engines).
    """

    targets: list[NixlTarget]
    bucket_bytes: int
    plan_hash: str
    verify: bool
    inflight_buckets: int = 2
    host: str = "127.0.0.1"
    ucx_devices: str = ""
    ucx_tls: str = DEFAULT_UCX_TLS


class NixlReport(WriteReport, frozen=True, kw_only=True):
    """A rank's part written (`WriteReport`), and the tensor bytes it posted into each engine
    rank (`target_bytes`)."""

    target_bytes: list[int]


@dataclass(frozen=True)
class NixlCompiled:
    """What a rank writes into one set of engine ranks: its buckets of the tensors it sends
    whole, its cells of the others, and each engine rank's checked slice map."""

    schedule: Schedule
    cells: Cells
    copies: list[dict[str, list[RegionCopy]]]


class NixlRankSender(RankSender):
    """A trainer rank's side of `nixl` (its agent, send buffers, thread pool and compiled
    schedules, kept while the layouts are unchanged)."""

    order_type = NixlOrder
    report_type = NixlReport

    def __init__(self, group: object) -> None:
        super().__init__(group)  # type: ignore[arg-type]
        # its agent, and its send buffers of buckets and of cells, once it wrote
        self._kept: tuple[Agent, SendBuffers, SendBuffers] | None = None
        self._compiled: dict[tuple, NixlCompiled] = {}
        self._pool = ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="nixl-pack")

    def run(self, order: NixlOrder, work: RankWork) -> NixlReport:
        """Write this rank's part of the session; its report.

        Raises:
            ValueError: an engine rank's layout does not fit the plan, or it needs an inbox
                that cannot be used (named).
            RuntimeError, TimeoutError: a WRITE failed or did not complete in time (the
                engine rank's agents are then disconnected: nothing late can land).
        """
        agent, buckets, cells = self._ready(order)
        compiled = self.compiled(work.layout, order)
        targets = order.targets
        hooks = work.hooks if isinstance(work.hooks, WriteHooks) else None
        deadline = min(work.deadline, hooks.deadline) if hooks else work.deadline
        writes = None
        try:
            for target in targets:
                agent.load_remote(target.agent_name, target.agent_metadata, target.describe())
            sends = compiled.schedule.sends
            if sends:  # the tensors it sends whole
                writes = BucketWrites(
                    agent,
                    tensors={name: work.holdings[name].tensor for name in sends},
                    targets=targets,
                    schedule=compiled.schedule,
                    buffers=buckets.ready(order.inflight_buckets, compiled.schedule.slot_bytes),
                    verify=order.verify,
                    refuse_nonfinite=work.refuse_nonfinite,
                    hooks=hooks,
                )
                writes.run(self._pool, deadline)
            target_bytes = write_cells(
                agent,
                cells,
                [p for p in compiled.cells.pieces if p.owner == self.group.rank],
                targets=targets,
                copies=compiled.copies,
                holdings=work.holdings,
                deadline=deadline,
                refuse_nonfinite=work.refuse_nonfinite,
            )
        except Exception:
            for target in targets:  # cancel what is in flight: nothing may land later
                agent.forget_remote(target.agent_name)
            raise
        if writes is not None:
            target_bytes = [a + b for a, b in zip(writes.rank_bytes, target_bytes, strict=True)]
        blocks = compiled.cells.blocks(work.holdings, work.group, work.key, work.deadline)
        return NixlReport(
            schedule_hash=compiled.cells.schedule_hash,
            sent_bytes=sum(target_bytes),
            target_bytes=target_bytes,
            whole=writes.digests if writes else {},
            whole_slices=dict(enumerate(writes.slice_digests)) if writes else {},
            blocks=blocks,
        )

    def compiled(self, layout: TrainerLayout, order: NixlOrder) -> NixlCompiled:
        """What this rank writes of `layout` into `order`'s engine ranks (kept per layouts;
        the leader checks the engine ranks' layouts with its own before the session begins).

        Raises:
            ValueError: an engine rank's layout does not fit the plan, or it lacks a slice of
                a tensor sent in cells (named).
        """
        key = (
            layout.layout_hash,
            order.plan_hash,
            order.verify,
            tuple((t.target.file, t.target.layout_hash, t.memory_address) for t in order.targets),
        )
        if key not in self._compiled:
            if len(self._compiled) >= COMPILED_KEPT:  # engines that came and went
                self._compiled.clear()
            self._compiled[key] = self._compile(layout, order)
        return self._compiled[key]

    def _compile(self, layout: TrainerLayout, order: NixlOrder) -> NixlCompiled:
        plan = layout.plan(order.bucket_bytes, order.plan_hash)
        metas = {meta.name: meta for meta in plan.metas}
        in_cells = [meta.name for meta in plan.metas if layout.sender(meta.name) is None]
        copies = []
        for target in order.targets:
            where = f"engine {target.group} rank {target.rank}"
            try:
                # a tensor of the slice map the session lacks is not written (a delta push
                # carries some parameters only); one the slice map lacks goes whole
                checked = checked_copies(target.target, metas, partial=True)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            lacking = [name for name in in_cells if name not in checked]
            if lacking:  # only a tensor sent whole can go whole, into an inbox
                raise ValueError(f"{where} holds no slice of {lacking[0]!r}, sent in cells")
            copies.append(checked)
        sends = {name for name, rank in layout.senders.items() if rank == self.group.rank}
        memory = [target.memory_address for target in order.targets]
        schedule = Schedule(plan, list(zip(memory, copies, strict=True)), sends=sends)
        slices = [
            {name: [each.copy for each in found] for name, found in c.items()} for c in copies
        ]
        cells = Cells.of(layout, slices, verify=order.verify)
        return NixlCompiled(schedule, cells, copies)

    def _ready(self, order: NixlOrder) -> tuple[Agent, SendBuffers, SendBuffers]:
        """This process's agent for the sink's UCX settings (the sink's own, on the leader),
        and this sender's send buffers (registered with it)."""
        if self._kept is None:
            agent = publisher_agent(
                order.host, ucx_devices=order.ucx_devices, ucx_tls=order.ucx_tls
            )
            key = f"sender-{id(self):x}"  # this sender's registrations in the shared agent
            self._kept = (
                agent,
                SendBuffers(agent, f"{key}-send"),
                SendBuffers(agent, f"{key}-cells"),
            )
        return self._kept

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._kept is not None:
            for buffers in self._kept[1:]:
                buffers.close()
