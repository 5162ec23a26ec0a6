"""The planner: an ordered list of tensor metas + a bucket size -> an ordered list of buckets.

Planning is pure: no tensors, no sockets. The same metas and `bucket_bytes` always give the
same plan and the same `plan_hash`, on any process, so both ends of a transport can compute it
and compare hashes instead of shipping the plan.
"""

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import msgspec
import xxhash

from weightbus.core.meta import TensorMeta, dtype_name
from weightbus.core.plan.bucket import ALIGN_BYTES, BucketEntry, align_up

# Bumped whenever the layout rules change, so old and new planners never agree by accident.
PLAN_FORMAT = 1
# The bucket size publishers plan with unless told otherwise (and transport buffers' size).
DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass(frozen=True, slots=True)
class BucketPlan:
    """One bucket of a plan: its entries and the bytes they span."""

    index: int
    entries: tuple[BucketEntry, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer in use (end of the last entry)."""
        return max((entry.end for entry in self.entries), default=0)

    @property
    def payload_bytes(self) -> int:
        """Tensor bytes carried (alignment padding excluded)."""
        return sum(entry.nbytes for entry in self.entries)

    def finished_names(self) -> list[str]:
        """The tensors whose last byte is in this bucket (a tensor split into chunks
        finishes in the bucket of its last chunk)."""
        return [e.name for e in self.entries if e.tensor_offset + e.nbytes == e.tensor_nbytes]


@dataclass(frozen=True, slots=True)
class Plan:
    """An ordered list of buckets covering every byte of every tensor exactly once."""

    bucket_bytes: int
    metas: tuple[TensorMeta, ...]
    buckets: tuple[BucketPlan, ...]
    plan_hash: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan_hash", _hash_plan(self.bucket_bytes, self.buckets))

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors (without alignment padding)."""
        return sum(meta.nbytes for meta in self.metas)

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def entries(self) -> Iterator[BucketEntry]:
        """All entries, bucket by bucket."""
        for bucket in self.buckets:
            yield from bucket.entries


def _validate(metas: Sequence[TensorMeta], bucket_bytes: int) -> None:
    if (
        not isinstance(bucket_bytes, int)
        or bucket_bytes < ALIGN_BYTES
        or bucket_bytes % ALIGN_BYTES
    ):
        raise ValueError(
            f"bucket_bytes must be a positive multiple of {ALIGN_BYTES}, got {bucket_bytes!r}"
        )
    if not metas:
        raise ValueError("cannot plan an empty model: no tensors given")
    duplicates = sorted(name for name, count in Counter(m.name for m in metas).items() if count > 1)
    if duplicates:
        raise ValueError(f"duplicate tensor names: {duplicates}")


def _chunk_bytes(meta: TensorMeta, bucket_bytes: int) -> int:
    """Largest chunk of `meta` that fills a bucket: whole rows when a row fits, else elements."""
    unit = meta.row_bytes if meta.row_bytes <= bucket_bytes else meta.element_bytes
    return bucket_bytes // unit * unit


class _Builder:
    """Accumulates entries into buckets, closing a bucket when the next entry does not fit."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.buckets: list[BucketPlan] = []
        self.entries: list[BucketEntry] = []
        self.offset = 0

    def close(self) -> None:
        if self.entries:
            self.buckets.append(BucketPlan(len(self.buckets), tuple(self.entries)))
        self.entries = []
        self.offset = 0

    def add(self, meta: TensorMeta, nbytes: int, tensor_offset: int = 0) -> None:
        start = align_up(self.offset)
        if start + nbytes > self.bucket_bytes:
            self.close()
            start = 0
        self.entries.append(
            BucketEntry(meta.name, dtype_name(meta.dtype), meta.shape, start, nbytes, tensor_offset)
        )
        self.offset = start + nbytes

    def add_chunked(self, meta: TensorMeta) -> None:
        self.close()
        chunk_bytes = _chunk_bytes(meta, self.bucket_bytes)
        for tensor_offset in range(0, meta.nbytes, chunk_bytes):
            self.add(meta, min(chunk_bytes, meta.nbytes - tensor_offset), tensor_offset)


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int) -> Plan:
    """Plan the buckets that carry `metas`, in order.

    Tensors are packed back to back at 256-byte aligned offsets; a tensor that does not fit in
    the current bucket starts the next one; a tensor larger than `bucket_bytes` is split into
    chunks of whole rows (or of elements when one row exceeds a bucket), each filling a bucket.

    Args:
        metas: tensor metadata in the order the tensors will be sent.
        bucket_bytes: capacity of one bucket buffer; a positive multiple of 256.

    Returns:
        The plan, with its `plan_hash`.

    Raises:
        ValueError: `bucket_bytes` is invalid, `metas` is empty or holds a name twice.
    """
    metas = tuple(metas)
    _validate(metas, bucket_bytes)
    builder = _Builder(bucket_bytes)
    for meta in metas:
        if meta.nbytes > bucket_bytes:
            builder.add_chunked(meta)
        else:
            builder.add(meta, meta.nbytes)
    builder.close()
    return Plan(bucket_bytes, metas, tuple(builder.buckets))


def _hash_plan(bucket_bytes: int, buckets: Sequence[BucketPlan]) -> str:
    """xxh3-128 over a canonical msgpack encoding of everything that defines the layout."""
    canonical = [
        PLAN_FORMAT,
        ALIGN_BYTES,
        bucket_bytes,
        [
            [
                [e.name, e.dtype, list(e.shape), e.offset, e.nbytes, e.tensor_offset]
                for e in b.entries
            ]
            for b in buckets
        ],
    ]
    return xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode(canonical))
