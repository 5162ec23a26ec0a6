"""Flat buckets: many tensors of mixed dtypes packed into one `uint8` buffer.

An entry says where a tensor (or one chunk of a tensor larger than a bucket) lives in the
buffer. Entries start on 256-byte boundaries so every typed view is aligned for any dtype and
for vectorised copies.

`pack_entry` is the one pack routine of every sink (a bucket, an `shm` slot, a `nixl` send
buffer): it lives here, below the transports, so the plan's own `pack_entries` uses it too.
`pack_rows`, its copy loop, can also refuse NaN/inf chunk by chunk (`weightbus.core.finite`),
reading each chunk while it is still in cache instead of in a separate pass.
"""

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
import torch

from weightbus.core.finite import refuse_nonfinite_chunk
from weightbus.core.meta import TensorMeta, dtype_from_name, dtype_name

ALIGN_BYTES = 256
# Rows copied and digested together: small enough that the digest reads them from cache.
CHUNK_BYTES = 4 << 20

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# `pack_rows`' unit of work: rows [low, high) -> (destination or None, source) or None, and
# the hasher of what it copies (or None).
RowViews = Callable[[int, int], "tuple[torch.Tensor | None, torch.Tensor] | None"]
RowPart = tuple[RowViews, Any]
# Called by `pack_rows` with each chunk's rows [low, high) once they are copied; raising stops it.
RowCheck = Callable[[int, int], None]


def align_up(nbytes: int, align_bytes: int = ALIGN_BYTES) -> int:
    """Smallest multiple of `align_bytes` that is >= `nbytes`."""
    return -(-nbytes // align_bytes) * align_bytes


@dataclass(frozen=True, slots=True)
class BucketEntry:
    """One tensor, or one chunk of it, inside a flat bucket.

    Attributes:
        name: tensor name.
        dtype: wire dtype name (see `weightbus.core.meta`).
        shape: shape of the whole tensor.
        offset: byte offset of this entry in the bucket buffer (a multiple of 256).
        nbytes: bytes of this entry in the bucket.
        tensor_offset: byte offset of this entry inside the tensor's contiguous bytes;
            0 with `nbytes == tensor_nbytes` when the entry holds the whole tensor.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    tensor_offset: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def tensor_nbytes(self) -> int:
        return prod(self.shape) * self.torch_dtype.itemsize

    @property
    def is_chunk(self) -> bool:
        """True when the entry holds only part of its tensor."""
        return self.tensor_offset != 0 or self.nbytes != self.tensor_nbytes

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def layout_entries(metas: Iterable[TensorMeta]) -> tuple[list[BucketEntry], int]:
    """Entries for whole tensors packed back to back at aligned offsets.

    Returns:
        The entries and the buffer bytes they need.
    """
    entries: list[BucketEntry] = []
    offset = 0
    for meta in metas:
        offset = align_up(offset)
        entries.append(
            BucketEntry(meta.name, dtype_name(meta.dtype), meta.shape, offset, meta.nbytes)
        )
        offset += meta.nbytes
    return entries, offset


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """Flat `uint8` view of a contiguous tensor's bytes (no copy; works for 0-d tensors)."""
    assert tensor.is_contiguous(), "byte_view needs a contiguous tensor"
    return tensor.reshape(-1).view(torch.uint8)


def entry_view(buffer: torch.Tensor, entry: BucketEntry) -> torch.Tensor:
    """Zero-copy view of an entry inside a buffer.

    A whole tensor comes back with its dtype and shape; a chunk comes back as its `uint8` bytes,
    to be placed at `entry.tensor_offset` of the destination's bytes.
    """
    raw = buffer[entry.offset : entry.end]
    if entry.is_chunk:
        return raw
    return raw.view(entry.torch_dtype).view(entry.shape)


def _validate_buffer(buffer: torch.Tensor, required_bytes: int, device: torch.device) -> None:
    if buffer.dim() != 1:
        raise ValueError(f"bucket buffer must be 1-D, got shape {tuple(buffer.shape)}")
    if buffer.dtype != torch.uint8:
        raise ValueError(f"bucket buffer must have dtype torch.uint8, got {buffer.dtype}")
    if not buffer.is_contiguous():
        raise ValueError("bucket buffer must be contiguous")
    if buffer.device != device:
        raise ValueError(f"bucket buffer is on {buffer.device} but the tensors are on {device}")
    if buffer.numel() < required_bytes:
        raise ValueError(
            f"bucket buffer too small: the tensors need {required_bytes} bytes, "
            f"the buffer has {buffer.numel()}"
        )


def _chunk_source(tensor: torch.Tensor, entry: BucketEntry) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The part of `tensor` a chunk entry holds, and the shape to view the chunk's bytes as."""
    row_bytes = TensorMeta.of(entry.name, tensor).row_bytes
    if tensor.dim() > 0 and entry.tensor_offset % row_bytes == 0 and entry.nbytes % row_bytes == 0:
        # Row-aligned chunks (the planner's choice whenever a row fits a bucket) are views,
        # so even a non-contiguous source is packed without an intermediate copy.
        first_row = entry.tensor_offset // row_bytes
        num_rows = entry.nbytes // row_bytes
        return tensor[first_row : first_row + num_rows], (num_rows, *entry.shape[1:])
    # Rows larger than a bucket: element ranges of the flattened tensor (a copy only when
    # the source is not contiguous).
    element_bytes = tensor.element_size()
    first = entry.tensor_offset // element_bytes
    count = entry.nbytes // element_bytes
    return tensor.reshape(-1)[first : first + count], (count,)


def copy_elements(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy through numpy (same-sized integers, so bf16/fp8 too): one thread, GIL released, so
    a pool of copies runs on every core without oversubscribing them."""
    int_dtype = _INT_OF_SIZE.get(source.element_size())
    if int_dtype is None:  # complex128: no 16-byte integer
        destination.copy_(source)
        return
    np.copyto(destination.view(int_dtype).numpy(), source.view(int_dtype).numpy())


def row_major_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes in row-major order (in place when contiguous), for digests."""
    return byte_view(tensor if tensor.is_contiguous() else tensor.contiguous()).numpy()


def pack_rows(
    first_row: int,
    end_row: int,
    row_bytes: int,
    parts: Sequence[RowPart],
    check_rows: RowCheck | None = None,
) -> None:
    """Copy and digest rows `[first_row, end_row)` for every part, `CHUNK_BYTES` of rows at a
    time, so each digest reads the rows its copy just wrote while they are still in cache.

    A part is `(views, hasher)`: `views(low, high)` gives `(destination, source)` for rows
    `[low, high)` (None: the part has none of them; destination None: digest `source` only);
    `hasher` (anything with `update(bytes)`, or None) digests the destination's bytes.
    `check_rows(low, high)`, when given, runs after each chunk's parts, while its rows are still
    in cache (the NaN/inf check: measured cheaper there than before the copy); what it raises
    stops the loop.
    """
    rows_per_chunk = max(1, CHUNK_BYTES // max(1, row_bytes))
    for low in range(first_row, end_row, rows_per_chunk):
        high = min(low + rows_per_chunk, end_row)
        _pack_chunk(low, high, parts)
        if check_rows is not None:
            check_rows(low, high)


def _pack_chunk(low: int, high: int, parts: Sequence[RowPart]) -> None:
    """Copy and digest rows `[low, high)` for every part (one chunk of `pack_rows`)."""
    for views, hasher in parts:
        pair = views(low, high)
        if pair is None:
            continue
        destination, source = pair
        if destination is not None:
            copy_elements(destination, source)
        if hasher is not None:
            hasher.update(row_major_bytes(source if destination is None else destination))


def nonfinite_row_check(name: str, rows: torch.Tensor) -> RowCheck | None:
    """A `pack_rows` check that refuses NaN/inf in `rows[low:high]` of tensor `name` (None for
    a tensor that holds no floating values, so cannot hold any).

    Raises (when called):
        NonFiniteWeightsError: those rows hold NaN or inf.
    """
    if not rows.is_floating_point():
        return None
    return lambda low, high: refuse_nonfinite_chunk(name, rows[low:high] if rows.dim() else rows)


def digest_part(full: torch.Tensor, hasher: Any) -> RowPart:
    """A `pack_rows` part that copies nothing: it digests `full`'s rows (a tensor's digest
    while its slices are copied elsewhere, from the same rows in cache)."""
    return (lambda low, high: (None, full[low:high] if full.dim() else full)), hasher


def _entry_views(
    destination: torch.Tensor, entry: BucketEntry, tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Typed `(destination, source)` views of an entry, at least 1-D so rows can be walked."""
    source, shape = _chunk_source(tensor, entry) if entry.is_chunk else (tensor, entry.shape)
    typed = destination.view(entry.torch_dtype).view(shape)
    if typed.dim() == 0:
        return typed.view(1), source.reshape(1)
    return typed, source


def pack_entry(
    destination: torch.Tensor,
    entry: BucketEntry,
    tensor: torch.Tensor,
    hasher: Any = None,
    *,
    pooled: bool = True,
    refuse_nonfinite: bool = False,
) -> None:
    """Copy `entry`'s bytes of `tensor` into `destination` (its `entry.nbytes` bytes of a
    buffer), digesting them into `hasher` (when given) chunk by chunk as they land.

    The one pack routine of every sink. `pooled` (the caller packs many entries at once on its
    own pool): CPU copies are single-threaded and GIL-free (`copy_elements`). Not pooled, a copy
    with nothing to digest is one `copy_` on torch's threads (every core, memcpy speed). Other
    devices get one `copy_` (digested afterwards). With `refuse_nonfinite`, each chunk is
    checked for NaN/inf once copied (the copy stops at the first bad one).

    Raises:
        ValueError: the tensor's dtype/shape differ from its entry.
        NonFiniteWeightsError: `refuse_nonfinite` and the entry holds NaN or inf.
    """
    check_entry_tensor(entry, tensor)
    if entry.nbytes == 0:
        return
    typed, source = _entry_views(destination, entry, tensor.detach())
    on_cpu = typed.device.type == "cpu" and source.device.type == "cpu"
    if not on_cpu or (hasher is None and not pooled):
        typed.copy_(source)  # copy_ into the typed view packs non-contiguous sources in place
        if hasher is not None:
            hasher.update(row_major_bytes(typed))
        if refuse_nonfinite:
            refuse_nonfinite_chunk(entry.name, typed)
        return
    row_bytes = typed[0].nbytes if len(typed) else 1
    part = (lambda low, high: (typed[low:high], source[low:high]), hasher)
    check = nonfinite_row_check(entry.name, source) if refuse_nonfinite else None
    pack_rows(0, len(typed), row_bytes, [part], check)


def pack_entries(
    buffer: torch.Tensor,
    entries: Sequence[BucketEntry],
    tensors: Mapping[str, torch.Tensor],
) -> None:
    """Copy each entry's bytes from `tensors[entry.name]` into `buffer`.

    Raises:
        ValueError: a tensor is missing or its dtype/shape differ from its entry.
    """
    for entry in entries:
        tensor = tensors.get(entry.name)
        if tensor is None:
            raise ValueError(f"tensor {entry.name!r} is in the plan but was not given")
        pack_entry(buffer[entry.offset : entry.end], entry, tensor, pooled=False)


def check_entry_tensor(entry: BucketEntry, tensor: torch.Tensor) -> None:
    """Raise ValueError unless `tensor` has the dtype and shape its entry planned."""
    if tensor.dtype != entry.torch_dtype or tuple(tensor.shape) != entry.shape:
        raise ValueError(
            f"tensor {entry.name!r}: planned {entry.dtype}{list(entry.shape)}, "
            f"got {dtype_name(tensor.dtype)}{list(tensor.shape)}"
        )


@dataclass(slots=True)
class FlatBucket:
    """A flat `uint8` buffer and the entries that describe its contents.

    Build one with `FlatBucket.pack(named_tensors)`; read it back with `unpack()`.
    """

    buffer: torch.Tensor
    entries: list[BucketEntry]

    @classmethod
    def pack(
        cls,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        buffer: torch.Tensor | None = None,
    ) -> "FlatBucket":
        """Pack tensors, in order, into one flat buffer.

        Args:
            named_tensors: `(name, tensor)` pairs; dtypes may differ; 0-d, empty and
                non-contiguous tensors are accepted (packed as contiguous). All on one device.
            buffer: optional preallocated 1-D contiguous `uint8` buffer on the tensors' device,
                large enough for them; it is written in place and no new buffer is allocated.

        Returns:
            The bucket; `bucket.buffer` is `buffer` itself when one was given.

        Raises:
            ValueError: duplicate names, mixed devices, an unsupported dtype, or an unusable
                `buffer` (not 1-D, not uint8, not contiguous, wrong device, too small).
        """
        pairs = list(named_tensors)
        metas = [TensorMeta.of(name, tensor) for name, tensor in pairs]
        tensors = dict(pairs)
        if len(tensors) != len(pairs):
            duplicates = sorted(n for n, count in Counter(n for n, _ in pairs).items() if count > 1)
            raise ValueError(f"duplicate tensor names: {duplicates}")
        devices = {tensor.device for tensor in tensors.values()}
        if len(devices) > 1:
            raise ValueError(f"tensors are on several devices: {sorted(map(str, devices))}")
        device = devices.pop() if devices else torch.device("cpu")
        entries, required_bytes = layout_entries(metas)
        if buffer is None:
            buffer = torch.empty(required_bytes, dtype=torch.uint8, device=device)
        else:
            _validate_buffer(buffer, required_bytes, device)
        pack_entries(buffer, entries, tensors)
        return cls(buffer, entries)

    @property
    def nbytes(self) -> int:
        """Bytes in use (end of the last entry)."""
        return max((entry.end for entry in self.entries), default=0)

    def unpack(self) -> list[tuple[str, torch.Tensor]]:
        """Zero-copy views of the packed tensors, in packing order.

        Whole tensors come back with their dtype and shape; chunks as `uint8` bytes.
        """
        return [(entry.name, entry_view(self.buffer, entry)) for entry in self.entries]
