"""Weights groups of the `dist` transport: torch.distributed gloo groups by name, per process.

A weights group spans the trainer ranks (group ranks `0 .. senders - 1`: one process holding
every tensor is group rank 0 alone) and every rank of every engine (rank r of an engine is group
rank `rank_offset + r`). It rendezvous on its own TCPStore, served by the
publisher, and is a standalone `ProcessGroupGloo`: the default process group, which carries the
engine's TP group, is never touched. A group is created once (`/v1/init_weights_group`) and
reused by every push until it is destroyed or re-initialised.

Every collective is bounded: creation by `timeout_s`, each operation by the push's deadline.
A push that fails midway leaves the group `broken` (its members may be at different steps of
the stream); it then refuses pushes until it is re-initialised. A push cancelled in its
hand-shake (`handshake.py`), before anything of it moved, leaves the group usable.
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

from weightbus.core.store import serve_store
from weightbus.core.transport.parts.deadlines import remaining_s
from weightbus.core.wire import MAX_MESSAGE_BYTES, Message, ProtocolError, decode
from weightbus.core.wire.messages import RankLayout

logger = logging.getLogger(__name__)

# Tags of point-to-point messages: rank layouts at group creation, bucket data (parts mode),
# the publisher's word in a push's hand-shake.
_LAYOUT_TAG = 1
DATA_TAG = 2
HANDSHAKE_TAG = 3
# A word (a short message: the hand-shake's) travels as one operation of this fixed size.
WORD_BYTES = 8192
_WORD_LENGTH_BYTES = 4


class GroupBrokenError(ConnectionError):
    """A collective of a weights group failed; the group must be re-initialised."""


@dataclass(slots=True, eq=False)
class WeightsGroup:
    """One member's handle on a weights group.

    Attributes:
        layouts: slice maps of engine ranks by group rank: all of them on the publisher, its
            own on an engine rank.
        buffers: transport buffers kept across pushes (allocated once per size).
        assembly_buffers: tensors larger than a bucket are reassembled into these (reused).
        broken: why the group can no longer be used, or None.
        handshakes: publisher: sessions whose hand-shake keys are still in the store, oldest
            first.
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


def get_group(name: str) -> WeightsGroup:
    """The live group `name` of this process.

    Raises:
        ValueError: no such group (it was never initialised here, or was destroyed).
    """
    with _groups_lock:
        group = _groups.get(name)
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
    _close(group)
    logger.info("left weights group %r", name)
    return True


def _close(group: WeightsGroup) -> None:
    # abort ends pending operations at once (a dead peer must not hold the engine's loop)
    abort(group, "destroyed")


def abort(group: WeightsGroup, why: str) -> None:
    """End this member's part in the group now: every peer's pending operation fails at once
    (the group must be formed again)."""
    group.broken = group.broken or why
    group.pg.abort()


def _register(group: WeightsGroup) -> None:
    with _groups_lock:
        previous = _groups.pop(group.name, None)
        _groups[group.name] = group
    if previous is not None:
        _close(previous)


def local_address_towards(host: str, port: int) -> str:
    """This host's address on the route to `host` (what gloo must bind to reach it)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _new_process_group(
    store: TCPStore, name: str, *, group_rank: int, world_size: int, hostname: str, timeout_s: float
) -> ProcessGroupGloo:
    options = ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    options._devices = [ProcessGroupGloo.create_device(hostname=hostname)]
    try:
        return ProcessGroupGloo(
            PrefixStore(f"weightbus/{name}", store), group_rank, world_size, options
        )
    except RuntimeError as exc:
        if _is_timeout(exc):
            raise TimeoutError(
                f"weights group {name!r}: not every one of {world_size} members joined within "
                f"{timeout_s:g} s ({exc})"
            ) from None
        raise ConnectionError(f"weights group {name!r}: cannot form ({exc})") from None


def serve_group(
    *, name: str, master_addr: str, master_port: int, world_size: int, timeout_s: float
) -> TCPStore:
    """Publisher: start the group's rendezvous store (`master_port` 0: the OS picks one).

    A loopback `master_addr` keeps the store on loopback (`weightbus.core.store.serve_store`).

    Returns:
        The store; `store.port` is the port engines must be given.
    """
    return serve_store(master_addr, master_port, world_size=world_size, timeout_s=timeout_s)


def create_publisher_group(
    *,
    name: str,
    store: TCPStore,
    master_addr: str,
    world_size: int,
    timeout_s: float,
    senders: int = 1,
) -> WeightsGroup:
    """Publisher: join as group rank 0 and collect every engine rank's `RankLayout` (the
    group ranks from `senders` on).

    Raises:
        TimeoutError: not every member joined (or reported its layout) within `timeout_s`.
        ConnectionError: the group could not form.
    """
    deadline = time.monotonic() + timeout_s
    pg = _new_process_group(
        store,
        name,
        group_rank=0,
        world_size=world_size,
        hostname=master_addr,
        timeout_s=timeout_s,
    )
    group = WeightsGroup(
        name=name,
        group_rank=0,
        world_size=world_size,
        timeout_s=timeout_s,
        pg=pg,
        store=store,
        senders=senders,
    )
    try:
        for group_rank in group.receiving_ranks:
            group.layouts[group_rank] = _recv_layout(group, group_rank, deadline)
    except BaseException:
        _close(group)
        raise
    _register(group)
    logger.info("weights group %r formed: %d members", name, world_size)
    return group


def _recv_layout(group: WeightsGroup, group_rank: int, deadline: float) -> RankLayout:
    layout = recv_message(group, group_rank, deadline, _LAYOUT_TAG)
    if not isinstance(layout, RankLayout) or layout.group_rank != group_rank:
        raise ConnectionError(f"group rank {group_rank} sent no valid RankLayout")
    return layout


def join_group(
    *,
    name: str,
    master_addr: str,
    master_port: int,
    group_rank: int,
    world_size: int,
    timeout_s: float,
    layout: RankLayout | None,
    senders: int = 1,
) -> WeightsGroup:
    """Engine rank: join group `name` (replacing a group of that name) and report `layout`;
    a trainer rank other than the leader joins with no layout (it sends, and receives only
    the session's messages).

    Raises:
        TimeoutError: the store or a member did not answer within `timeout_s`.
        ConnectionError: the store refused, or the group could not form.
    """
    destroy_group(name)  # re-initialisation: the old group (maybe broken) goes first
    deadline = time.monotonic() + timeout_s
    try:
        store = TCPStore(
            master_addr,
            master_port,
            world_size,
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
    except RuntimeError as exc:
        error = TimeoutError if _is_timeout(exc) else ConnectionError
        raise error(
            f"weights group {name!r}: no store at {master_addr}:{master_port} ({exc})"
        ) from None
    hostname = local_address_towards(master_addr, master_port)
    pg = _new_process_group(
        store,
        name,
        group_rank=group_rank,
        world_size=world_size,
        hostname=hostname,
        timeout_s=timeout_s,
    )
    group = WeightsGroup(
        name=name,
        group_rank=group_rank,
        world_size=world_size,
        timeout_s=timeout_s,
        pg=pg,
        store=store,
        layouts={} if layout is None else {group_rank: layout},
        senders=senders,
    )
    try:
        if layout is not None:
            send_message(group, layout, 0, deadline, _LAYOUT_TAG)
    except BaseException:
        _close(group)
        raise
    _register(group)
    logger.info("joined weights group %r as rank %d of %d", name, group_rank, world_size)
    return group


# --- bounded operations ---


def wait(group: WeightsGroup, work, deadline: float, what: str) -> None:
    """Wait for one operation until `deadline`; a failure breaks the group.

    Raises:
        TimeoutError: not done in time (a peer is dead, slow or unreachable).
        GroupBrokenError: the operation failed (a peer closed its connection).
    """
    try:
        work.wait(timedelta(seconds=remaining_s(deadline, what)))
    except TimeoutError as exc:
        group.broken = f"timed out waiting for {what}"
        raise TimeoutError(f"weights group {group.name!r}: {what}: {exc}") from None
    except RuntimeError as exc:
        if _is_timeout(exc):
            group.broken = f"timed out waiting for {what}"
            raise TimeoutError(
                f"weights group {group.name!r}: {what} did not complete in time ({exc})"
            ) from None
        group.broken = f"{what} failed: {exc}"
        raise GroupBrokenError(f"weights group {group.name!r}: {what} failed ({exc})") from None


def op_timeout(deadline: float, what: str) -> timedelta:
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


def _checked_length(length: torch.Tensor) -> int:
    nbytes = int(length[0])
    if not 0 < nbytes <= MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message length {nbytes} out of range on the weights group")
    return nbytes


def broadcast_message(group: WeightsGroup, message: Message, deadline: float) -> list:
    """Root: broadcast a message (its length, then its bytes); returns the pending operations
    (with their tensors, which must live until they complete)."""
    length, data = _frame_tensors(message)
    what = f"broadcast of {type(message).__name__}"
    return [
        (group.pg.broadcast(length, 0, op_timeout(deadline, what)), length),
        (group.pg.broadcast(data, 0, op_timeout(deadline, what)), data),
    ]


def receive_broadcast_message(group: WeightsGroup, deadline: float, what: str) -> Message:
    """Non-root: the next broadcast message (waits until `deadline`)."""
    length = torch.zeros(1, dtype=torch.int64)
    wait(group, group.pg.broadcast(length, 0, op_timeout(deadline, what)), deadline, what)
    data = torch.empty(_checked_length(length), dtype=torch.uint8)
    wait(group, group.pg.broadcast(data, 0, op_timeout(deadline, what)), deadline, what)
    return _decode_frame(data)


def send_message(
    group: WeightsGroup, message: Message, dst: int, deadline: float, tag: int
) -> None:
    """Send one message to group rank `dst` and wait until it is taken."""
    length, data = _frame_tensors(message)
    what = f"sending {type(message).__name__} to group rank {dst}"
    wait(group, group.pg.send([length], dst, tag), deadline, what)
    wait(group, group.pg.send([data], dst, tag), deadline, what)


def recv_message(group: WeightsGroup, src: int, deadline: float, tag: int) -> Message:
    """The next message from group rank `src`."""
    what = f"a message from group rank {src}"
    length = torch.zeros(1, dtype=torch.int64)
    wait(group, group.pg.recv([length], src, tag), deadline, what)
    data = torch.empty(_checked_length(length), dtype=torch.uint8)
    wait(group, group.pg.recv([data], src, tag), deadline, what)
    return _decode_frame(data)


def send_word(
    group: WeightsGroup, message: Message, ranks: Sequence[int], deadline: float, tag: int
) -> None:
    """Send a short message to each of group `ranks` as one fixed-size operation (to all at
    once; one round trip fewer than `send_message`) and wait until every one took it.

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
