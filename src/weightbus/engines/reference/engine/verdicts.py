"""Combining the ranks' verdicts on an update: flags by all-reduce, details by all-gather
(`poll_verdicts`: both in one all-gather while the verdicts are short).

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

# A poll's frame: a done flag and a length (int64 each), then a verdict that fits.
_HEADER_BYTES = 16
_FRAME_BYTES = 4096


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


def _verdict(update_id: str, result: RankResult) -> RankVerdict:
    return RankVerdict(
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


def gather_verdicts(update_id: str, result: RankResult) -> list[RankVerdict]:
    """Every rank's verdict, on every rank (typed msgpack frames, never pickle)."""
    frame = _verdict(update_id, result).encode()
    return [RankVerdict.decode(data) for data in _all_gather_bytes(frame)]


def poll_verdicts(update_id: str, result: RankResult | None) -> list[RankVerdict] | None:
    """Every rank's verdict once every rank has one (`result`: this rank's, None while its
    receive runs), else None on every rank. One all-gather per poll: the flag and the verdict
    travel in one frame of `_FRAME_BYTES` (a longer verdict follows in a second)."""
    frame = b"" if result is None else _verdict(update_id, result).encode()
    if get_tp().tp_size == 1:
        return None if result is None else [RankVerdict.decode(frame)]
    frames = _gather_when_done(result is not None, frame)
    return None if frames is None else [RankVerdict.decode(data) for data in frames]


def _gather_when_done(done: bool, data: bytes) -> list[bytes] | None:
    """Every rank's `data` if every rank is `done`, else None (on every rank alike)."""
    tp = get_tp()
    frame = torch.zeros(_HEADER_BYTES + _FRAME_BYTES, dtype=torch.uint8)
    header = torch.tensor([int(done), len(data)], dtype=torch.int64)
    frame[:_HEADER_BYTES] = header.view(torch.uint8)
    if data and len(data) <= _FRAME_BYTES:
        frame[_HEADER_BYTES : _HEADER_BYTES + len(data)] = torch.frombuffer(
            bytearray(data), dtype=torch.uint8
        )
    gathered = [torch.empty_like(frame) for _ in range(tp.tp_size)]
    dist.all_gather(gathered, frame, group=tp.group)
    headers = [g[:_HEADER_BYTES].view(torch.int64).tolist() for g in gathered]
    if not all(flag for flag, _ in headers):
        return None
    if any(length > _FRAME_BYTES for _, length in headers):
        return _all_gather_bytes(data)  # every rank sees the same headers: all take this way
    body = slice(_HEADER_BYTES, None)
    return [
        bytes(g[body][:length].numpy()) for g, (_, length) in zip(gathered, headers, strict=True)
    ]


def gather_slice_maps(slices: list[SliceSpec]) -> list[list[SliceSpec]]:
    """Every rank's slice map, on every rank, in rank order (once, at start-up)."""
    frames = _all_gather_bytes(msgspec.msgpack.encode(slices))
    return [msgspec.msgpack.decode(frame, type=list[SliceSpec]) for frame in frames]
