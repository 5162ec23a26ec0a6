"""Sharded pushes over `disk`: every trainer rank writes the bytes it holds into the session's
safetensors shards, where a shared filesystem lets the engines read them.

Rank 0 lays the session out as `DiskSink` does (one shard per plan bucket, whole tensors, a
manifest), but writes only each file's safetensors header and sizes it; every rank then writes
its parts of each tensor at their offsets (`os.pwrite`; a replicated part by one rank, chosen as
for the slots) and hashes its digest blocks. Rank 0 writes the manifest with the combined
digests and renames the session into place: readers see a whole session or none.
"""

import json
import os
import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import msgspec
import torch

from weightbus.core.checkpoint import SAFETENSORS_DTYPES
from weightbus.core.meta import TensorMeta
from weightbus.core.sharded.control import GroupControl
from weightbus.core.sharded.digests import BlockDigests, DigestPlan, combine, compute, whole_regions
from weightbus.core.sharded.holdings import Holding
from weightbus.core.sharded.layout import TrainerLayout
from weightbus.core.sharded.sink import SharedPush
from weightbus.core.sharded.slots import SlotPart, range_parts
from weightbus.core.sharded.steps import DiskFile, DiskOrder, DiskStep
from weightbus.core.transport.base import Progress, PushSession, no_progress
from weightbus.core.transport.disk import (
    DiskDescription,
    DiskSink,
    ShardRecord,
    shard_names,
)

_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


class DiskReport(msgspec.Struct, frozen=True, kw_only=True):
    sent_bytes: int
    digests: BlockDigests


def create_shard(path: Path, metas: list[TensorMeta]) -> DiskFile:
    """A safetensors file of `metas`' size holding only its header (tensors largest element
    first, so each starts aligned to its element size); where each tensor's bytes go."""
    ordered = sorted(metas, key=lambda meta: -meta.element_bytes)
    header, data_offsets, position = {}, {}, 0
    for meta in ordered:
        header[meta.name] = {
            "dtype": _SAFETENSORS_NAMES[meta.dtype],
            "shape": list(meta.shape),
            "data_offsets": [position, position + meta.nbytes],
        }
        data_offsets[meta.name] = position
        position += meta.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % 8)  # the data starts 8-byte aligned
    start = 8 + len(encoded)
    with path.open("wb") as file:
        file.write(len(encoded).to_bytes(8, "little") + encoded)
        file.truncate(start + position)
    path.chmod(0o600)
    return DiskFile(str(path), {name: start + offset for name, offset in data_offsets.items()})


class GroupDisk:
    """A trainer rank's side of sharded `disk` pushes."""

    def __init__(self, control: GroupControl) -> None:
        self._control = control
        self._compiled: dict[tuple, tuple[DigestPlan, list[list[SlotPart]]]] = {}

    def write(
        self,
        key: str,
        order: DiskOrder,
        layout: TrainerLayout,
        holdings: dict[str, Holding],
        deadline: float,
    ) -> None:
        """Write this rank's parts of every shard, digest its blocks, report (`key`)."""

        def work() -> bytes:
            digest_plan, parts = self._compile(layout, order)
            sent = 0
            for file, file_parts in zip(order.files, parts, strict=True):
                descriptor = os.open(file.path, os.O_WRONLY)
                try:
                    for part in file_parts:
                        if part.rank == self._control.rank:
                            data = holdings[part.name].bytes_of(part.start, part.numel)
                            sent += os.pwrite(descriptor, data, part.slot_offset)
                finally:
                    os.close(descriptor)
                if time.monotonic() > deadline:
                    raise TimeoutError("the shards were not written in time")
            digests = compute(digest_plan, holdings, self._control, key, deadline)
            return msgspec.msgpack.encode(DiskReport(sent_bytes=sent, digests=digests))

        self._control.answer(key, work)

    def outcome(
        self, key: str, layout: TrainerLayout, order: DiskOrder, deadline: float
    ) -> tuple[dict[str, str], list[int]]:
        """Rank 0: every tensor's digest, and the bytes each rank wrote."""
        reports = {
            rank: msgspec.msgpack.decode(message.body, type=DiskReport)
            for rank, message in self._control.collect(key, "write report", deadline).items()
        }
        digest_plan, _ = self._compile(layout, order)
        digests = combine(digest_plan, [report.digests for report in reports.values()])
        names = [meta.name for meta in layout.metas]
        return dict(zip(names, digests, strict=True)), [
            reports[rank].sent_bytes for rank in sorted(reports)
        ]

    def _compile(
        self, layout: TrainerLayout, order: DiskOrder
    ) -> tuple[DigestPlan, list[list[SlotPart]]]:
        key = (
            layout.layout_hash,
            tuple((Path(f.path).name, tuple(f.offsets.items())) for f in order.files),
        )
        if key not in self._compiled:
            metas = {meta.name: meta for meta in layout.metas}
            load: dict[int, int] = defaultdict(int)
            parts = [
                [
                    part
                    for name, offset in file.offsets.items()
                    for part in range_parts(
                        layout, metas[name], 0, metas[name].numel, offset=offset, load=load
                    )
                ]
                for file in order.files
            ]
            regions = whole_regions(layout)
            self._compiled = {key: (DigestPlan(layout, regions), parts)}
        return self._compiled[key]


class ShardedDiskSink(DiskSink):
    """`disk` for a trainer group's rank 0: every rank writes its parts of the shards."""

    def __init__(self, writer: GroupDisk, root: str | Path | None = None) -> None:
        super().__init__(root)
        self.group_disk = writer
        self.push: SharedPush | None = None

    def prepare(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        progress: Progress = no_progress,
    ) -> DiskDescription:
        push = self.push
        assert push is not None, "a sharded sink writes only inside a ShardedPublisher push"
        tmp = self._directories.start(session.session_id)
        metas = {meta.name: meta for meta in session.plan.metas}
        records, files = [], []
        for index, names in enumerate(shard_names(session)):
            if names:
                file = f"shard-{index:05d}.safetensors"
                files.append(create_shard(tmp / file, [metas[name] for name in names]))
                records.append(ShardRecord(file, names))
        order = DiskOrder(files=files)
        push.announce(DiskStep(order=order))
        self.group_disk.write(push.key, order, push.layout, push.holdings, push.deadline)
        digests, sent = self.group_disk.outcome(push.key, push.layout, order, push.deadline)
        session.digests.update(digests)
        session.count_sent(sum(sent))
        push.sent_bytes = sent
        progress(sum(sent))
        return self._publish(tmp, session, records)
