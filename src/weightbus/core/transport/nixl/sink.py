"""`nixl`, the leader's side: one-sided NIXL WRITEs of each engine rank's slices into its
parameters, posted by every trainer rank (`sender.py`).

No collective group: each engine rank, when it opens a session, connects to the leader's ZMQ
socket (`tcp://`) and says hello with its NIXL agent's metadata and its parameter layout (the
`DirectTarget` that `shm` direct mode uses). The leader checks each layout and loads each agent
(once per change) before its `UpdateBegin`, then orders every trainer rank to write its part
(`NixlOrder`). Once an engine rank's WRITE of a bucket is complete, a `TensorsWritten` tells it
which tensors are done, with the digests of the bytes now in its regions, which the rank
re-reads to verify: in a group of one as each WRITE completes (the leader's own sender calls
back, `hooks.WriteHooks`), in a group of several once every trainer rank reported. An engine
can join or leave between pushes: nothing else is re-formed.

A session sent by a group of one may carry tensors that are not parameters (a delta push's
payload): a tensor of the plan that a rank's slice map does not name reaches that rank whole,
in its inbox. Such a rank answers the `UpdateBegin` with a `NixlInbox` (where its inbox slots
are, registered with its agent) before its `DirectReady`; the entries travel in the same WRITE
as the bucket's slices, into slot `bucket % slots`, and the `TensorsWritten` carries their
digests. The rank hands them to the Receiver as whole tensors and sends a `SlotAck` once the
Receiver released the batch; a slot is written again only after that ack.
"""

import logging
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import zmq

from weightbus.core.trainer.writes import write_outcome
from weightbus.core.transport.base import BucketSink, Progress, PushSession, no_progress
from weightbus.core.transport.nixl.agent import DEFAULT_UCX_TLS, interface_towards, publisher_agent
from weightbus.core.transport.nixl.floor import plain_writes_seconds
from weightbus.core.transport.nixl.hooks import WriteHooks
from weightbus.core.transport.nixl.messages import NixlDescription, NixlHello, NixlInbox
from weightbus.core.transport.nixl.sender import NixlOrder, NixlReport, NixlTarget
from weightbus.core.transport.parts.direct_channel import receive_one
from weightbus.core.transport.parts.layout import checked_copies
from weightbus.core.transport.parts.rank_session import JoiningRanks
from weightbus.core.transport.sending import Sending
from weightbus.core.wire import (
    DirectReady,
    Message,
    ProtocolError,
    SlotAck,
    TensorsWritten,
    UpdateAbort,
    decode,
)

logger = logging.getLogger(__name__)

_CHECKED_KEPT = 16  # engine layouts known to fit a plan (engines alternate between arenas)


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
        self._agent = publisher_agent(
            ucx_devices=ucx_devices or interface_towards(host), ucx_tls=ucx_tls
        )
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
        self._checked: set[tuple] = set()  # engine layouts checked against a plan
        # bytes written into each (engine, rank) by the last push: each rank's share
        self.rank_bytes: dict[tuple[int, int], int] = {}
        # (agent, memory address, memory bytes) per rank
        self._last_targets: list[tuple[str, int, int]] = []

    def sibling_options(
        self, sink_options: dict[str, Any], setup_options: dict[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        return {**sink_options, "port": 0}, setup_options  # its own socket

    def carries_any_tensors_from(self, ranks: int) -> bool:
        """Tensors that are not parameters go whole into inboxes, whose slots the engine ranks
        release to the leader: only a group of one writes them."""
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
            self._check_targets(session, [hello for _, hello in joined])
            self._send(identities, msgspec.structs.replace(session.begin_message(), direct=True))
            # no byte lands in a rank's parameters before the rank knows they are being written
            while len(ranks.ready) < len(joined):
                self._receive(ranks, deadline, "every rank to confirm the session")
            order = self._order(session, ranks, joined)
            hooks = None
            if sending.single:  # each bucket told as soon as its WRITE completed
                hooks = self._hooks(session, ranks, identities, deadline, progress)
            reports = self.everyone(sending, order, hooks)
            self._account(
                session,
                sending=sending,
                order=order,
                reports=reports,
                identities=identities,
                progress=progress,
            )
        except Exception as exc:
            reason = f"publisher failed: {type(exc).__name__}: {exc}"
            self._send(identities, UpdateAbort(session_id=session.session_id, reason=reason))
            self._forget([hello for _, hello in joined])
            raise
        self._last_targets = [
            (hello.agent_name, hello.memory_address, hello.target.nbytes) for _, hello in joined
        ]
        self._send(identities, session.end_message())

    def _check_targets(self, session: PushSession, hellos: list[NixlHello]) -> None:
        """Before any byte is written: every rank offered memory laid out to fit the plan, and
        its agent can be loaded (each failure names the rank)."""
        metas = {meta.name: meta for meta in session.plan.metas}
        for hello in hellos:
            where = f"engine {hello.group} rank {hello.rank}"
            if hello.target is None:
                raise ValueError(f"{where}: {hello.refusal}")
            key = (hello.target.file, hello.target.layout_hash, session.plan.plan_hash)
            if key not in self._checked:
                try:
                    checked_copies(hello.target, metas, partial=True)
                except ValueError as exc:
                    raise ValueError(f"{where}: {exc}") from None
                if len(self._checked) >= _CHECKED_KEPT:
                    self._checked.clear()
                self._checked.add(key)
            self._load_agent(hello)

    def _order(
        self, session: PushSession, ranks: SessionRanks, joined: list[tuple[bytes, NixlHello]]
    ) -> NixlOrder:
        """Every trainer rank's order: the engine ranks (with their inboxes, sent before
        their `DirectReady`, so here by now; registering one changed the agent's metadata)."""
        targets = []
        for _, hello in joined:
            assert hello.target is not None  # checked
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

    def _hooks(
        self,
        session: PushSession,
        ranks: SessionRanks,
        identities: list[bytes],
        deadline: float,
        progress: Progress,
    ) -> WriteHooks:
        """What the leader's own sender, alone in its group, calls as its WRITEs complete."""

        def written(index: int, bucket: int, digests: dict, slices: dict) -> None:
            message = TensorsWritten(
                session_id=session.session_id,
                bucket_index=bucket,
                digests=digests,
                slice_digests=slices,
            )
            self._socket.send_multipart([identities[index], message.encode()])

        return WriteHooks(
            written=written,
            progress=progress,
            acks=ranks.acks,
            listen=lambda: self._listen(ranks),
            abandoned=lambda: session.abandoned,
            deadline=deadline,
        )

    def _account(
        self,
        session: PushSession,
        *,
        sending: Sending,
        order: NixlOrder,
        reports: list[NixlReport],
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
        if sending.single:
            return
        for bucket in session.plan.buckets:
            names = bucket.finished_names()
            digests = {name: outcome.digests[name] for name in names}
            for identity, slices in zip(identities, outcome.slice_digests, strict=True):
                message = TensorsWritten(
                    session_id=session.session_id,
                    bucket_index=bucket.index,
                    digests=digests,
                    slice_digests={name: slices[name] for name in names if name in slices},
                )
                self._socket.send_multipart([identity, message.encode()])
            progress(bucket.payload_bytes)

    def _load_agent(self, hello: NixlHello) -> None:
        try:
            self._agent.load_remote(hello.agent_name, hello.agent_metadata)
        except (RuntimeError, ValueError) as exc:
            raise type(exc)(f"engine {hello.group} rank {hello.rank}: {exc}") from None

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
            (agent, address, min(nbytes, memory))
            for nbytes, (agent, address, memory) in zip(
                self.rank_bytes.values(), self._last_targets, strict=True
            )
        ]
        return plain_writes_seconds(self._agent, f"{self._key}-floor", shares, timeout_s)

    def _forget(self, hellos: list[NixlHello]) -> None:
        """After a failed session: disconnect its ranks' agents, cancelling what is in flight,
        so nothing of it can land later; the next push reconnects. (Every trainer rank's
        sender disconnects its own agent when its part fails; the send buffers stay
        registered: a cancelled transfer NIXL could not release yet still refers to them.)"""
        for hello in hellos:
            self._agent.forget_remote(hello.agent_name)

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

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
