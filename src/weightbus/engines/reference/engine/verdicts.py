"""Combining the ranks' verdicts on an update: flags by all-reduce, details by all-gather.

These run on the TP group at a step boundary, on every rank alike, and only while an update
is in flight (the steady state pays nothing).
"""

import msgspec
import torch
import torch.distributed as dist

from weightbus.core.receiver import RankResult
from weightbus.core.wire import RankVerdict
from weightbus.core.wire.messages import SliceSpec
from weightbus.engines.reference.layers.parallel import get_tp


def all_flags(*flags: bool) -> list[bool]:
    """Element-wise AND of boolean flags across the ranks."""
    tp = get_tp()
    values = torch.tensor([int(flag) for flag in flags], dtype=torch.int64)
    if tp.tp_size > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MIN, group=tp.group)
    return [bool(v) for v in values.tolist()]


def _all_gather_bytes(data: bytes) -> list[bytes]:
    tp = get_tp()
    if tp.tp_size == 1:
        return [data]
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(tp.tp_size)]
    dist.all_gather(lengths, length, group=tp.group)
    size = max(int(n) for n in lengths)
    padded = torch.zeros(size, dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.zeros(size, dtype=torch.uint8) for _ in range(tp.tp_size)]
    dist.all_gather(gathered, padded, group=tp.group)
    return [bytes(t[: int(n)].numpy()) for t, n in zip(gathered, lengths, strict=True)]


def gather_verdicts(update_id: str, result: RankResult) -> list[RankVerdict]:
    """Every rank's verdict, on every rank (typed msgpack frames, never pickle)."""
    verdict = RankVerdict(
        session_id=update_id,
        rank=get_tp().tp_rank,
        ok=result.ok,
        errors=result.errors,
        names=result.bad_names,
        timed_out=result.timed_out,
        touched=result.touched,
        fingerprint=result.fingerprint,
        nbytes=result.nbytes,
    )
    return [RankVerdict.decode(frame) for frame in _all_gather_bytes(verdict.encode())]


def gather_slice_maps(slices: list[SliceSpec]) -> list[list[SliceSpec]]:
    """Every rank's slice map, on every rank, in rank order (once, at start-up)."""
    frames = _all_gather_bytes(msgspec.msgpack.encode(slices))
    return [msgspec.msgpack.decode(frame, type=list[SliceSpec]) for frame in frames]
