"""The ZMQ control channel of a direct-write session (`shm` direct mode and `nixl`): the
publisher's ROUTER socket and each rank's DEALER. Only small typed messages travel on it; the
bytes are written into the ranks' parameters by other means."""

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

import torch
import zmq

from weightbus.core.plan import BucketPlan, Plan
from weightbus.core.trainer.writes import WriteOutcome
from weightbus.core.transport.base import Progress, PushSession, ReceivedBatch
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
    if socket.poll(min(remaining_ms(deadline, what), ABANDON_CHECK_MS)):
        _deliver(socket, on_message)


def receive_waiting(socket: zmq.Socket, on_message: Callable[[bytes, Message], None]) -> bool:
    """Publisher side: hand every rank message already here to `on_message` (never waits);
    True when any came."""
    came = False
    while socket.poll(0):
        _deliver(socket, on_message)
        came = True
    return came


def _deliver(socket: zmq.Socket, on_message: Callable[[bytes, Message], None]) -> None:
    identity, data = socket.recv_multipart()
    try:
        on_message(identity, decode(data))
    except ProtocolError as exc:
        logger.warning("dropping a malformed message from a receiver: %s", exc)


def tell_written(
    socket: zmq.Socket,
    session: PushSession,
    identity: bytes,
    bucket_index: int,
    digests: dict[str, str],
    *,
    slices: dict[str, str],
) -> None:
    """Publisher side: tell a rank that bucket `bucket_index` is written into its regions, with
    the digests of the tensors the bucket finishes (`digests`) and of its slices of them."""
    message = TensorsWritten(
        session_id=session.session_id,
        bucket_index=bucket_index,
        digests=digests,
        slice_digests=slices,
    )
    socket.send_multipart([identity, message.encode()])


def tell_outcome(
    socket: zmq.Socket,
    session: PushSession,
    identities: list[bytes],
    outcome: WriteOutcome,
    progress: Progress,
) -> None:
    """Publisher side, once every trainer rank reported its writes: tell every rank (in
    session order) of every bucket, with the digests the reports combined to."""
    for bucket in session.plan.buckets:
        names = bucket.finished_names()
        digests = {name: outcome.digests[name] for name in names}
        for identity, found in zip(identities, outcome.slice_digests, strict=True):
            slices = {name: found[name] for name in names if name in found}
            tell_written(socket, session, identity, bucket.index, digests, slices=slices)
        progress(bucket.payload_bytes)


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
    inbox: Callable[[BucketPlan], ReceivedBatch | None] = lambda bucket: None,
) -> Iterator[ReceivedBatch]:
    """Rank side: the publisher's notices of what it wrote into this rank's `regions`, one
    batch per plan bucket, with the digests the rank verifies them against; `inbox(bucket)`:
    the bucket's tensors written whole elsewhere (`nixl`'s inbox), with their bytes and the
    release of their memory, or None.

    A batch's `nbytes` are the bytes of this rank's slices of the tensors it completes (a
    tensor split across buckets counts once, in the bucket of its last byte), and the inbox's."""
    deadline = time.monotonic() + timeout_s
    for bucket in plan.buckets:
        written = receive(TensorsWritten, deadline - time.monotonic())
        names = bucket.finished_names()
        if written.bucket_index != bucket.index or set(written.digests) != set(names):
            raise ValueError(f"written tensors of bucket {bucket.index} do not match the plan")
        whole = inbox(bucket) or ReceivedBatch(tensors=[], digests={}, nbytes=0)
        received = {name for name, _ in whole.tensors}
        placed = [(name, regions.get(name)) for name in names if name not in received]
        yield dataclasses.replace(
            whole,
            digests=dict(written.digests),
            nbytes=whole.nbytes + sum(region.nbytes for _, region in placed if region is not None),
            placed=placed,
            placed_digests=dict(written.slice_digests),
        )
