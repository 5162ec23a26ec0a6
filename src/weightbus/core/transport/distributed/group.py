"""Weights groups of the `dist` transport: torch.distributed gloo groups by name, per process.

A group rendezvous on its own TCPStore, served by the leader, and is a standalone
`ProcessGroupGloo` (the default process group, the engine's TP group, is never touched). Every
operation is bounded: forming by `timeout_s`, each operation by the push's deadline. A push that
fails midway leaves the group `broken` (its members may be at different steps of the stream);
it then refuses pushes until formed again.
"""

import logging
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from weightbus.core.transport.parts.deadlines import remaining_s
from weightbus.core.wire import MAX_MESSAGE_BYTES, Message, ProtocolError, decode
from weightbus.core.wire.messages import RankLayout

logger = logging.getLogger(__name__)

# Tags of point-to-point messages: rank layouts as the group forms, bucket data (parts mode),
# the leader's word in a push's hand-shake.
_LAYOUT_TAG = 1
DATA_TAG = 2
HANDSHAKE_TAG = 3
# A word (a short message: the hand-shake's) travels as one operation of this fixed size.
WORD_BYTES = 8192
_WORD_LENGTH_BYTES = 4


class GroupBrokenError(ConnectionError):
    """A collective of a weights group failed; the group must be formed again."""


@dataclass(slots=True, eq=False)
class WeightsGroup:
    """One member's handle on a weights group.

    Attributes:
        layouts: engine ranks' slice maps by group rank: all on the leader, its own on a rank.
        buffers: transport buffers kept across pushes (allocated once per size).
        assembly_buffers: tensors larger than a bucket are reassembled into these (reused).
        broken: why the group can no longer be used, or None.
        handshakes: leader: sessions whose hand-shake keys are still in the store, oldest first.
        senders: the group ranks that send (the trainer ranks); the rest receive.
    """

    name: str
    group_rank: int
    world_size: int
    timeout_s: float
    pg: ProcessGroupGloo
    store: TCPStore
    layouts: dict[int, RankLayout] = field(default_factory=dict)
    buffers: dict[tuple, torch.Tensor] = field(default_factory=dict)
    assembly_buffers: dict[tuple, torch.Tensor] = field(default_factory=dict)
    broken: str | None = None
    handshakes: deque[str] = field(default_factory=deque)
    senders: int = 1

    @property
    def receiving_ranks(self) -> range:
        """The engine ranks' group ranks."""
        return range(self.senders, self.world_size)

    def check_usable(self) -> None:
        """Raise ValueError naming the fix when the group cannot carry a push."""
        if self.broken is not None:
            raise ValueError(
                f"weights group {self.name!r} is broken ({self.broken}): re-initialise it "
                "(Publisher.init_weights_group, POST /v1/init_weights_group)"
            )

    def buffer(self, key: tuple, nbytes: int) -> torch.Tensor:
        """A `uint8` buffer of at least `nbytes` kept under `key` (reused across pushes)."""
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self.buffers[key] = torch.empty(nbytes, dtype=torch.uint8)
        return buffer[:nbytes]


_groups: dict[str, WeightsGroup] = {}
_groups_lock = threading.Lock()


def find_group(name: str) -> WeightsGroup | None:
    """The live group `name` of this process, or None."""
    with _groups_lock:
        return _groups.get(name)


def get_group(name: str) -> WeightsGroup:
    """The live group `name` of this process.

    Raises:
        ValueError: no such group (it was never initialised here, or was destroyed).
    """
    group = find_group(name)
    if group is None:
        raise ValueError(
            f"no weights group {name!r} in this process: initialise it first "
            "(Publisher.init_weights_group, POST /v1/init_weights_group)"
        )
    return group


def group_names() -> list[str]:
    """Names of the live groups of this process."""
    with _groups_lock:
        return sorted(_groups)


def destroy_group(name: str) -> bool:
    """Leave group `name` and free it; False when there was none."""
    with _groups_lock:
        group = _groups.pop(name, None)
    if group is None:
        return False
    abort(group, "destroyed")
    logger.info("left weights group %r", name)
    return True


def abort(group: WeightsGroup, why: str) -> None:
    """End this member's part in the group now: every peer's pending operation fails at once
    (the group must be formed again)."""
    group.broken = group.broken or why
    group.pg.abort()


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def join_group(
    *,
    name: str,
    master_addr: str,
    master_port: int,
    group_rank: int,
    world_size: int,
    timeout_s: float,
    layout: RankLayout | None = None,
    senders: int = 1,
    store: TCPStore | None = None,
) -> WeightsGroup:
    """Join group `name` as `group_rank` (replacing a group of that name in this process): the
    leader (rank 0) serves `store` on `master_addr` and collects every engine rank's `layout`
    (the group ranks from `senders` on); another trainer rank joins with none.

    Raises:
        TimeoutError: the store or a member did not answer within `timeout_s`.
        ConnectionError: the store refused, or the group could not form.
    """
    destroy_group(name)  # forming again: the old group (maybe broken) goes first
    deadline = time.monotonic() + timeout_s
    timeout = timedelta(seconds=timeout_s)
    hostname = master_addr
    if store is None:
        try:
            store = TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
        except RuntimeError as exc:
            error = TimeoutError if _is_timeout(exc) else ConnectionError
            raise error(
                f"weights group {name!r}: no store at {master_addr}:{master_port} ({exc})"
            ) from None
        # this host's address on the route to the store (what gloo must bind to reach it)
        family, _, _, _, address = socket.getaddrinfo(
            master_addr, master_port, type=socket.SOCK_DGRAM
        )[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)  # UDP: picks the route, sends nothing
            hostname = probe.getsockname()[0]
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=hostname)]
    try:
        pg = ProcessGroupGloo(
            PrefixStore(f"weightbus/{name}", store), group_rank, world_size, options
        )
    except RuntimeError as exc:
        if _is_timeout(exc):
            raise TimeoutError(
                f"weights group {name!r}: not every one of {world_size} members joined within "
                f"{timeout_s:g} s ({exc})"
            ) from None
        raise ConnectionError(f"weights group {name!r}: cannot form ({exc})") from None
    group = WeightsGroup(name, group_rank, world_size, timeout_s, pg, store, senders=senders)
    try:
        _exchange_layouts(group, layout, deadline)
    except BaseException:
        abort(group, "destroyed")
        raise
    with _groups_lock:
        _groups[name] = group
    logger.info("joined weights group %r as rank %d of %d", name, group_rank, world_size)
    return group


def _exchange_layouts(group: WeightsGroup, layout: RankLayout | None, deadline: float) -> None:
    """The leader collects every engine rank's layout; an engine rank reports its own."""
    if group.group_rank == 0:
        for src in group.receiving_ranks:
            what = f"the layout of group rank {src}"
            reported = _receive_frame(group, deadline, what, src=src, tag=_LAYOUT_TAG)
            if not isinstance(reported, RankLayout) or reported.group_rank != src:
                raise ConnectionError(f"group rank {src} sent no valid RankLayout")
            group.layouts[src] = reported
    elif layout is not None:
        group.layouts[group.group_rank] = layout
        for tensor in _frame_tensors(layout):
            work = group.pg.send([tensor], 0, _LAYOUT_TAG)
            wait(group, work, deadline, "sending this rank's RankLayout")


# --- bounded operations ---


def wait(group: WeightsGroup, work, deadline: float, what: str) -> None:
    """Wait for one operation until `deadline`; a failure breaks the group.

    Raises:
        TimeoutError: not done in time (a peer is dead, slow or unreachable).
        GroupBrokenError: the operation failed (a peer closed its connection).
    """
    try:
        work.wait(op_timeout(deadline, what))
    except (TimeoutError, RuntimeError) as exc:
        if isinstance(exc, TimeoutError) or _is_timeout(exc):
            group.broken = f"timed out waiting for {what}"
            raise TimeoutError(
                f"weights group {group.name!r}: {what} did not complete in time ({exc})"
            ) from None
        group.broken = f"{what} failed: {exc}"
        raise GroupBrokenError(f"weights group {group.name!r}: {what} failed ({exc})") from None


def op_timeout(deadline: float, what: str) -> timedelta:
    """The time left until `deadline` (TimeoutError when none), as gloo takes it."""
    return timedelta(seconds=remaining_s(deadline, what))


def _frame_tensors(message: Message) -> tuple[torch.Tensor, torch.Tensor]:
    frame = message.encode()
    length = torch.tensor([len(frame)], dtype=torch.int64)
    return length, torch.frombuffer(bytearray(frame), dtype=torch.uint8)


def _decode_frame(data: torch.Tensor) -> Message:
    try:
        return decode(data.numpy().tobytes())
    except ProtocolError as exc:
        raise ProtocolError(f"malformed message on the weights group: {exc}") from None


def _receive_frame(
    group: WeightsGroup, deadline: float, what: str, src: int | None = None, tag: int = 0
) -> Message:
    """The next message, as its length then its bytes: broadcast by the leader (`src` None),
    or sent by group rank `src` with `tag`."""

    def receive(tensor: torch.Tensor):
        if src is None:
            return group.pg.broadcast(tensor, 0, op_timeout(deadline, what))
        return group.pg.recv([tensor], src, tag)

    length = torch.zeros(1, dtype=torch.int64)
    wait(group, receive(length), deadline, what)
    nbytes = int(length[0])
    if not 0 < nbytes <= MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message length {nbytes} out of range on the weights group")
    data = torch.empty(nbytes, dtype=torch.uint8)
    wait(group, receive(data), deadline, what)
    return _decode_frame(data)


def broadcast_message(group: WeightsGroup, message: Message, deadline: float) -> list:
    """Root: broadcast a message (its length, then its bytes); returns the pending operations
    (with their tensors, which must live until they complete)."""
    what = f"broadcast of {type(message).__name__}"
    return [
        (group.pg.broadcast(tensor, 0, op_timeout(deadline, what)), tensor)
        for tensor in _frame_tensors(message)
    ]


def expect_message(
    group: WeightsGroup, kind: type[Message], session_id: str, deadline: float
) -> Message:
    """Non-root: the next broadcast message, which must be a `kind` of session `session_id`.

    Raises:
        ProtocolError: it is another message, or another session's.
    """
    message = _receive_frame(group, deadline, f"a {kind.__name__}")
    if not isinstance(message, kind) or getattr(message, "session_id", None) != session_id:
        raise ProtocolError(
            f"expected a {kind.__name__} of session {session_id}, got a "
            f"{type(message).__name__} of session {getattr(message, 'session_id', None)}"
        )
    return message


def send_word(
    group: WeightsGroup, message: Message, ranks: Sequence[int], deadline: float, tag: int
) -> None:
    """Send a short message to each of group `ranks` as one fixed-size operation (to all at
    once; one round trip fewer than a message's length and bytes) and wait until every one took it.

    Raises:
        ValueError: the message does not fit in `WORD_BYTES`.
    """
    frame = message.encode()
    if len(frame) > WORD_BYTES - _WORD_LENGTH_BYTES:
        raise ValueError(f"a {type(message).__name__} of {len(frame)} bytes exceeds a word")
    word = bytearray(WORD_BYTES)
    struct.pack_into("<I", word, 0, len(frame))
    word[_WORD_LENGTH_BYTES : _WORD_LENGTH_BYTES + len(frame)] = frame
    data = torch.frombuffer(word, dtype=torch.uint8)
    what = f"sending {type(message).__name__} to group ranks {list(ranks)}"
    for work in [group.pg.send([data], dst, tag) for dst in ranks]:
        wait(group, work, deadline, what)


def recv_word(group: WeightsGroup, src: int, deadline: float, tag: int) -> Message:
    """The next word (`send_word`) from group rank `src`."""
    word = torch.empty(WORD_BYTES, dtype=torch.uint8)
    wait(group, group.pg.recv([word], src, tag), deadline, f"a word from group rank {src}")
    (nbytes,) = struct.unpack_from("<I", word.numpy())
    if not 0 < nbytes <= WORD_BYTES - _WORD_LENGTH_BYTES:
        raise ProtocolError(f"word length {nbytes} out of range on the weights group")
    return _decode_frame(word[_WORD_LENGTH_BYTES : _WORD_LENGTH_BYTES + nbytes])
