"""`dist`, publisher side: buckets travel on a torch.distributed gloo group spanning hosts.

The group (`group.py`) is created once and reused: the publisher is group rank 0, every
engine rank a member. Per push, once every engine rank said it is ready (the hand-shake,
`handshake.py`: a push an engine refuses is cancelled before anything moves, and the group
stays usable), on the group, in order:

    UpdateBegin -> (BucketSent, bucket data) x buckets -> UpdateEnd

Messages are typed wire frames broadcast as `uint8` tensors (length first), never pickle.
Bucket data goes out as asynchronous operations from two send buffers, so packing bucket k+1
overlaps sending bucket k. Two modes:

- `broadcast`: one broadcast of the whole bucket; every rank receives every byte.
- `scatter`: each rank receives only the regions of the bucket it loads (its TP slices, from
  the `RankLayout` it reported when it joined), as a point-to-point send: 1/tp of the bytes for
  sharded tensors. Ranks with the same slice map share one packed buffer. No rank holds whole
  tensors, so per-tensor digests cannot be checked on the engine: the transport checks an
  xxh3-128 of each rank's bytes of every bucket instead, and engines run with `verify: none`.

`auto` picks `scatter` when every engine rank is part of a TP group (tp > 1), else `broadcast`.
A rank receives in a background thread, up to `prefetch_depth` buckets ahead of the Receiver.
"""

import contextlib
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec
import torch

from weightbus.core.digest import bytes_digest
from weightbus.core.plan import BucketPlan
from weightbus.core.plan.bucket import BucketEntry, byte_view, check_entry_tensor, pack_entries
from weightbus.core.transport.base import BucketSink, EngineLink, Progress, PushSession, no_progress
from weightbus.core.transport.distributed.group import (
    DATA_TAG,
    WeightsGroup,
    broadcast_message,
    get_group,
    group_names,
    op_timeout,
    wait,
)
from weightbus.core.transport.distributed.handshake import start_stream
from weightbus.core.transport.distributed.messages import (
    DEFAULT_GROUP_NAME,
    MAX_PREFETCH_DEPTH,
    Backend,
    DistDescription,
    WeightsGroupDestroy,
    WeightsGroupError,
    WeightsGroupInfo,
)
from weightbus.core.transport.distributed.setup import form_group, leave_group
from weightbus.core.transport.distributed.slices import (
    SliceTarget,
    check_slices,
    layout_slices,
    pack_regions,
    rank_regions,
    regions_nbytes,
    slice_targets,
)
from weightbus.core.wire.messages import BucketSent

Mode = Literal["auto", "broadcast", "scatter"]
MODES = ("auto", "broadcast", "scatter")
# Bound of leaving the group at `close` (engines that do not answer by then are left as is).
CLOSE_TIMEOUT_S = 10.0


def choose_mode(group: WeightsGroup, mode: Mode) -> Literal["broadcast", "scatter"]:
    """The mode of a push: `mode` unless `auto`, which scatters when every rank has tp > 1."""
    if mode != "auto":
        return mode
    tp_sizes = [layout.tp_size for layout in group.layouts.values()]
    return "scatter" if tp_sizes and min(tp_sizes) > 1 else "broadcast"


class _InFlight:
    """Operations of one bucket not yet known complete, and the tensors they read."""

    def __init__(self) -> None:
        self.ops: list[tuple[object, torch.Tensor]] = []
        self.nbytes = 0

    def finish(self, group: WeightsGroup, deadline: float, what: str) -> int:
        for work, _ in self.ops:
            wait(group, work, deadline, what)
        nbytes, self.ops, self.nbytes = self.nbytes, [], 0
        return nbytes


class DistSink(BucketSink):
    """Publisher side of `dist`. `setup` forms the weights group (`Publisher.setup_transport`,
    or its SGLang-style name `Publisher.init_weights_group`); every push reuses it.

    Args:
        group_name: the weights group to push on.
        mode: `broadcast`, `scatter` or `auto`.
        prefetch_depth: buckets each rank receives ahead of the one it loads.

    Attributes:
        rank_sent_bytes: bytes each receiving group rank got in the last push, alignment padding
            included (`PushSession.sent_bytes` counts the push's tensor bytes).
    """

    name = "dist"

    def __init__(
        self, group_name: str = DEFAULT_GROUP_NAME, mode: Mode = "auto", prefetch_depth: int = 1
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 1 <= prefetch_depth <= MAX_PREFETCH_DEPTH:
            raise ValueError(
                f"prefetch_depth must be in [1, {MAX_PREFETCH_DEPTH}], got {prefetch_depth}"
            )
        self.group_name = group_name
        self.requested_mode = mode
        self.prefetch_depth = prefetch_depth
        self.rank_sent_bytes: dict[int, int] = {}
        self._session_mode: tuple[str, str] = ("", "broadcast")
        self._members: Sequence[EngineLink] = ()  # the engines of the group this sink formed
        self._engine_at_offset: dict[int, str] = {}  # first group rank -> engine URL

    def setup(
        self,
        engines: Sequence[EngineLink],
        *,
        master_addr: str,
        master_port: int = 0,
        backend: Backend = "gloo",
        timeout_s: float = 60.0,
    ) -> WeightsGroupInfo:
        """Form the weights group with every rank of `engines` (again: re-form it, e.g. after a
        failed push left it broken). See `setup.form_group`.

        Raises:
            WeightsGroupError: an engine or this process could not join (each one named).
        """
        self._members = ()
        info = form_group(
            engines,
            name=self.group_name,
            master_addr=master_addr,
            master_port=master_port,
            backend=backend,
            timeout_s=timeout_s,
            **self._senders(),
        )
        self._members = tuple(engines)
        self._engine_at_offset = {offset: url for url, offset in info.rank_offsets.items()}
        return info

    def _senders(self) -> dict[str, Any]:
        """`form_group`'s options for the group's senders (this process alone here)."""
        return {}

    def teardown_engine(self, engine: EngineLink, timeout_s: float) -> None:
        """The engine's ranks leave the group (the group must then be formed again); it is
        no longer a member, whether it confirmed or not."""
        self._members = tuple(m for m in self._members if m.url != engine.url)
        request = WeightsGroupDestroy(group_name=self.group_name)
        engine.teardown_transport("dist", request, timeout_s)

    def sibling_options(
        self, sink_options: dict[str, Any], setup_options: dict[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """A group of its own (a fresh name and store port): processes register groups by
        name, and a fixed store port is taken by this sink's group."""
        name = f"{self.group_name[:48]}-join-{secrets.token_hex(4)}"
        setup = None if setup_options is None else {**setup_options, "master_port": 0}
        return {**sink_options, "group_name": name}, setup

    def teardown(self, timeout_s: float) -> None:
        """Leave the weights group here and on every engine.

        Raises:
            WeightsGroupError: an engine did not confirm (this process has left regardless).
        """
        members, self._members = self._members, ()
        leave_group(members, name=self.group_name, timeout_s=timeout_s)

    def setup_broken(self) -> str | None:
        if not self._members or self.group_name not in group_names():
            return None
        return get_group(self.group_name).broken

    def _group(self) -> WeightsGroup:
        group = get_group(self.group_name)
        group.check_usable()
        return group

    def _push_mode(self, group: WeightsGroup) -> Literal["broadcast", "scatter", "sharded"]:
        return choose_mode(group, self.requested_mode)

    def prepare(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        progress: Progress = no_progress,
    ) -> DistDescription:
        group = self._group()
        mode = self._push_mode(group)
        if mode != "broadcast":
            shapes = {meta.name: meta.shape for meta in session.plan.metas}
            for layout in group.layouts.values():
                check_slices(layout_slices(layout), shapes)
        self._session_mode = (session.session_id, mode)
        if mode != "sharded":  # sharded: the trainer ranks digest their shards when streaming
            session.ensure_digests(tensors)  # each bucket's message carries its tensors' digests
        return DistDescription(
            group_name=self.group_name,
            session_id=session.session_id,
            mode=mode,
            prefetch_depth=self.prefetch_depth,
        )

    @property
    def mode(self) -> str:
        return f"dist {self._session_mode[1]}"

    def receiver_verify(self, verify: str) -> str:
        # scatter, sharded: no rank holds whole tensors; the transport checks each rank's bytes
        return verify if self._session_mode[1] == "broadcast" else "none"

    def stream(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        timeout_s: float,
        progress: Progress = no_progress,
    ) -> None:
        group = self._group()
        session_id, mode = self._session_mode
        assert session_id == session.session_id, "prepare() the session first"
        push = _Push(group, session, tensors, time.monotonic() + timeout_s)
        self.rank_sent_bytes = push.rank_sent_bytes
        # raises when the push cannot start: nothing moved, the group stays usable
        start_stream(
            group,
            session_id,
            push.deadline,
            abandoned=lambda: session.abandoned,
            describe_rank=lambda group_rank: self._describe_rank(group, group_rank),
        )
        try:
            push.run(mode, progress)
        except BaseException as exc:
            # the receivers are at some step of the stream: the group must be re-initialised
            group.broken = group.broken or f"a push failed midway: {exc}"
            raise

    def _describe_rank(self, group: WeightsGroup, group_rank: int) -> str:
        """`engine URL (group rank r)`, or `group rank r` for a rank of no known engine."""
        layout = group.layouts.get(group_rank)
        url = None if layout is None else self._engine_at_offset.get(group_rank - layout.tp_rank)
        if url is None:
            return f"group rank {group_rank}"
        return f"engine {url} (group rank {group_rank})"

    def close(self) -> None:
        """Leave the group this sink formed (bounded: engines that do not answer are left)."""
        if self._members:
            with contextlib.suppress(WeightsGroupError):
                self.teardown(timeout_s=CLOSE_TIMEOUT_S)


class _Push:
    """One push on the group: `run` is a loop over `_send_bucket`, two buckets in flight."""

    def __init__(
        self,
        group: WeightsGroup,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        deadline: float,
    ) -> None:
        self.group = group
        self.session = session
        self.tensors = tensors
        self.deadline = deadline
        self.rank_sent_bytes = dict.fromkeys(group.receiving_ranks, 0)
        self.in_flight = [_InFlight(), _InFlight()]  # double buffering: pack one, send one

    def run(self, mode: str, progress: Progress) -> None:
        group, deadline = self.group, self.deadline
        targets = slice_targets(group.layouts.values()) if mode == "scatter" else None
        begin = broadcast_message(group, self.session.begin_message(), deadline)
        for bucket in self.session.plan.buckets:
            pending = self.in_flight[bucket.index % 2]
            progress(pending.finish(group, deadline, f"bucket {bucket.index - 2}"))
            self._send_bucket(bucket, pending, targets)
        for pending in self.in_flight:
            progress(pending.finish(group, deadline, "the last buckets"))
        end = broadcast_message(group, self.session.end_message(), deadline)
        for work, _ in [*begin, *end]:
            wait(group, work, deadline, "the session's messages")

    def _send_bucket(
        self, bucket: BucketPlan, pending: _InFlight, targets: list[SliceTarget] | None
    ) -> None:
        buffer = self.group.buffer(("send", bucket.index % 2), self.session.plan.bucket_bytes)
        message = BucketSent(
            session_id=self.session.session_id,
            bucket_index=bucket.index,
            digests=completed_digests(self.session, bucket),
        )
        if targets is None:
            self._broadcast(bucket, buffer, message, pending)
        else:
            pack_entries(buffer, bucket.entries, self.tensors)
            self._scatter(bucket, buffer, targets, message, pending)
        pending.nbytes = bucket.nbytes

    def _entry_bytes(self, entry: BucketEntry, buffer: torch.Tensor) -> torch.Tensor:
        """The entry's bytes: a view of the source tensor when it is contiguous (no copy),
        else packed into the bucket buffer."""
        tensor = self.tensors.get(entry.name)
        if tensor is None or not tensor.is_contiguous() or tensor.device.type != "cpu":
            pack_entries(buffer, [entry], self.tensors)  # also raises for a missing tensor
            return buffer[entry.offset : entry.end]
        check_entry_tensor(entry, tensor)
        start = entry.tensor_offset
        return byte_view(tensor.detach())[start : start + entry.nbytes]

    def _broadcast(
        self, bucket: BucketPlan, buffer: torch.Tensor, message: BucketSent, pending: _InFlight
    ) -> None:
        # one collective per entry, straight from the tensors: no packing copy on this side,
        # and each lands at its place in the receivers' bucket buffers
        pending.ops += broadcast_message(self.group, message, self.deadline)
        timeout = op_timeout(self.deadline, f"broadcast of bucket {bucket.index}")
        for entry in bucket.entries:
            if entry.nbytes:
                data = self._entry_bytes(entry, buffer)
                pending.ops.append((self.group.pg.broadcast(data, 0, timeout), data))
        self.session.count_sent(bucket.payload_bytes)  # one send, whatever the receivers
        for group_rank in self.rank_sent_bytes:
            self.rank_sent_bytes[group_rank] += bucket.nbytes

    def _scatter(
        self,
        bucket: BucketPlan,
        buffer: torch.Tensor,
        targets: list[SliceTarget],
        message: BucketSent,
        pending: _InFlight,
    ) -> None:
        packed_buffers, payloads = [], []
        for index, target in enumerate(targets):
            packed = self.group.buffer(("packed", bucket.index % 2, index), buffer.numel())
            regions = rank_regions(bucket, buffer, target.slices)
            nbytes = pack_regions(regions, packed)
            packed_buffers.append(packed[:nbytes])
            payloads.append(regions_nbytes(regions))
        sends = [
            (group_rank, packed)
            for target, packed in zip(targets, packed_buffers, strict=True)
            for group_rank in target.group_ranks
        ]
        digests = [bytes_digest(packed) for packed in packed_buffers]
        by_rank = {
            group_rank: digest
            for target, digest in zip(targets, digests, strict=True)
            for group_rank in target.group_ranks
        }
        message = msgspec.structs.replace(message, rank_digests=by_rank)
        pending.ops += broadcast_message(self.group, message, self.deadline)
        for group_rank, packed in sends:
            pending.ops.append((self.group.pg.send([packed], group_rank, DATA_TAG), packed))
            self.rank_sent_bytes[group_rank] += packed.numel()
        for target, payload in zip(targets, payloads, strict=True):
            self.session.count_sent(payload * len(target.group_ranks))  # one send per rank


def completed_digests(session: PushSession, bucket: BucketPlan) -> dict[str, str]:
    # digests of the tensors whose last byte is in this bucket
    return {
        e.name: session.digests[e.name]
        for e in bucket.entries
        if e.tensor_offset + e.nbytes == e.tensor_nbytes
    }
