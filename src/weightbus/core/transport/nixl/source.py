"""`nixl`, engine-rank side: offer this rank's registered parameters, then follow the
publisher's notices of what it wrote there (the bytes arrive as one-sided NIXL WRITEs; the rank
only re-reads its own regions to verify them).

Tensors written whole (`NixlInbox`) land in the rank's inbox: one buffer of `INBOX_SLOTS`
slots registered with its agent, made when a session first needs one, grown when one needs
more; the Receiver gets typed views into the slot (a split tensor reassembled).
"""

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from weightbus.core.plan import BucketPlan, Plan, plan_buckets
from weightbus.core.plan.assemble import ChunkAssembler, unpack_bucket
from weightbus.core.plan.bucket import BucketEntry
from weightbus.core.transport.base import ReceivedBatch
from weightbus.core.transport.nixl.agent import Agent, rank_agent
from weightbus.core.transport.nixl.messages import NixlDescription, NixlHello, NixlInbox
from weightbus.core.transport.nixl.schedule import inbox_entries, inbox_slot_bytes
from weightbus.core.transport.parts.arena import DirectPlacement
from weightbus.core.transport.parts.direct_channel import written_batches
from weightbus.core.transport.parts.rank_session import RankSessionSource
from weightbus.core.wire import DirectReady, ProtocolError, UpdateBegin

NO_MEMORY = (
    "transport nixl writes into the parameters' shared-memory arena, and this rank has none "
    "(engine started with --no-shm-weights, or /dev/shm could not hold them)"
)
# Inbox slots: the publisher writes bucket k+1 into one while the Receiver loads bucket k.
INBOX_SLOTS = 2


@dataclass
class _Inbox:
    """One registered inbox buffer of an agent; `busy` while a session uses it."""

    key: str
    memory: torch.Tensor | None = None
    busy: bool = False


# Inboxes by agent name, kept across sessions (registering memory changes the agent's
# metadata, which the publisher then loads again); a second concurrent session gets its own.
_inboxes: dict[str, list[_Inbox]] = {}
_inboxes_lock = threading.Lock()
# Whole tensors larger than a bucket are reassembled into buffers kept across pushes.
_assembly_buffers: dict[tuple, torch.Tensor] = {}


def _acquire_inbox(agent: Agent, nbytes: int) -> _Inbox:
    """A free inbox of `agent` of at least `nbytes`, registered, marked busy."""
    with _inboxes_lock:
        pool = _inboxes.setdefault(agent.name, [])
        inbox = next((each for each in pool if not each.busy), None)
        if inbox is None:
            inbox = _Inbox(f"weightbus-inbox-{len(pool)}")
            pool.append(inbox)
        inbox.busy = True
    try:
        if inbox.memory is None or inbox.memory.numel() < nbytes:
            agent.forget(inbox.key)
            inbox.memory = None
            memory = torch.empty(nbytes, dtype=torch.uint8)
            agent.register(inbox.key, memory)
            inbox.memory = memory
    except BaseException:
        _release_inbox(inbox)
        raise
    return inbox


def _release_inbox(inbox: _Inbox) -> None:
    with _inboxes_lock:
        inbox.busy = False


class NixlSource(RankSessionSource):
    """Engine-rank side of `nixl` for one session.

    Args:
        direct: this rank's parameters in a shared-memory arena (live, or staging for an
            atomic update): registered with the rank's NIXL agent and offered for writes.
    """

    def __init__(
        self,
        description: NixlDescription,
        *,
        rank: int = 0,
        tp_size: int = 1,
        direct: DirectPlacement | None = None,
    ) -> None:
        refusal = f"nixl endpoint {description.endpoint!r}"
        super().__init__(description, rank=rank, tp_size=tp_size, direct=direct, refusal=refusal)
        self._publisher_host = description.endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
        self._agent: Agent | None = None
        self._plan: Plan | None = None
        self._whole: list[list[BucketEntry]] = []  # per bucket: its entries for the inbox
        self._inbox: _Inbox | None = None
        self._inbox_memory: torch.Tensor | None = None  # held while the session reads it
        self._slot_bytes = 0

    def _hello(self) -> NixlHello:
        agent = self._agent = rank_agent(self.rank, self._publisher_host)
        placement = self._placement
        offer: dict = {"refusal": NO_MEMORY}
        if placement is not None and placement.memory is not None:
            agent.register(placement.target.file, placement.memory)
            offer = {"memory_address": placement.memory.data_ptr(), "target": placement.target}
        return NixlHello(
            session_id=self.session_id,
            group=self.group,
            rank=self.rank,
            tp_size=self.tp_size,
            agent_name=agent.name,
            agent_metadata=agent.metadata(),
            **offer,
        )

    def begin(self, timeout_s: float) -> UpdateBegin:
        hello = self._hello()
        self._socket.send(hello.encode())
        if hello.target is None:
            raise ValueError(NO_MEMORY)
        header = self._recv(UpdateBegin, timeout_s)
        if not header.direct:
            raise ProtocolError("a nixl session must write into the ranks' parameters")
        self._plan = plan_buckets([meta.to_meta() for meta in header.tensors], header.bucket_bytes)
        held = hello.target.named()
        self._whole = [inbox_entries(bucket, held) for bucket in self._plan.buckets]
        self._offer_inbox(inbox_slot_bytes(self._whole))
        # sent before begin() returns: the Receiver marks the target touched right after
        ready = DirectReady(session_id=self.session_id, group=self.group, rank=self.rank)
        self._socket.send(ready.encode())
        return header

    def _offer_inbox(self, slot_bytes: int) -> None:
        """Tell the publisher where this session's whole tensors land (before `DirectReady`,
        on the same socket: it has the inbox once it has every rank's confirmation)."""
        if not slot_bytes:
            return
        assert self._agent is not None
        self._inbox = _acquire_inbox(self._agent, INBOX_SLOTS * slot_bytes)
        self._slot_bytes = slot_bytes
        self._inbox_memory = self._inbox.memory
        assert self._inbox_memory is not None
        offer = NixlInbox(
            session_id=self.session_id,
            group=self.group,
            rank=self.rank,
            address=self._inbox_memory.data_ptr(),
            slot_bytes=slot_bytes,
            slots=INBOX_SLOTS,
            agent_metadata=self._agent.metadata(),
        )
        self._socket.send(offer.encode())

    def batches(self, timeout_s: float) -> Iterator[ReceivedBatch]:
        """One batch per plan bucket: the tensors written into this rank's parameters
        (`placed`, with the digests of its slices) and those written whole into its inbox
        (`tensors`: views valid until the batch's `release`; their bytes count in `nbytes`)."""
        assert self._plan is not None, "begin() first"
        assert self._placement is not None
        assembler = ChunkAssembler(buffers=_assembly_buffers)

        def inbox(bucket: BucketPlan) -> ReceivedBatch | None:
            whole = self._whole[bucket.index]
            if not whole:
                return None
            assert self._inbox_memory is not None
            start = (bucket.index % INBOX_SLOTS) * self._slot_bytes
            slot = self._inbox_memory[start : start + self._slot_bytes]
            return ReceivedBatch(
                tensors=list(
                    unpack_bucket(BucketPlan(bucket.index, tuple(whole)), slot, assembler)
                ),
                digests={},
                nbytes=sum(entry.nbytes for entry in whole),
                release=self._acker(bucket.index, bucket.index % INBOX_SLOTS),
            )

        regions = self._placement.regions
        yield from written_batches(self._recv, self._plan, regions, timeout_s, inbox)

    def close(self) -> None:
        super().close()
        if self._inbox is not None:
            _release_inbox(self._inbox)
            self._inbox = None
