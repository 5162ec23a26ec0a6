"""Both ends of a session whose ranks talk to the publisher over ZMQ (`shm` and `nixl`): the
rank's source (its sockets, acks, `end`, `close`) and the publisher's count of the ranks that
joined. Written once here so the two transports cannot drift apart in what a session is."""

import contextlib
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Protocol

import zmq

from weightbus.core.transport.base import BucketSource, PushSession
from weightbus.core.transport.parts.arena import DirectPlacement
from weightbus.core.transport.parts.direct_channel import receive_expected
from weightbus.core.wire import Message, SlotAck, UpdateEnd

# How long closing a rank's socket may wait to deliver what it still holds (acks, hellos).
CLOSE_LINGER_MS = 1000


class SessionEndpoint(Protocol):
    """What a rank needs of its transport's description to join the session."""

    session_id: str
    group: int
    endpoint: str


class RankSessionSource(BucketSource):
    """A rank's source on the publisher's ZMQ endpoint: `shm` and `nixl` build on it.

    Messages are read by the Receiver's prefetch thread and acks are sent by the thread that
    loads: ZMQ sockets are single-threaded, so each direction has its own socket (the ack
    socket opens at the first ack).

    Raises:
        ValueError: `endpoint` cannot be connected (`f"{refusal}: {error}"`).
    """

    def __init__(
        self,
        description: SessionEndpoint,
        *,
        rank: int,
        tp_size: int,
        direct: DirectPlacement | None,
        refusal: str,
    ) -> None:
        self.session_id, self.group = description.session_id, description.group
        self.rank, self.tp_size = rank, tp_size
        self._placement = direct
        self._endpoint = endpoint = description.endpoint
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        try:
            self._socket.connect(endpoint)
        except zmq.ZMQError as exc:  # e.g. a path too long for a unix socket
            self._socket.close(linger=0)
            raise ValueError(f"{refusal}: {exc}") from None
        self._ack_socket: zmq.Socket | None = None

    def _recv(self, expected: type[Message], timeout_s: float) -> Message:
        return receive_expected(self._socket, self.session_id, expected, timeout_s)

    def _acker(self, bucket_index: int, slot: int) -> Callable[[], None]:
        """The release of a batch: tell the publisher the rank is done with `slot`."""
        ack = SlotAck(
            session_id=self.session_id,
            bucket_index=bucket_index,
            slot=slot,
            rank=self.rank,
            group=self.group,
        ).encode()
        return lambda: self._send_ack(ack)

    def _send_ack(self, frame: bytes) -> None:
        if self._ack_socket is None:
            self._ack_socket = zmq.Context.instance().socket(zmq.DEALER)
            self._ack_socket.connect(self._endpoint)
        self._ack_socket.send(frame)

    def end(self, timeout_s: float) -> UpdateEnd:
        return self._recv(UpdateEnd, timeout_s)

    def close(self) -> None:
        self._placement = None  # its arena is freed once released, even if this outlives it
        self._socket.close(linger=CLOSE_LINGER_MS)
        if self._ack_socket is not None:
            self._ack_socket.close(linger=CLOSE_LINGER_MS)


class JoiningRanks:
    """Publisher side: the ranks that joined the current session. Each transport records its
    own hellos; the count of who joined, against each engine's TP size, is shared."""

    def __init__(self, session: PushSession) -> None:
        self.session = session
        self.tp_sizes: dict[int, int] = {}  # engine (group) -> its TP size, from its hellos

    def joined_groups(self) -> Iterable[int]:
        """The group of every rank that said hello (one item per rank)."""
        raise NotImplementedError

    def complete(self) -> bool:
        """Whether every engine of the session joined with all of its ranks."""
        counts = Counter(self.joined_groups())
        return len(self.tp_sizes) == self.session.receivers and all(
            self._all_ranks_joined(group, counts) for group in self.tp_sizes
        )

    def _all_ranks_joined(self, group: int, counts: Counter) -> bool:
        size = self.tp_sizes.get(group)
        return size is not None and counts[group] == size

    def engine_name(self, group: int) -> str:
        """The engine of `group` by URL when the publisher named them, else by its index."""
        engines = self.session.engines
        return engines[group] if group < len(engines) else f"engine {group}"

    def missing(self) -> str:
        """The engines that have not joined with every rank, by URL, and how many did (each
        counted as at fault in the session)."""
        counts = Counter(self.joined_groups())
        absent = []
        for group in range(self.session.receivers):
            size = self.tp_sizes.get(group)
            if size is not None and counts[group] == size:
                continue
            joined = "no rank" if size is None else f"{counts[group]} of {size} ranks"
            absent.append(f"{self.engine_name(group)} ({joined} joined)")
            if group < len(self.session.engines):
                self.session.at_fault.add(self.session.engines[group])
        return ", ".join(absent)

    def wait_until_complete(self, receive: Callable[[str, bool], None]) -> None:
        """`receive(what, even_if_abandoned)` until every rank joined (then marks the session
        joined).

        An engine that answered meanwhile (a refusal) joins no more: the stream is abandoned,
        but first the ranks of the other engines are let in (until the deadline), so that the
        caller's abort reaches them at once instead of at their own timeout.

        Raises:
            TimeoutError: naming the engines (URLs) that did not join with every rank.
            ValueError: an engine answered before the stream ended (its reason).
        """
        try:
            while not self.complete():
                receive("every engine rank to join", False)
            self.session.mark_joined()
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; not joined: {self.missing()}") from None
        except ValueError:
            with contextlib.suppress(TimeoutError):
                while not self._others_joined():
                    receive("the other engines' ranks to join", True)
            raise

    def _others_joined(self) -> bool:
        """Every engine that did not answer joined with all its ranks (unknown URLs: no wait)."""
        counts = Counter(self.joined_groups())
        return all(
            self._all_ranks_joined(group, counts)
            for group, url in enumerate(self.session.engines)
            if url not in self.session.answered
        )
