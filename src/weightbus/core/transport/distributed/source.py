"""`dist`, engine-rank side: receive a push's buckets from the weights group.

`begin` first tells the publisher this rank is ready and waits for its word (the hand-shake,
`handshake.py`): a push cancelled then moved nothing, and the group stays usable. A background
thread receives up to `prefetch_depth` buckets ahead of the Receiver, into a pool of reused
bucket buffers: in broadcast mode every byte of each bucket; in parts mode only this rank's
regions, in parts from the trainer ranks that send them, each sender's bytes checked against
the xxh3-128 it computed (`parts.py`).
"""

import queue
import time
from collections.abc import Iterator

import torch

from weightbus.core.plan import BucketPlan, Plan, plan_buckets
from weightbus.core.plan.assemble import ChunkAssembler, unpack_bucket
from weightbus.core.transport.base import BucketSource, ReceivedBatch
from weightbus.core.transport.distributed.group import (
    WeightsGroup,
    get_group,
    op_timeout,
    receive_broadcast_message,
    wait,
)
from weightbus.core.transport.distributed.handshake import join_stream, refuse_stream
from weightbus.core.transport.distributed.messages import DistDescription
from weightbus.core.transport.distributed.parts import receive_parts
from weightbus.core.transport.parts.deadlines import remaining_s
from weightbus.core.transport.parts.prefetch import Prefetcher
from weightbus.core.wire import Message, ProtocolError, UpdateBegin, UpdateEnd
from weightbus.core.wire.messages import BucketSent

# Receive buffers besides the prefetch queue's: the one being received, the one the Receiver
# queued and the one it loads (when its prefetch thread holds one more, receiving waits).
_BUFFERS_BESIDES_PREFETCH = 3


class _BufferPool:
    """Receive buffers handed out to batches and returned by their `release()`."""

    def __init__(self, group: WeightsGroup, count: int, nbytes: int) -> None:
        self.buffers = [group.buffer(("recv", index), nbytes) for index in range(count)]
        self._free: queue.Queue[int] = queue.Queue()
        for index in range(count):
            self._free.put(index)

    def acquire(self, deadline: float) -> int:
        try:
            return self._free.get(timeout=remaining_s(deadline, "a free receive buffer"))
        except queue.Empty:
            raise TimeoutError("no receive buffer was released in time") from None

    def release(self, index: int) -> None:
        self._free.put(index)


class DistSource(BucketSource):
    """Engine-rank side of `dist` for one session, on the live group the description names."""

    def __init__(self, description: DistDescription, *, rank: int = 0, tp_size: int = 1) -> None:
        self.session_id, self.mode = description.session_id, description.mode
        self.prefetch_depth = description.prefetch_depth
        self.group = get_group(description.group_name)
        try:
            self.group.check_usable()
        except ValueError as exc:
            refuse_stream(self.group, self.session_id, str(exc))
            raise
        self._plan: Plan | None = None
        self._streaming = False  # the publisher said the session starts
        self._ended = False

    def _recv(self, expected: type[Message], deadline: float) -> Message:
        message = receive_broadcast_message(self.group, deadline, f"a {expected.__name__}")
        if getattr(message, "session_id", None) != self.session_id:
            raise ProtocolError(
                f"{type(message).__name__} of session {getattr(message, 'session_id', None)} "
                f"arrived, expected session {self.session_id}"
            )
        if not isinstance(message, expected):
            raise ProtocolError(f"expected {expected.__name__}, got {type(message).__name__}")
        return message

    def begin(self, timeout_s: float) -> UpdateBegin:
        deadline = time.monotonic() + timeout_s
        join_stream(self.group, self.session_id, deadline)
        self._streaming = True
        header = self._recv(UpdateBegin, deadline)
        self._plan = plan_buckets((m.to_meta() for m in header.tensors), header.bucket_bytes)
        return header

    def batches(self, timeout_s: float) -> Iterator[ReceivedBatch]:
        assert self._plan is not None, "begin() first"
        deadline = time.monotonic() + timeout_s
        prefetcher = Prefetcher(self._receive(self._plan, deadline), self.prefetch_depth, "dist")
        try:
            while True:
                try:
                    batch = prefetcher.get(deadline - time.monotonic())
                except StopIteration:
                    return
                yield batch
        finally:
            prefetcher.close()

    def _receive(self, plan: Plan, deadline: float) -> Iterator[ReceivedBatch]:
        count = self.prefetch_depth + _BUFFERS_BESIDES_PREFETCH
        pool = _BufferPool(self.group, count, plan.bucket_bytes)
        assembler = ChunkAssembler(buffers=self.group.assembly_buffers)
        for bucket in plan.buckets:
            message = self._recv(BucketSent, deadline)
            if message.bucket_index != bucket.index:
                raise ProtocolError(
                    f"bucket {message.bucket_index} arrived, expected {bucket.index}"
                )
            index = pool.acquire(deadline)
            buffer = pool.buffers[index]
            if self.mode == "parts":
                parts = message.parts.get(self.group.group_rank, [])
                nbytes = receive_parts(self.group, bucket, buffer, parts, deadline)
            else:
                nbytes = self._receive_whole(bucket, buffer, deadline)
            yield ReceivedBatch(
                tensors=list(unpack_bucket(bucket, buffer, assembler)),
                digests=dict(message.digests),
                nbytes=nbytes,
                release=lambda index=index: pool.release(index),
            )

    def _receive_whole(self, bucket: BucketPlan, buffer: torch.Tensor, deadline: float) -> int:
        """Receive every entry of the bucket into `buffer`; returns their bytes."""
        what = f"bucket {bucket.index}"
        timeout = op_timeout(deadline, what)
        ops = [
            self.group.pg.broadcast(buffer[entry.offset : entry.end], 0, timeout)
            for entry in bucket.entries
            if entry.nbytes
        ]
        for work in ops:
            wait(self.group, work, deadline, what)
        return bucket.payload_bytes

    def end(self, timeout_s: float) -> UpdateEnd:
        end = self._recv(UpdateEnd, time.monotonic() + timeout_s)
        self._ended = True
        return end

    def close(self) -> None:
        # a session left midway leaves this member at another step of the stream than the rest
        if self._streaming and not self._ended and self.group.broken is None:
            self.group.broken = "a push ended midway on this rank"
