"""The ZMQ control channel of a direct-write session (`shm` direct mode and `nixl`): the
publisher's ROUTER socket and each rank's DEALER. Only small typed messages travel on it; the
bytes are written into the ranks' parameters by other means."""

import logging
import time
from collections.abc import Callable, Iterator

import torch
import zmq

from weightbus.core.plan import Plan
from weightbus.core.transport.base import PushSession, ReceivedBatch
from weightbus.core.transport.parts.deadlines import remaining_ms
from weightbus.core.wire import Message, ProtocolError, TensorsWritten, UpdateAbort, decode

logger = logging.getLogger(__name__)

# How often a publisher waiting on the ranks checks whether the push was abandoned.
ABANDON_CHECK_MS = 100


def receive_one(
    socket: zmq.Socket,
    session: PushSession,
    on_message: Callable[[bytes, Message], None],
    deadline: float,
    what: str,
    *,
    even_if_abandoned: bool = False,
) -> None:
    """Publisher side: hand at most one rank message to `on_message(identity, message)`
    (`even_if_abandoned`: also once an engine answered, to reach the ranks still joining).

    Raises:
        ValueError: the push was abandoned (an engine answered before the stream ended).
        TimeoutError: `deadline` passed (the message says what was awaited).
    """
    if session.abandoned is not None and not even_if_abandoned:
        raise ValueError(f"stopped waiting for {what}: {session.abandoned}")
    if not socket.poll(min(remaining_ms(deadline, what), ABANDON_CHECK_MS)):
        return
    identity, data = socket.recv_multipart()
    try:
        on_message(identity, decode(data))
    except ProtocolError as exc:
        logger.warning("dropping a malformed message from a receiver: %s", exc)


def receive_expected(
    socket: zmq.Socket, session_id: str, expected: type[Message], timeout_s: float
) -> Message:
    """Rank side: the session's next message, which must be an `expected`.

    Raises:
        ValueError: the publisher aborted the session (its reason).
        ProtocolError: another message came.
        TimeoutError: nothing came within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if not socket.poll(remaining_ms(deadline, f"a {expected.__name__}")):
            continue
        message = decode(socket.recv())
        if getattr(message, "session_id", None) != session_id:
            continue  # a message of an earlier session
        if isinstance(message, UpdateAbort):
            raise ValueError(f"the publisher aborted the session: {message.reason}")  # noqa: TRY004 - a peer stopped, not a wrong type
        if not isinstance(message, expected):
            # a peer breaking the protocol, not a caller passing a wrong type
            raise ProtocolError(f"expected {expected.__name__}, got {type(message).__name__}")
        return message


def written_batches(
    receive: Callable[[type[Message], float], Message],
    plan: Plan,
    regions: dict[str, torch.Tensor],
    timeout_s: float,
) -> Iterator[ReceivedBatch]:
    """Rank side: the publisher's notices of what it wrote into this rank's `regions`, one
    batch per plan bucket, with the digests the rank verifies them against.

    A batch's `nbytes` are the bytes of this rank's slices of the tensors it completes (a
    tensor split across buckets counts once, in the bucket of its last byte)."""
    deadline = time.monotonic() + timeout_s
    for bucket in plan.buckets:
        written = receive(TensorsWritten, deadline - time.monotonic())
        names = bucket.finished_names()
        if written.bucket_index != bucket.index or set(written.digests) != set(names):
            raise ValueError(f"written tensors of bucket {bucket.index} do not match the plan")
        placed = [(name, regions.get(name)) for name in names]
        yield ReceivedBatch(
            tensors=[],
            digests=dict(written.digests),
            nbytes=sum(region.nbytes for _, region in placed if region is not None),
            placed=placed,
            placed_digests=dict(written.slice_digests),
        )
