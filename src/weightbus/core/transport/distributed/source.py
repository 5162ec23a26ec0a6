"""`dist`, engine-rank side: after the hand-shake (`handshake.py`), a background thread
receives up to `prefetch_depth` buckets ahead of the Receiver, into reused bucket buffers (in
parts mode, only this rank's regions: `slices.receive_parts`).

In parts mode the publisher cuts each rank's regions from the slice map the rank registered
when the group formed (`RankLayout`); a rank whose slice map changed since (its engine's
experts were re-placed) breaks the group and refuses the push, so nothing lands in the wrong
slot and the publisher's next push forms the group anew."""

import queue
import time
from collections.abc import Iterator

import torch

from weightbus.core.plan import Plan, plan_buckets
from weightbus.core.plan.assemble import ChunkAssembler, unpack_bucket
from weightbus.core.transport.base import BucketSource, ReceivedBatch
from weightbus.core.transport.distributed.group import (
    WeightsGroup,
    expect_message,
    get_group,
    op_timeout,
    wait,
)
from weightbus.core.transport.distributed.handshake import join_stream, refuse_stream
from weightbus.core.transport.distributed.messages import DistDescription
from weightbus.core.transport.distributed.slices import receive_parts
from weightbus.core.transport.parts.deadlines import remaining_s
from weightbus.core.transport.parts.prefetch import Prefetcher
from weightbus.core.wire import ProtocolError, UpdateBegin, UpdateEnd
from weightbus.core.wire.messages import BucketSent, SliceSpec

# Receive buffers besides the prefetch queue's: the one being received, the one the Receiver
# queued and the one it loads (when its prefetch thread holds one more, receiving waits).
_BUFFERS_BESIDES_PREFETCH = 3


def _check_layout(group: WeightsGroup, slices: list[SliceSpec]) -> None:
    """Break `group` when this rank's slice map is not the one it registered as the group
    formed: the publisher would cut its parts from the old one."""
    registered = group.layouts.get(group.group_rank)
    if registered is not None and registered.slices != slices and group.broken is None:
        group.broken = (
            "this engine rank's slice map changed since the group formed (its expert map was "
            "re-placed), so the group's layout of it is stale"
        )


class DistSource(BucketSource):
    """Engine-rank side of `dist` for one session, on the live group the description names
    (`slices`: this rank's slice map now, checked in parts mode against the one the group
    registered)."""

    def __init__(
        self,
        description: DistDescription,
        *,
        rank: int = 0,
        tp_size: int = 1,
        slices: list[SliceSpec] | None = None,
    ) -> None:
        self.session_id, self.mode = description.session_id, description.mode
        self.prefetch_depth = description.prefetch_depth
        self.group = get_group(description.group_name)
        if self.mode == "parts" and slices is not None:
            _check_layout(self.group, slices)
        try:
            self.group.check_usable()
        except ValueError as exc:
            refuse_stream(self.group, self.session_id, str(exc))
            raise
        self._plan: Plan | None = None
        self._streaming = False  # the leader said the session starts
        self._ended = False

    def begin(self, timeout_s: float) -> UpdateBegin:
        deadline = time.monotonic() + timeout_s
        join_stream(self.group, self.session_id, deadline)
        self._streaming = True
        header = expect_message(self.group, UpdateBegin, self.session_id, deadline)
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
        group = self.group
        free: queue.Queue[torch.Tensor] = queue.Queue()  # handed back by each batch's release
        for index in range(self.prefetch_depth + _BUFFERS_BESIDES_PREFETCH):
            free.put(group.buffer(("recv", index), plan.bucket_bytes))
        assembler = ChunkAssembler(buffers=group.assembly_buffers)
        for bucket in plan.buckets:
            message = expect_message(group, BucketSent, self.session_id, deadline)
            if message.bucket_index != bucket.index:
                raise ProtocolError(
                    f"bucket {message.bucket_index} arrived, expected {bucket.index}"
                )
            try:
                buffer = free.get(timeout=remaining_s(deadline, "a free receive buffer"))
            except queue.Empty:
                raise TimeoutError("no receive buffer was released in time") from None
            if self.mode == "parts":
                parts = message.parts.get(group.group_rank, [])
                nbytes = receive_parts(group, bucket, buffer, parts, deadline)
            else:  # every entry into its place in the buffer
                what = f"bucket {bucket.index}"
                timeout = op_timeout(deadline, what)
                ops = [
                    group.pg.broadcast(buffer[entry.offset : entry.end], 0, timeout)
                    for entry in bucket.entries
                    if entry.nbytes
                ]
                for work in ops:
                    wait(group, work, deadline, what)
                nbytes = bucket.payload_bytes
            yield ReceivedBatch(
                tensors=list(unpack_bucket(bucket, buffer, assembler)),
                digests=dict(message.digests),
                nbytes=nbytes,
                release=lambda buffer=buffer: free.put(buffer),
            )

    def end(self, timeout_s: float) -> UpdateEnd:
        end = expect_message(self.group, UpdateEnd, self.session_id, time.monotonic() + timeout_s)
        self._ended = True
        return end

    def close(self) -> None:
        # a session left midway leaves this member at another step of the stream than the rest
        if self._streaming and not self._ended and self.group.broken is None:
            self.group.broken = "a push ended midway on this rank"
