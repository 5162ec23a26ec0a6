"""`nixl`, publisher side: one-sided NIXL WRITEs of each rank's slices into its parameters.

No collective group: each engine rank, when it opens a session, connects to the publisher's
ZMQ socket (`tcp://`) and says hello with its NIXL agent's metadata and its parameter layout
(the `DirectTarget` that `shm` direct mode uses). The publisher loads each agent's metadata
(once per change), computes the write schedule once per layout (`schedule.py`), and per plan
bucket packs every rank's slices into a registered send buffer (digesting them as they pass)
and posts one WRITE per rank; `inflight_buckets` send buffers bound what is in flight. Once a
rank's WRITE of a bucket is complete, a `TensorsWritten` tells it which tensors are done, with
the digests of the bytes now in its regions, which the rank re-reads to verify. An engine can
join or leave between pushes: nothing else is re-formed.

A session may carry tensors that are not parameters (a delta push's payload): a tensor of the
plan that a rank's slice map does not name reaches that rank whole, in its inbox. Such a rank
answers the `UpdateBegin` with a `NixlInbox` (where its inbox slots are, registered with its
agent) before its `DirectReady`; the entries travel in the same WRITE as the bucket's slices,
into slot `bucket % slots`, and the `TensorsWritten` carries their digests. The rank hands
them to the Receiver as whole tensors and sends a `SlotAck` once the Receiver released the
batch; a slot is written again only after that ack.
"""

import logging
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import torch
import zmq

from weightbus.core.transport.base import BucketSink, Progress, PushSession, no_progress
from weightbus.core.transport.nixl.agent import DEFAULT_UCX_TLS, interface_towards, publisher_agent
from weightbus.core.transport.nixl.messages import NixlDescription, NixlHello, NixlInbox
from weightbus.core.transport.nixl.schedule import Schedule
from weightbus.core.transport.nixl.writes import POLL_PAUSE_S, BucketWrites, Rank
from weightbus.core.transport.parts.direct_channel import receive_one
from weightbus.core.transport.parts.layout import checked_copies
from weightbus.core.transport.parts.rank_session import JoiningRanks
from weightbus.core.wire import DirectReady, Message, ProtocolError, SlotAck, UpdateAbort, decode

logger = logging.getLogger(__name__)

MAX_CACHED_SCHEDULES = 8


class SessionRanks(JoiningRanks):
    """The ranks that joined the current session, by ZMQ identity."""

    def __init__(self, session: PushSession) -> None:
        super().__init__(session)
        self.hellos: dict[bytes, NixlHello] = {}
        self.ready: set[tuple[int, int]] = set()
        self.inboxes: dict[tuple[int, int], NixlInbox] = {}
        self.acks: set[tuple[int, int, int]] = set()  # (group, rank, bucket) released

    def joined_groups(self) -> Iterator[int]:
        return (hello.group for hello in self.hellos.values())

    def on_message(self, identity: bytes, message: Message) -> None:
        if getattr(message, "session_id", None) != self.session.session_id:
            return  # a late message of an earlier session
        if isinstance(message, NixlHello) and message.group < self.session.receivers:
            self.hellos[identity] = message
            self.tp_sizes[message.group] = message.tp_size
        elif isinstance(message, DirectReady):
            self.ready.add((message.group, message.rank))
        elif isinstance(message, NixlInbox):
            self.inboxes[(message.group, message.rank)] = message
        elif isinstance(message, SlotAck):
            self.acks.add((message.group, message.rank, message.bucket_index))

    def ordered(self) -> list[tuple[bytes, NixlHello]]:
        return sorted(self.hellos.items(), key=lambda item: (item[1].group, item[1].rank))


def _wait_all(nixl: Any, handles: list, deadline: float) -> None:
    """Until every transfer completed, then release them."""
    try:
        while any(nixl.check_xfer_state(handle) == "PROC" for handle in handles):
            if time.perf_counter() > deadline:
                raise TimeoutError("nixl: raw writes not complete in time")
            time.sleep(POLL_PAUSE_S)
        if any(nixl.check_xfer_state(handle) != "DONE" for handle in handles):
            raise RuntimeError("nixl: a raw write failed")
    finally:
        for handle in handles:
            handle.release()


class NixlSink(BucketSink):
    """Publisher side of `nixl`.

    Args:
        host: the address engine ranks reach this publisher at (its ZMQ socket binds there).
        port: the socket's port (0: one from the OS).
        inflight_buckets: send buffers, i.e. buckets packed or in flight at once (>= 1).
        ucx_devices: network devices UCX may use here (`UCX_NET_DEVICES`, e.g. "eth1"; by
            default the interface `host` is on, so UCX listens nowhere else).
        ucx_tls: UCX transports here (`UCX_TLS`): by default all but UCX's shared-memory
            ones (CMA between processes of one host, RDMA or TCP across hosts); "tcp" forces
            TCP.
    """

    name = "nixl"
    carries_any_tensors = True  # parameters into the ranks' memory, other tensors into inboxes

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        inflight_buckets: int = 2,
        ucx_devices: str = "",
        ucx_tls: str = DEFAULT_UCX_TLS,
    ) -> None:
        if inflight_buckets < 1:
            raise ValueError(f"inflight_buckets must be >= 1, got {inflight_buckets}")
        self.inflight_buckets = inflight_buckets
        devices = ucx_devices or interface_towards(host)
        self._agent = publisher_agent(ucx_devices=devices, ucx_tls=ucx_tls)
        self._key = f"sink-{id(self):x}"  # this sink's registrations in the shared agent
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        try:
            if port == 0:
                port = self._socket.bind_to_random_port(f"tcp://{host}")
            else:
                self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"nixl: cannot listen on {host}:{port}: {exc}") from None
        self.endpoint = f"tcp://{host}:{port}"
        self._schedules: dict[tuple, Schedule] = {}
        self._buffers: list[torch.Tensor] = []
        self._pool = ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="nixl-pack")
        # bytes written into each (engine, rank) by the last push: each rank's share
        self.rank_bytes: dict[tuple[int, int], int] = {}
        # (agent, memory address, memory bytes) per rank
        self._last_targets: list[tuple[str, int, int]] = []

    def sibling_options(
        self, sink_options: dict[str, Any], setup_options: dict[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        return {**sink_options, "port": 0}, setup_options  # its own socket

    def prepare(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        progress: Progress = no_progress,
    ) -> NixlDescription:
        return NixlDescription(endpoint=self.endpoint, session_id=session.session_id)

    def for_engine(self, description: NixlDescription, engine_index: int) -> NixlDescription:
        return msgspec.structs.replace(description, group=engine_index)

    def stream(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        timeout_s: float,
        progress: Progress = no_progress,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        ranks = SessionRanks(session)
        try:
            ranks.wait_until_complete(
                lambda what, anyway: self._receive(ranks, deadline, what, anyway)
            )
        except (TimeoutError, ValueError) as exc:  # the ranks that joined hear of it at once
            abort = UpdateAbort(session_id=session.session_id, reason=f"publisher failed: {exc}")
            self._send([identity for identity, _ in ranks.ordered()], abort)
            raise
        joined = ranks.ordered()
        identities = [identity for identity, _ in joined]
        try:
            targets, schedule = self._targets(session, joined)
            self._send(identities, msgspec.structs.replace(session.begin_message(), direct=True))
            # no byte lands in a rank's parameters before the rank knows they are being written
            while len(ranks.ready) < len(joined):
                self._receive(ranks, deadline, "every rank to confirm the session")
            inboxes = self._inboxes(ranks, joined)
            buffers = self._send_buffers(schedule.slot_bytes)
            writes = BucketWrites(
                self._agent.nixl,
                session,
                tensors=tensors,
                ranks=targets,
                schedule=schedule,
                buffers=buffers,
                notify=self._send_to,
                inboxes=inboxes,
                acks=ranks.acks,
                listen=lambda: self._listen(ranks),
            )
            writes.run(self._pool, deadline, progress)
        except Exception as exc:
            reason = f"publisher failed: {type(exc).__name__}: {exc}"
            self._send(identities, UpdateAbort(session_id=session.session_id, reason=reason))
            self._forget([hello for _, hello in joined])
            raise
        self.rank_bytes = writes.rank_bytes
        self._last_targets = [
            (hello.agent_name, hello.memory_address, hello.target.nbytes) for _, hello in joined
        ]
        self._send(identities, session.end_message())

    def _targets(
        self, session: PushSession, joined: list[tuple[bytes, NixlHello]]
    ) -> tuple[list[Rank], Schedule]:
        """The session's ranks (their agents loaded) and its schedule."""
        hellos = [hello for _, hello in joined]
        for hello in hellos:
            if hello.target is None:
                raise ValueError(f"engine {hello.group} rank {hello.rank}: {hello.refusal}")
        schedule = self._schedule(session, hellos)
        for hello in hellos:
            self._load_agent(hello)
        ranks = [
            Rank(index, hello.group, hello.rank, hello.agent_name, identity)
            for index, (identity, hello) in enumerate(joined)
        ]
        return ranks, schedule

    def _inboxes(
        self, ranks: SessionRanks, joined: list[tuple[bytes, NixlHello]]
    ) -> list[NixlInbox | None]:
        """Each rank's inbox (sent before its `DirectReady`, so here by now), its agent's
        metadata loaded again: registering the inbox changed it."""
        inboxes = []
        for _, hello in joined:
            inbox = ranks.inboxes.get((hello.group, hello.rank))
            if inbox is not None:
                self._load_agent(
                    msgspec.structs.replace(hello, agent_metadata=inbox.agent_metadata)
                )
            inboxes.append(inbox)
        return inboxes

    def _schedule(self, session: PushSession, hellos: list[NixlHello]) -> Schedule:
        key = (
            session.plan.plan_hash,
            tuple((h.target.file, h.target.layout_hash, h.memory_address) for h in hellos),
        )
        schedule = self._schedules.get(key)
        if schedule is None:
            metas = {meta.name: meta for meta in session.plan.metas}
            ranks = []
            for hello in hellos:
                try:
                    # a tensor of the slice map the session lacks is not written (a delta
                    # push carries some parameters only); one the slice map lacks goes whole
                    copies = checked_copies(hello.target, metas, partial=True)
                    ranks.append((hello.memory_address, copies))
                except ValueError as exc:
                    raise ValueError(f"engine {hello.group} rank {hello.rank}: {exc}") from None
            schedule = Schedule(session.plan, ranks)
            if len(self._schedules) >= MAX_CACHED_SCHEDULES:
                self._schedules.pop(next(iter(self._schedules)))
            self._schedules[key] = schedule
        return schedule

    def _load_agent(self, hello: NixlHello) -> None:
        try:
            self._agent.load_remote(hello.agent_name, hello.agent_metadata)
        except (RuntimeError, ValueError) as exc:
            raise type(exc)(f"engine {hello.group} rank {hello.rank}: {exc}") from None

    def _send_buffers(self, slot_bytes: int) -> list[torch.Tensor]:
        if len(self._buffers) == self.inflight_buckets and self._buffers[0].numel() >= slot_bytes:
            return self._buffers
        self._free_buffers()
        for index in range(self.inflight_buckets):
            buffer = torch.zeros(slot_bytes, dtype=torch.uint8)  # pages faulted in once, here
            self._agent.register(f"{self._key}-send-{index}", buffer)
            self._buffers.append(buffer)
        return self._buffers

    def raw_write_seconds(self, timeout_s: float = 60.0) -> float:
        """The floor of the last push (benchmarks): the seconds plain WRITEs of each rank's
        share, from one registered buffer, take into the same ranks' memory at once.

        This overwrites the ranks' parameters written by the last push: push again after.

        Raises:
            ValueError: no push completed yet.
            RuntimeError, TimeoutError: a WRITE failed or did not complete in time.
        """
        if not self._last_targets:
            raise ValueError("nixl: no push completed yet")
        # a share written into an inbox too (a delta push) is written into the memory alone
        shares = [
            min(nbytes, memory)
            for nbytes, (_, _, memory) in zip(
                self.rank_bytes.values(), self._last_targets, strict=True
            )
        ]
        source = torch.ones(max(shares), dtype=torch.uint8)
        self._agent.register(f"{self._key}-floor", source)
        nixl = self._agent.nixl
        try:
            handles = [
                nixl.initialize_xfer(
                    "WRITE",
                    nixl.get_xfer_descs([(source.data_ptr(), nbytes, 0)], "DRAM"),
                    nixl.get_xfer_descs([(address, nbytes, 0)], "DRAM"),
                    agent,
                )
                for (agent, address, _), nbytes in zip(self._last_targets, shares, strict=True)
            ]
            start = time.perf_counter()
            for handle in handles:
                nixl.transfer(handle)
            _wait_all(nixl, handles, start + timeout_s)
            return time.perf_counter() - start
        finally:
            self._agent.forget(f"{self._key}-floor")

    def _forget(self, hellos: list[NixlHello]) -> None:
        """After a failed session: disconnect its ranks' agents, cancelling what is in flight,
        so nothing of it can land later; the next push reconnects. The send buffers stay
        registered: a cancelled transfer NIXL could not release yet still refers to them."""
        for hello in hellos:
            self._agent.forget_remote(hello.agent_name)

    def _free_buffers(self) -> None:
        for index in range(len(self._buffers)):
            self._agent.forget(f"{self._key}-send-{index}")
        self._buffers = []

    def _receive(
        self, ranks: SessionRanks, deadline: float, what: str, anyway: bool = False
    ) -> None:
        receive_one(
            self._socket, ranks.session, ranks.on_message, deadline, what, even_if_abandoned=anyway
        )

    def _listen(self, ranks: SessionRanks) -> bool:
        """Take every rank message already here (never waits); True when any came."""
        came = False
        while self._socket.poll(0):
            identity, data = self._socket.recv_multipart()
            came = True
            try:
                ranks.on_message(identity, decode(data))
            except ProtocolError as exc:
                logger.warning("dropping a malformed message from a receiver: %s", exc)
        return came

    def _send(self, identities: list[bytes], message: Message) -> None:
        frame = message.encode()
        for identity in identities:
            self._socket.send_multipart([identity, frame])

    def _send_to(self, rank: Rank, message: Message) -> None:
        self._socket.send_multipart([rank.identity, message.encode()])

    def close(self) -> None:
        if hasattr(self, "_pool"):
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._free_buffers()
        self._socket.close(linger=0)
        self._context.term()
