"""The messages of the weight-update protocol.

Publisher -> receivers: `UpdateBegin`, one `BucketReady` per bucket, `UpdateEnd`, and
`UpdateCommit` or `UpdateAbort`. Receivers -> publisher: `SlotAck` per bucket and rank,
`RankVerdict` after verification. Either side may answer `ErrorReply`.
"""

from itertools import pairwise
from typing import Annotated, Literal

import msgspec

from weightbus.core.meta import DTYPES_BY_NAME, TensorMeta, dtype_from_name, dtype_name
from weightbus.core.plan.bucket import BucketEntry
from weightbus.core.wire.codec import Message, register

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
TensorName = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Version = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Hex128 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
Text = Annotated[str, msgspec.Meta(max_length=64 * 1024)]
DtypeName = Literal[tuple(DTYPES_BY_NAME)]  # type: ignore[valid-type]
Shape = Annotated[tuple[NonNegative, ...], msgspec.Meta(max_length=64)]
# How running requests meet an update (see the design), and how much a receiver checks.
PauseMode = Literal["drain", "in_place", "abort"]
VerifyLevel = Literal["full", "none"]


class WireEntry(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """A `BucketEntry` on the wire (a compact array: buckets may hold thousands)."""

    name: TensorName
    dtype: DtypeName
    shape: Shape
    offset: NonNegative
    nbytes: NonNegative
    tensor_offset: NonNegative = 0

    @classmethod
    def of(cls, entry: BucketEntry) -> "WireEntry":
        return cls(
            entry.name, entry.dtype, entry.shape, entry.offset, entry.nbytes, entry.tensor_offset
        )

    def to_entry(self) -> BucketEntry:
        return BucketEntry(
            self.name, self.dtype, tuple(self.shape), self.offset, self.nbytes, self.tensor_offset
        )


class WireMeta(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """A `TensorMeta` on the wire."""

    name: TensorName
    dtype: DtypeName
    shape: Shape

    @classmethod
    def of(cls, meta: TensorMeta) -> "WireMeta":
        return cls(meta.name, dtype_name(meta.dtype), meta.shape)

    def to_meta(self) -> TensorMeta:
        return TensorMeta(self.name, dtype_from_name(self.dtype), tuple(self.shape))


@register
class UpdateBegin(Message, kw_only=True):
    """A push session starts: which tensors, in which order, in buckets of which size.

    The receiver recomputes the plan from `tensors` and `bucket_bytes` and checks `plan_hash`.
    """

    session_id: Hex128
    version: Version
    step: NonNegative | None = None
    plan_hash: Hex128
    bucket_bytes: Annotated[int, msgspec.Meta(gt=0)]
    tensors: Annotated[list[WireMeta], msgspec.Meta(min_length=1)]
    direct: bool = False  # shm: the publisher writes into the ranks' parameters itself

    def __post_init__(self) -> None:
        names = [meta.name for meta in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("tensor names repeat")


@register
class BucketReady(Message, kw_only=True):
    """Bucket `bucket_index` is readable in `slot`; `digests` covers the tensors whose last
    byte is in this bucket."""

    session_id: Hex128
    bucket_index: NonNegative
    slot: NonNegative
    entries: list[WireEntry]
    digests: dict[TensorName, Hex128] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Entries must not overlap inside the slot: a lying sender could otherwise make one
        # tensor's bytes double as another's.
        spans = sorted((e.offset, e.offset + e.nbytes) for e in self.entries if e.nbytes)
        for (_, end), (start, _) in pairwise(spans):
            if start < end:
                raise ValueError(f"bucket {self.bucket_index}: entries overlap at byte {start}")


class ParamRegion(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One parameter of a rank, at `offset` bytes into the rank's shared-memory file."""

    name: TensorName
    dtype: DtypeName
    shape: Shape
    offset: NonNegative


class WireShardCopy(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Where a rank's slice of a full tensor goes: `param.narrow(dim, dst_start, length) <-
    full.narrow(dim, src_start, length)` (a `ShardCopy` on the wire; 0-d tensors are copied
    whole); with `slot`, into `param[slot]` (one expert's slot of a fused expert parameter)."""

    hf_name: TensorName
    param: TensorName
    dim: Annotated[int, msgspec.Meta(ge=0, le=63)]
    src_start: NonNegative
    dst_start: NonNegative
    length: NonNegative
    slot: NonNegative | None = None


class DirectTarget(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A rank's parameters in a shared-memory file the publisher may write into (direct mode).

    `layout_hash` identifies `params`, `copies` and `absent`: the publisher validates and
    compiles a layout once and reuses it while the hash and the file stay the same.
    """

    file: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    nbytes: Annotated[int, msgspec.Meta(gt=0)]
    layout_hash: Hex128
    params: list[ParamRegion]
    copies: list[WireShardCopy]
    # the model's tensors this rank holds no part of (an expert-parallel rank: the experts of
    # the others): it takes none of their bytes
    absent: list[TensorName] = msgspec.field(default_factory=list)

    def named(self) -> set[str]:
        """The tensors the offer names: those the rank holds a slice of, and those it holds
        none of (`absent`)."""
        return {copy.hf_name for copy in self.copies} | set(self.absent)


@register
class ReceiverHello(Message, kw_only=True):
    """A receiver rank joins a push session (streaming transports).

    `group` tells the engines apart (the publisher numbers them); `tp_size` says how many ranks
    of that engine will join. `direct`, when set, offers the rank's parameters for direct
    writes; the publisher uses direct mode only when every rank of the session offers it.
    """

    session_id: Hex128
    group: NonNegative
    rank: NonNegative
    tp_size: Annotated[int, msgspec.Meta(ge=1)]
    direct: DirectTarget | None = None


@register
class DirectReady(Message, kw_only=True):
    """Direct mode: the rank has the session's header, so it counts its parameters as written
    from now on. The publisher writes into a rank's parameters only after this: a publisher
    that dies mid-write can then never leave a rank serving bytes it does not know about."""

    session_id: Hex128
    group: NonNegative
    rank: NonNegative


@register
class TensorsWritten(Message, kw_only=True):
    """Direct mode: the publisher wrote these tensors' slices into the rank's parameters.

    `digests` are the full tensors' digests (they make the fingerprint); `slice_digests` the
    digests of the bytes written into this rank's parameter regions, which the rank re-reads
    to verify.
    """

    session_id: Hex128
    bucket_index: NonNegative
    digests: dict[TensorName, Hex128]
    slice_digests: dict[TensorName, Hex128]


@register
class SlotAck(Message, kw_only=True):
    """A receiver rank is done with a slot: the sender may overwrite it."""

    session_id: Hex128
    bucket_index: NonNegative
    slot: NonNegative
    rank: NonNegative
    group: NonNegative = 0


@register
class UpdateEnd(Message, kw_only=True):
    """Every bucket was sent; `fingerprint` is the publisher's fingerprint of the version."""

    session_id: Hex128
    version: Version
    num_buckets: NonNegative
    fingerprint: Hex128


@register
class RankVerdict(Message, kw_only=True):
    """One rank's verification result for a session; `nbytes`: the bytes that reached this
    rank through the transport (`RankResult.nbytes`)."""

    session_id: Hex128
    rank: NonNegative
    ok: bool
    errors: list[Text] = msgspec.field(default_factory=list)
    names: list[TensorName] = msgspec.field(default_factory=list)
    timed_out: bool = False
    touched: bool = False
    fingerprint: Hex128 | None = None
    nbytes: NonNegative = 0


@register
class UpdateCommit(Message, kw_only=True):
    """All ranks verified: make `version` the serving version."""

    session_id: Hex128
    version: Version
    fingerprint: Hex128


@register
class UpdateAbort(Message, kw_only=True):
    """Discard what this session delivered; `reason` says why."""

    session_id: Hex128
    reason: Text


@register
class ErrorReply(Message, kw_only=True):
    """A request could not be served; `names` lists the offending tensors, if any."""

    code: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    message: Text
    names: list[TensorName] = msgspec.field(default_factory=list)


# --- dist transport ---


class SliceSpec(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Rows `[start, start + length)` along `dim` of tensor `name`: the part one rank loads."""

    name: TensorName
    dim: Annotated[int, msgspec.Meta(ge=0, le=63)]
    start: NonNegative
    length: NonNegative


@register
class RankLayout(Message, kw_only=True):
    """An engine rank joined a `dist` weights group: which slice of each tensor it loads.

    Sent once per group to the publisher (group rank 0): in `parts` mode each rank receives
    only its slices. A tensor without a slice is sent whole.
    """

    group_rank: Annotated[int, msgspec.Meta(ge=1)]
    tp_rank: NonNegative
    tp_size: Annotated[int, msgspec.Meta(ge=1)]
    slices: list[SliceSpec]


class SentPart(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """`dist` parts: trainer (group) rank `src` sends rows `[row_start, row_stop)` x
    columns `[col_start, col_stop)` of the receiving rank's region `entry` of a bucket (the
    region seen as a matrix, `slices.region_matrix`)."""

    src: NonNegative
    entry: NonNegative
    row_start: NonNegative
    row_stop: NonNegative
    col_start: NonNegative
    col_stop: NonNegative


@register
class BucketSent(Message, kw_only=True):
    """`dist`: bucket `bucket_index` follows on the group, as one collective.

    `digests` covers the tensors whose last byte is in this bucket; in `parts` mode `parts`
    maps each receiving group rank to what each trainer rank sends it (each sender's bytes end
    with their xxh3-128).
    """

    session_id: Hex128
    bucket_index: NonNegative
    digests: dict[TensorName, Hex128] = msgspec.field(default_factory=dict)
    parts: dict[NonNegative, list[SentPart]] = msgspec.field(default_factory=dict)
