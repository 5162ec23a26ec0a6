"""`nixl`, engine-rank side: offer this rank's registered parameters, then follow the
publisher's notices of what it wrote there. The rank's CPU is not on the data path: the bytes
arrive as one-sided NIXL WRITEs, and the rank only re-reads its own regions to verify them."""

from collections.abc import Iterator

import zmq

from weightbus.plan import Plan, plan_buckets
from weightbus.transport.arena import DirectPlacement
from weightbus.transport.base import BucketSource, ReceivedBatch
from weightbus.transport.direct_channel import receive_expected, written_batches
from weightbus.transport.nixl.agent import rank_agent
from weightbus.transport.nixl.messages import NixlDescription, NixlHello
from weightbus.wire import DirectReady, Message, ProtocolError, UpdateBegin, UpdateEnd

NO_MEMORY = (
    "transport nixl writes into the parameters' shared-memory arena, and this rank has none "
    "(engine started with --no-shm-weights, or /dev/shm could not hold them)"
)


class NixlSource(BucketSource):
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
        self.session_id, self.group = description.session_id, description.group
        self.rank, self.tp_size = rank, tp_size
        self._placement = direct
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        try:
            self._socket.connect(description.endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            raise ValueError(f"nixl endpoint {description.endpoint!r}: {exc}") from None
        self._publisher_host = description.endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
        self._plan: Plan | None = None

    def _hello(self) -> NixlHello:
        agent = rank_agent(self.rank, self._publisher_host)
        placement = self._placement
        fields = {
            "session_id": self.session_id,
            "group": self.group,
            "rank": self.rank,
            "tp_size": self.tp_size,
            "agent_name": agent.name,
        }
        if placement is None or placement.memory is None:
            return NixlHello(**fields, agent_metadata=agent.metadata(), refusal=NO_MEMORY)
        agent.register(placement.target.file, placement.memory)
        return NixlHello(
            **fields,
            agent_metadata=agent.metadata(),
            memory_address=placement.memory.data_ptr(),
            target=placement.target,
        )

    def _recv(self, expected: type[Message], timeout_s: float) -> Message:
        return receive_expected(self._socket, self.session_id, expected, timeout_s)

    def begin(self, timeout_s: float) -> UpdateBegin:
        hello = self._hello()
        self._socket.send(hello.encode())
        if hello.target is None:
            raise ValueError(NO_MEMORY)
        header = self._recv(UpdateBegin, timeout_s)
        if not header.direct:
            raise ProtocolError("a nixl session must write into the ranks' parameters")
        # sent before begin() returns: the Receiver marks the target touched right after
        ready = DirectReady(session_id=self.session_id, group=self.group, rank=self.rank)
        self._socket.send(ready.encode())
        self._plan = plan_buckets([meta.to_meta() for meta in header.tensors], header.bucket_bytes)
        return header

    def batches(self, timeout_s: float) -> Iterator[ReceivedBatch]:
        assert self._plan is not None, "begin() first"
        assert self._placement is not None
        yield from written_batches(self._recv, self._plan, self._placement.regions, timeout_s)

    def end(self, timeout_s: float) -> UpdateEnd:
        return self._recv(UpdateEnd, timeout_s)

    def close(self) -> None:
        self._placement = None  # its arena is freed once released, even if this outlives it
        self._socket.close(linger=1000)
