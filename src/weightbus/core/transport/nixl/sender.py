"""`nixl` on every trainer rank: each posts its own one-sided WRITEs of what it sends into the
engine ranks' registered memory.

The leader's sink orders every rank alike (`NixlOrder`: the engine ranks' hellos); each rank
loads the engine ranks' agents into its own (`agent.publisher_agent`, shared per UCX setting
in a process) and writes:

- the tensors it sends whole (`TrainerLayout.sender`; in a group of one, every tensor) bucket
  by bucket (`writes.BucketWrites`): every engine rank's slices packed and digested in one
  pass, one WRITE per engine rank, `inflight_buckets` buffers in flight. In a group of one the
  leader's sink tells each engine rank of each bucket as soon as its WRITE completed
  (`hooks.WriteHooks`), and the tensors its slice maps lack go whole into its inbox;
- its cells of the tensors no rank holds whole (`trainer.cells`), in batches (`cells.py`),
  then its blocks of their digests (`trainer.digests`).

It reports its digests and bytes; in a group of several ranks, the leader combines the
reports (`trainer.writes.write_outcome`) and tells the engine ranks every bucket.
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import torch

from weightbus.core.plan import Plan
from weightbus.core.trainer.digests import BlockDigests, compute
from weightbus.core.trainer.layout import TrainerLayout
from weightbus.core.trainer.writes import Cells, WriteReport
from weightbus.core.transport.nixl.agent import (
    DEFAULT_UCX_TLS,
    Agent,
    interface_towards,
    publisher_agent,
)
from weightbus.core.transport.nixl.cells import CellWrites
from weightbus.core.transport.nixl.hooks import InboxSlots, Rank, WriteHooks
from weightbus.core.transport.nixl.schedule import Schedule
from weightbus.core.transport.nixl.writes import BucketWrites
from weightbus.core.transport.parts.layout import RegionCopy, checked_copies
from weightbus.core.transport.sending import RankSender, RankWork
from weightbus.core.wire import DirectTarget

# schedules kept: an atomic engine alternates between two arenas, a fleet has several engines
COMPILED_KEPT = 8


class NixlTarget(msgspec.Struct, frozen=True, kw_only=True):
    """One engine rank as its hello offered it: its agent (the metadata it sent last: its
    inbox's, when it offered one), where its memory starts, its parameters, its inbox."""

    group: int
    rank: int
    agent_name: str
    agent_metadata: bytes
    memory_address: int
    target: DirectTarget
    inbox: tuple[int, int, int] | None = None  # (address, slot bytes, slots)


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

    plan: Plan
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
        self._key = f"sender-{id(self):x}"  # this sender's registrations in the shared agent
        self._agent: Agent | None = None
        self._cells: CellWrites | None = None
        self._buffers: list[torch.Tensor] = []
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
        agent = self._ready_agent(order)
        compiled = self.compiled(work.layout, order)
        ranks = [
            Rank(index, t.group, t.rank, t.agent_name) for index, t in enumerate(order.targets)
        ]
        try:
            for target in order.targets:
                _load(agent, target)
            bytes_whole, writes = self._write_whole(agent, order, compiled, ranks, work)
            memory = [target.memory_address for target in order.targets]
            mine = [p for p in compiled.cells.pieces if p.owner == self.group.rank]
            assert self._cells is not None
            bytes_cells = self._cells.write(
                mine,
                ranks=ranks,
                memory=memory,
                copies=compiled.copies,
                holdings=work.holdings,
                deadline=_deadline(work),
            )
        except Exception:
            for target in order.targets:  # cancel what is in flight: nothing may land later
                agent.forget_remote(target.agent_name)
            raise
        blocks = BlockDigests([])
        if compiled.cells.digest_plan.regions:
            key = f"{work.key}/digests"
            blocks = compute(
                compiled.cells.digest_plan, work.holdings, work.group, key, work.deadline
            )
        target_bytes = [a + b for a, b in zip(bytes_whole, bytes_cells, strict=True)]
        return NixlReport(
            schedule_hash=compiled.cells.schedule_hash,
            sent_bytes=sum(target_bytes),
            target_bytes=target_bytes,
            whole=writes.digests if writes else {},
            whole_slices=dict(enumerate(writes.slice_digests)) if writes else {},
            blocks=blocks,
        )

    def _write_whole(
        self,
        agent: Agent,
        order: NixlOrder,
        compiled: NixlCompiled,
        ranks: list[Rank],
        work: RankWork,
    ) -> tuple[list[int], BucketWrites | None]:
        """The tensors this rank sends whole, bucket by bucket; the bytes written into each
        engine rank, and the writes (None: it sends none)."""
        sends = compiled.schedule.sends
        if not sends:
            return [0] * len(ranks), None
        hooks = work.hooks if isinstance(work.hooks, WriteHooks) else None
        writes = BucketWrites(
            agent.nixl,
            compiled.plan,
            tensors={name: work.holdings[name].tensor for name in sends},
            ranks=ranks,
            schedule=compiled.schedule,
            buffers=self._send_buffers(agent, compiled.schedule.slot_bytes, order),
            verify=order.verify,
            inboxes=[None if t.inbox is None else InboxSlots(*t.inbox) for t in order.targets],
            hooks=hooks,
        )
        writes.run(self._pool, _deadline(work))
        return writes.rank_bytes, writes

    def compiled(self, layout: TrainerLayout, order: NixlOrder) -> NixlCompiled:
        """What this rank writes of `layout` into `order`'s engine ranks (kept per layouts;
        the leader reads its own after its part ran).

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
        return NixlCompiled(plan, schedule, cells, copies)

    def _ready_agent(self, order: NixlOrder) -> Agent:
        """This process's agent for the sink's UCX settings (the sink's own, on the leader)."""
        if self._agent is None:
            devices = order.ucx_devices or interface_towards(order.host)
            self._agent = publisher_agent(ucx_devices=devices, ucx_tls=order.ucx_tls)
            self._cells = CellWrites(self._agent, self._key)
        return self._agent

    def _send_buffers(self, agent: Agent, slot_bytes: int, order: NixlOrder) -> list[torch.Tensor]:
        count = order.inflight_buckets
        if len(self._buffers) == count and self._buffers[0].numel() >= slot_bytes:
            return self._buffers
        self._free_buffers()
        for index in range(count):
            buffer = torch.zeros(slot_bytes, dtype=torch.uint8)  # pages faulted in once, here
            agent.register(f"{self._key}-send-{index}", buffer)
            self._buffers.append(buffer)
        return self._buffers

    def _free_buffers(self) -> None:
        if self._agent is not None:
            for index in range(len(self._buffers)):
                self._agent.forget(f"{self._key}-send-{index}")
        self._buffers = []

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._free_buffers()
        if self._cells is not None:
            self._cells.close()


def _load(agent: Agent, target: NixlTarget) -> None:
    try:
        agent.load_remote(target.agent_name, target.agent_metadata)
    except (RuntimeError, ValueError) as exc:
        raise type(exc)(f"engine {target.group} rank {target.rank}: {exc}") from None


def _deadline(work: RankWork) -> float:
    """The rank's deadline, or the leader's sink's stream deadline when it is earlier."""
    hooks = work.hooks
    return min(work.deadline, hooks.deadline) if isinstance(hooks, WriteHooks) else work.deadline
