"""`nixl`, the leader's side: one-sided NIXL WRITEs of each engine rank's slices into its
parameters, posted by every trainer rank (`sender.py`).

No collective group: each engine rank, when it opens a session, connects to the leader's ZMQ
socket (`tcp://`) and says hello with its NIXL agent's metadata and its parameter layout (the
`DirectTarget` that `shm` direct mode uses). The leader checks each layout and loads each agent
(once per change) before its `UpdateBegin`, then orders every trainer rank to write its part
(`NixlOrder`). Once an engine rank's WRITE of a bucket is complete, a `TensorsWritten` tells it
which tensors are done, with the digests of the bytes now in its regions, which the rank
re-reads to verify: in a group of one as each WRITE completes (the leader's own sender calls
back, `writes.WriteHooks`), in a group of several once every trainer rank reported. An engine
can join or leave between pushes: nothing else is re-formed.

A group of one may also send tensors that are not parameters (a delta push's payload): they
are written whole into the ranks' inboxes (`NixlInbox`).
"""

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import torch
import zmq

from weightbus.core.trainer.writes import write_outcome
from weightbus.core.transport.base import BucketSink, Progress, PushSession, no_progress
from weightbus.core.transport.nixl.agent import DEFAULT_UCX_TLS, publisher_agent, release
from weightbus.core.transport.nixl.messages import NixlDescription, NixlHello, NixlInbox
from weightbus.core.transport.nixl.sender import NixlOrder, NixlReport
from weightbus.core.transport.nixl.writes import NixlTarget, WriteHooks
from weightbus.core.transport.parts.direct_channel import (
    receive_one,
    receive_waiting,
    tell_outcome,
    tell_written,
)
from weightbus.core.transport.parts.rank_session import JoiningRanks
from weightbus.core.transport.sending import Sending
from weightbus.core.wire import DirectReady, Message, SlotAck, UpdateAbort


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


class NixlSink(BucketSink):
    """The leader's side of `nixl`.

    Args:
        host: the address engine ranks reach this publisher at (its ZMQ socket binds there).
        port: the socket's port (0: one from the OS).
        inflight_buckets: send buffers of each trainer rank, i.e. buckets packed or in flight
            at once (>= 1).
        ucx_devices: network devices UCX may use here (`UCX_NET_DEVICES`, e.g. "eth1"; by
            default the interface `host` is on, so UCX listens nowhere else; the other trainer
            ranks: the interface that reaches `host`).
        ucx_tls: UCX transports of every trainer rank (`UCX_TLS`): by default all but UCX's
            shared-memory ones (CMA between processes of one host, RDMA or TCP across hosts);
            "tcp" forces TCP.
    """

    name = "nixl"
    carries_any_tensors = True  # parameters into the ranks' memory, other tensors into inboxes
    # each chunk is checked as it is packed, before its WRITE; an abort discards what landed
    refuses_nonfinite_in_stream = True

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
        self._host, self._ucx_devices, self._ucx_tls = host, ucx_devices, ucx_tls
        # the leader's own sender writes with the same agent (`NixlOrder`'s settings)
        self._agent = publisher_agent(host, ucx_devices=ucx_devices, ucx_tls=ucx_tls)
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
        # bytes written into each (engine, rank) by the last push: each rank's share
        self.rank_bytes: dict[tuple[int, int], int] = {}
        self._last_targets: list[NixlTarget] = []  # the engine ranks of the last push

    def sibling_options(
        self, sink_options: dict[str, Any], setup_options: dict[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        return {**sink_options, "port": 0}, setup_options  # its own socket

    def carries_any_tensors_from(self, ranks: int) -> bool:
        # tensors that are not parameters go whole into inboxes, released to the leader
        return ranks == 1

    def prepare(
        self, session: PushSession, sending: Sending, progress: Progress = no_progress
    ) -> NixlDescription:
        return NixlDescription(endpoint=self.endpoint, session_id=session.session_id)

    def for_engine(self, description: NixlDescription, engine_index: int) -> NixlDescription:
        return msgspec.structs.replace(description, group=engine_index)

    def stream(
        self,
        session: PushSession,
        sending: Sending,
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
            # before any byte is written: every rank offered memory, its agent loads, and its
            # memory is laid out to fit the plan (the leader's own sender compiles its writes)
            order = self._order(session, ranks, joined)
            for target in order.targets:
                self._agent.load_remote(target.agent_name, target.agent_metadata, target.describe())
            sending.senders(self.key, self.name).compiled(sending.layout, order)
            self._send(identities, msgspec.structs.replace(session.begin_message(), direct=True))
            # no byte lands in a rank's parameters before the rank knows they are being written
            while len(ranks.ready) < len(joined):
                self._receive(ranks, deadline, "every rank to confirm the session")
            order = self._order(session, ranks, joined)
            hooks = None
            if sending.single:  # each bucket told as soon as its WRITE completed
                hooks = WriteHooks(
                    written=lambda index, bucket, digests, slices: tell_written(
                        self._socket, session, identities[index], bucket, digests, slices=slices
                    ),
                    progress=progress,
                    acks=ranks.acks,
                    listen=lambda: self._listen(ranks),
                    abandoned=lambda: session.abandoned,
                    deadline=deadline,
                )
            reports = self.everyone(sending, order, hooks)
            self._account(
                session, sending, order, reports, identities=identities, progress=progress
            )
        except Exception as exc:
            reason = f"publisher failed: {type(exc).__name__}: {exc}"
            self._send(identities, UpdateAbort(session_id=session.session_id, reason=reason))
            raise
        self._last_targets = order.targets
        self._send(identities, session.end_message())

    def _order(
        self, session: PushSession, ranks: SessionRanks, joined: list[tuple[bytes, NixlHello]]
    ) -> NixlOrder:
        """Every trainer rank's order: the engine ranks (with the inboxes offered so far: all of
        them once every rank sent its `DirectReady`; registering one changed the metadata).

        Raises:
            ValueError: a rank offered no memory (named, with its reason).
        """
        targets = []
        for _, hello in joined:
            if hello.target is None:
                raise ValueError(f"engine {hello.group} rank {hello.rank}: {hello.refusal}")
            inbox = ranks.inboxes.get((hello.group, hello.rank))
            targets.append(
                NixlTarget(
                    group=hello.group,
                    rank=hello.rank,
                    agent_name=hello.agent_name,
                    agent_metadata=hello.agent_metadata if inbox is None else inbox.agent_metadata,
                    memory_address=hello.memory_address,
                    target=hello.target,
                    inbox=None if inbox is None else (inbox.address, inbox.slot_bytes, inbox.slots),
                )
            )
        return NixlOrder(
            targets=targets,
            bucket_bytes=session.plan.bucket_bytes,
            plan_hash=session.plan.plan_hash,
            verify=session.verify,
            inflight_buckets=self.inflight_buckets,
            host=self._host,
            ucx_devices=self._ucx_devices,
            ucx_tls=self._ucx_tls,
        )

    def _account(
        self,
        session: PushSession,
        sending: Sending,
        order: NixlOrder,
        reports: list[NixlReport],
        *,
        identities: list[bytes],
        progress: Progress,
    ) -> None:
        """Record what every trainer rank wrote (digests, bytes); in a group of several, tell
        each engine rank every bucket now.

        Raises:
            ValueError: a trainer rank followed another schedule of cells than the leader.
        """
        compiled = sending.senders(self.key, self.name).compiled(sending.layout, order)
        outcome = write_outcome(sending.layout, compiled.cells, reports, len(order.targets))
        session.digests.update(outcome.digests)
        sending.count_sent(outcome.sent_bytes)
        session.count_sent(sum(outcome.sent_bytes))
        self.rank_bytes = {
            (target.group, target.rank): sum(report.target_bytes[index] for report in reports)
            for index, target in enumerate(order.targets)
        }
        if not sending.single:
            tell_outcome(self._socket, session, identities, outcome, progress)

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
            (t.agent_name, t.memory_address, min(nbytes, t.target.nbytes))
            for nbytes, t in zip(self.rank_bytes.values(), self._last_targets, strict=True)
        ]
        source = torch.ones(max(nbytes for _, _, nbytes in shares), dtype=torch.uint8)
        key, nixl = f"sink-{id(self):x}-floor", self._agent.nixl
        self._agent.register(key, source)
        pending: list[tuple[Any, str]] = []
        try:
            for agent, address, nbytes in shares:
                local = nixl.get_xfer_descs([(source.data_ptr(), nbytes, 0)], "DRAM")
                remote = nixl.get_xfer_descs([(address, nbytes, 0)], "DRAM")
                handle = nixl.initialize_xfer("WRITE", local, remote, agent)
                pending.append((handle, f"the floor's bytes to {agent}"))
            start = time.perf_counter()
            for handle, _ in pending:
                nixl.transfer(handle)
            return self._agent.wait(pending, time.monotonic() + timeout_s) - start
        finally:
            for handle, _ in pending:
                release(handle)
            self._agent.forget(key)

    def _receive(
        self, ranks: SessionRanks, deadline: float, what: str, anyway: bool = False
    ) -> None:
        receive_one(
            self._socket, ranks.session, ranks.on_message, deadline, what, even_if_abandoned=anyway
        )

    def _listen(self, ranks: SessionRanks) -> bool:
        """Take every rank message already here (never waits); True when any came."""
        return receive_waiting(self._socket, ranks.on_message)

    def _send(self, identities: list[bytes], message: Message) -> None:
        frame = message.encode()
        for identity in identities:
            self._socket.send_multipart([identity, frame])

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
