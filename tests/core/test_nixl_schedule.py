"""The `nixl` write schedule, carried out by hand: packing each job's slice and writing each
packed run where the schedule says fills every rank's memory exactly as a slice copy would,
and moves each rank's share only."""

import numpy as np
import pytest
import torch

from weightbus.core.meta import TensorMeta
from weightbus.core.plan import plan_buckets
from weightbus.core.transport.nixl.schedule import Schedule
from weightbus.core.transport.parts.layout import checked_copies
from weightbus.core.wire import DirectTarget, ParamRegion, WireShardCopy

BASE = 1 << 20  # where a rank's memory starts in its (pretend) address space


def _target(regions: list[ParamRegion], copies: list[WireShardCopy], nbytes: int):
    return DirectTarget(
        file="weightbus-params-1-0000000000000000", nbytes=nbytes, layout_hash="0" * 32,
        params=regions, copies=copies,
    )  # fmt: skip


# Two ranks. `w`: rows split (rank r: rows 6r..6r+5; a bucket of 256 bytes splits it); `o`:
# columns split into the middle of a wider parameter (a strided destination); `n`: whole on
# both; `s`: 0-d.
FULL = {
    "w": torch.arange(12 * 8, dtype=torch.float32).view(12, 8),
    "o": torch.arange(6 * 8, dtype=torch.bfloat16).view(6, 8) + 1000,
    "n": torch.arange(8, dtype=torch.float16),
    "s": torch.tensor(7, dtype=torch.int64),
}


def _rank(rank: int) -> DirectTarget:
    regions = [
        ParamRegion("w_param", "float32", (6, 8), 0),
        ParamRegion("o_param", "bfloat16", (6, 8), 256),
        ParamRegion("n_param", "float16", (8,), 512),
        ParamRegion("s_param", "int64", (), 768),
    ]
    copies = [
        WireShardCopy("w", "w_param", 0, 6 * rank, 0, 6),
        WireShardCopy("o", "o_param", 1, 4 * rank, 2, 4),
        WireShardCopy("n", "n_param", 0, 0, 0, 8),
        WireShardCopy("s", "s_param", 0, 0, 0, 1),
    ]
    return _target(regions, copies, 1024)


def _schedule(bucket_bytes: int, sends: set[str] | None = None) -> Schedule:
    metas = [TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in FULL.items()]
    plan = plan_buckets(metas, bucket_bytes)
    by_name = {meta.name: meta for meta in metas}
    ranks = [(BASE, checked_copies(_rank(rank), by_name)) for rank in range(2)]
    return Schedule(plan, ranks, sends=set(FULL) if sends is None else sends)


def _written(schedule: Schedule) -> tuple[list[np.ndarray], list[int]]:
    """Each rank's memory after the schedule's writes, carried out by hand, and the bytes
    moved into each."""
    memories = [np.zeros(1024, dtype=np.uint8) for _ in range(2)]
    moved = [0, 0]
    for bucket in schedule.buckets:
        for index, writes in enumerate(bucket):
            buffer = np.zeros(max(1, writes.nbytes), dtype=np.uint8)
            for job in writes.jobs:
                packed = job.source(FULL[job.name]).contiguous().view(-1).view(torch.uint8)
                buffer[job.packed_offset : job.packed_offset + job.nbytes] = packed.numpy()
            if not writes.jobs:
                continue
            local, remote = writes.descriptors(0)
            for (source, length, _), (address, _, _) in zip(local, remote, strict=True):
                start = int(address) - BASE
                memories[index][start : start + int(length)] = buffer[source : source + length]
                moved[index] += int(length)
    return memories, moved


@pytest.mark.parametrize("bucket_bytes", [256, 512, 4096], ids=["rows", "small", "one"])
def test_the_schedule_writes_each_rank_its_slices_exactly(bucket_bytes):
    memories, moved = _written(_schedule(bucket_bytes))
    for rank, memory in enumerate(memories):
        flat = torch.from_numpy(memory)
        w = flat[0:192].view(torch.float32).view(6, 8)
        o = flat[256:352].view(torch.bfloat16).view(6, 8)
        n = flat[512:528].view(torch.float16)
        s = flat[768:776].view(torch.int64)
        assert torch.equal(w, FULL["w"][6 * rank : 6 * rank + 6])
        assert torch.equal(o[:, 2:6], FULL["o"][:, 4 * rank : 4 * rank + 4])
        assert not o[:, :2].any()
        assert not o[:, 6:].any()
        assert torch.equal(n, FULL["n"])
        assert int(s) == 7
        # the rank's share only: 6 of 12 rows, 4 of 8 columns, all of n and s
        assert moved[rank] == 192 + 6 * 4 * 2 + 16 + 8


@pytest.mark.parametrize("bucket_bytes", [256, 4096], ids=["rows", "one"])
def test_a_trainer_ranks_schedule_writes_the_tensors_it_sends_and_nothing_else(bucket_bytes):
    """A trainer rank that sends `w` and `s` whole (another sends `o` and `n`) writes those
    exactly as the whole schedule does, and leaves the rest of each rank's memory alone."""
    mine = _schedule(bucket_bytes, sends={"w", "s"})
    assert {job.name for bucket in mine.buckets for w in bucket for job in w.jobs} == {"w", "s"}
    memories, moved = _written(mine)
    everything, _ = _written(_schedule(bucket_bytes))
    for rank, memory in enumerate(memories):
        assert np.array_equal(memory[0:192], everything[rank][0:192])  # w
        assert np.array_equal(memory[768:776], everything[rank][768:776])  # s
        assert not memory[192:768].any()  # o, n: the other rank's
        assert moved[rank] == 192 + 8


def test_entries_a_rank_receives_whole_keep_their_inbox_offsets_in_a_part_schedule():
    """A rank whose slice map lacks `o` and `n` receives them whole, back to back in its inbox
    slot as it computes them from the whole bucket: a schedule of `n` alone lands `n` there."""
    metas = [TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in FULL.items()]
    plan = plan_buckets(metas, 4096)
    by_name = {meta.name: meta for meta in metas}
    regions = [ParamRegion("w_param", "float32", (12, 8), 0)]
    copies = [WireShardCopy("w", "w_param", 0, 0, 0, 12)]
    held = checked_copies(_target(regions, copies, 1024), by_name, partial=True)
    whole = Schedule(plan, [(BASE, held)], sends=set(FULL))
    part = Schedule(plan, [(BASE, held)], sends={"n"})
    inbox = {job.entry.name: job.entry.offset for job in whole.buckets[0][0].whole}
    assert set(inbox) == {"o", "n", "s"}
    assert [(job.entry.name, job.entry.offset) for job in part.buckets[0][0].whole] == [
        ("n", inbox["n"])
    ]
    assert not part.buckets[0][0].jobs
    assert 0 < part.inbox_bytes[0] <= whole.inbox_bytes[0]


def test_a_row_larger_than_a_bucket_is_refused_naming_the_tensor():
    wide = TensorMeta("wide", torch.float32, (2, 1024))
    plan = plan_buckets([wide], 1024)
    region = ParamRegion("wide_param", "float32", (2, 1024), 0)
    target = _target([region], [WireShardCopy("wide", "wide_param", 0, 0, 0, 2)], 8192)
    with pytest.raises(ValueError, match=r"tensor 'wide' has rows of 4096 bytes, more than a "):
        Schedule(plan, [(BASE, checked_copies(target, {"wide": wide}))], sends={"wide"})
