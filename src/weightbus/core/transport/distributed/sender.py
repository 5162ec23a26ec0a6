"""`dist` on every trainer rank (`DistRankSender`): join the weights group, digest this rank's
share, send a session.

The leader's sink hands every rank the same orders (`Sending.everyone`):

- `JoinOrder` (set-up of a group of N: the trainer ranks are the group's first ranks): each
  other rank joins the group the leader forms; the leader's own sender runs the sink's part
  (the engines and itself join) through its hooks;
- `DigestOrder`: this rank's share of the digests (`trainer.digests.digest_share`: the tensors
  it sends whole, its blocks of the others), which the leader combines;
- `SessionOrder`: this rank's part of a session (`session.SessionRun`: the leader broadcasts the
  messages; in parts mode every rank sends each engine rank the parts it holds, two buckets in
  flight). In a group of N, a rank that fails aborts its membership, so every peer's pending
  operation ends at once, and the leader waits for the others' reports before its own ends.
"""

import logging
import time
from typing import Any

import msgspec
import torch

from weightbus.core.trainer.cells import cell_view
from weightbus.core.trainer.digests import RankDigests, digest_share
from weightbus.core.trainer.group import TrainerGroup
from weightbus.core.trainer.holdings import Holding
from weightbus.core.trainer.layout import TrainerLayout
from weightbus.core.transport.distributed.group import (
    WeightsGroup,
    abort,
    destroy_group,
    get_group,
    join_group,
)
from weightbus.core.transport.distributed.parts import PART_DIGEST_BYTES, payload_digest
from weightbus.core.transport.distributed.schedule import SendPart, bucket_parts, parts_hash
from weightbus.core.transport.distributed.session import LeaderPart, PartsPlan, SessionRun
from weightbus.core.transport.distributed.slices import aligned_offsets, slice_targets
from weightbus.core.transport.sending import RankSender, RankWork
from weightbus.core.wire.messages import RankLayout

logger = logging.getLogger(__name__)

_BUFFER_ROUNDING = 1 << 20  # payload buffers grow in MiB steps (reused across buckets)
_PLANS_KEPT = 8  # parts plans kept: engines that come and go, sibling groups


class JoinOrder(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Join the weights group the leader forms (its store at `master_addr:master_port`)."""

    group_name: str
    master_addr: str
    master_port: int
    world_size: int
    timeout_s: float


class DigestOrder(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Digest your share of the round's tensors."""


class SessionOrder(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Send your part of session `session_id` on group `group_name`, within `timeout_s`.

    Attributes:
        layouts: the engine ranks' slice maps (parts mode; the leader's group holds them).
        parts_hash: the leader's schedule of parts: a rank that computes another refuses
            before anything moves.
    """

    group_name: str
    session_id: str
    mode: str
    bucket_bytes: int
    plan_hash: str
    timeout_s: float
    layouts: list[RankLayout] = []
    parts_hash: str = ""


class Joined(msgspec.Struct, frozen=True, tag=True):
    """This rank joined the group."""


class DigestReport(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """This rank's share of the digests."""

    digests: RankDigests


class SessionReport(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """This rank's part of a session sent: its tensor bytes (summed over the engine ranks) and
    the bytes each engine group rank got from it (alignment padding included)."""

    sent_bytes: int
    rank_bytes: dict[int, int]


class DistRankSender(RankSender):
    """A trainer rank's side of `dist` (parts plans kept while the layouts are unchanged)."""

    order_type = JoinOrder | DigestOrder | SessionOrder
    report_type = Joined | DigestReport | SessionReport

    def __init__(self, group: TrainerGroup) -> None:
        super().__init__(group)
        self._plans: dict[tuple, tuple[PartsPlan, str]] = {}
        self._joined: set[str] = set()

    def run(self, order: Any, work: RankWork) -> Any:
        if isinstance(order, JoinOrder):
            return self._join(order, work)
        if isinstance(order, DigestOrder):
            key = f"{work.key}/digests"
            share = digest_share(dict(work.holdings), work.layout, work.group, key, work.deadline)
            return DigestReport(digests=share)
        assert isinstance(order, SessionOrder)
        return self._send(order, work)

    def _join(self, order: JoinOrder, work: RankWork) -> Joined:
        """The leader runs its sink's part of the set-up (its hooks: the engines and itself
        join); the others join as the group's ranks 1 .. T-1."""
        if work.hooks is not None:
            work.hooks(work)
            return Joined()
        join_group(
            name=order.group_name,
            master_addr=order.master_addr,
            master_port=order.master_port,
            group_rank=self.group.rank,
            world_size=order.world_size,
            timeout_s=order.timeout_s,
            layout=None,
            senders=self.group.world_size,
        )
        self._joined.add(order.group_name)
        return Joined()

    def parts_plan(self, layout: TrainerLayout, order: SessionOrder) -> tuple[PartsPlan, str]:
        """The parts of a session in parts mode and their hash ("" in a group of one: nobody
        to agree with), kept per layout, plan and engine ranks."""
        key = (layout.layout_hash, order.plan_hash, msgspec.msgpack.encode(order.layouts))
        found = self._plans.get(key)
        if found is None:
            plan = layout.plan(order.bucket_bytes, order.plan_hash)
            targets = slice_targets(order.layouts)
            parts = bucket_parts(layout, plan, targets)
            if len(self._plans) >= _PLANS_KEPT:
                self._plans.clear()
            hashed = parts_hash(layout, parts) if self.group.world_size > 1 else ""
            found = PartsPlan.of(plan, targets, parts, self.group.rank), hashed
            self._plans[key] = found
        return found

    def _send(self, order: SessionOrder, work: RankWork) -> SessionReport:
        group = get_group(order.group_name)
        leader: LeaderPart | None = work.hooks
        if leader is not None:
            leader.key = work.key
        try:
            return self._session(group, order, work, leader)
        except BaseException as exc:
            if self.group.world_size > 1:  # the peers waiting on this rank stop at once
                abort(group, f"a push failed midway on trainer rank {self.group.rank}: {exc}")
            raise

    def _session(
        self, group: WeightsGroup, order: SessionOrder, work: RankWork, leader: LeaderPart | None
    ) -> SessionReport:
        deadline = min(work.deadline, time.monotonic() + order.timeout_s)
        parts = None
        if order.mode == "parts":
            parts, hashed = self.parts_plan(work.layout, order)
            if hashed != order.parts_hash:
                raise ValueError(f"trainer rank {self.group.rank} computed other parts than rank 0")
            plan = parts.plan
        elif leader is not None:  # broadcast: the leader of a group of one
            plan = leader.session.plan
        else:
            raise ValueError(f"trainer rank {self.group.rank} cannot send in {order.mode} mode")
        holdings = work.holdings
        run = SessionRun(
            group,
            plan=plan,
            session_id=order.session_id,
            tensors={name: holding.tensor for name, holding in holdings.items()},
            deadline=deadline,
            parts=parts,
            pack=lambda mine, key: self._pack(group, holdings, mine, key),
            leader=leader,
        )
        run.run()
        if leader is not None and self.group.world_size > 1:
            # the others' reports: a group broken under this rank (an engine failed, a peer
            # aborted) ends the wait at once
            work.group.collect(
                f"{work.key}/done",
                "part of the dist session",
                deadline,
                work.group.others,
                interrupt=lambda: group.broken,
            )
        return SessionReport(sent_bytes=run.sent_bytes, rank_bytes=run.rank_bytes)

    def _pack(
        self,
        group: WeightsGroup,
        holdings: dict[str, Holding],
        parts: list[SendPart],
        key: tuple,
    ) -> tuple[torch.Tensor, int]:
        """This rank's `parts` of one payload, back to back, then their xxh3-128; the payload
        and its tensor bytes."""
        sizes = [part.numel * holdings[part.name].meta.element_bytes for part in parts]
        offsets, end = aligned_offsets(sizes)
        total = end + PART_DIGEST_BYTES
        rounded = -(-total // _BUFFER_ROUNDING) * _BUFFER_ROUNDING
        payload = group.buffer(key, rounded)[:total]
        for part, offset, size in zip(parts, offsets, sizes, strict=True):
            holding = holdings[part.name]
            destination = payload[offset : offset + size]
            if part.cell is None:  # a run of elements, as raw bytes
                destination.copy_(torch.from_numpy(holding.bytes_of(part.start, part.numel)))
                continue
            source = cell_view(holding.matrix(), holding.box, part.cell)
            destination.view(source.dtype).view(part.cell.rows, part.cell.cols).copy_(source)
        payload[end:] = payload_digest(payload, end)
        return payload, sum(sizes)

    def close(self) -> None:
        """Leave the groups this rank joined (the leader's sink leaves its own)."""
        for name in self._joined:
            destroy_group(name)
        self._joined.clear()
