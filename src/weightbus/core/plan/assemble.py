"""Receiver side of a plan: turn bucket buffers back into `(name, tensor)` pairs."""

from collections.abc import Iterator

import torch

from weightbus.core.plan.bucket import BucketEntry, byte_view, entry_view
from weightbus.core.plan.planner import BucketPlan


class _Pending:
    __slots__ = ("ranges", "received_bytes", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.received_bytes = 0
        self.ranges: list[tuple[int, int]] = []

    def claim(self, name: str, start: int, stop: int) -> None:
        """Record bytes [start, stop) as received; each byte may arrive only once."""
        for seen_start, seen_stop in self.ranges:
            if start < seen_stop and seen_start < stop:
                raise ValueError(
                    f"chunk of {name!r} at bytes [{start}, {stop}) overlaps one already received"
                )
        self.ranges.append((start, stop))
        self.received_bytes += stop - start


class ChunkAssembler:
    """Reassembles tensors that a plan split into chunks across several buckets.

    Chunks are copied into a tensor allocated on the first chunk; the tensor is handed out when
    its last byte has arrived. Each chunk must arrive exactly once.

    Args:
        device: where assembled tensors live.
        buffers: optional cache of assembly tensors by `(name, dtype, shape)`, reused across
            sessions so repeated pushes never fault in fresh memory. A reused tensor is
            overwritten by the next session: consume it before then.
    """

    def __init__(
        self, device: torch.device | str = "cpu", buffers: dict[tuple, torch.Tensor] | None = None
    ) -> None:
        self.device = torch.device(device)
        self._buffers = buffers
        self._pending: dict[str, _Pending] = {}

    def _allocate(self, entry: BucketEntry) -> torch.Tensor:
        if self._buffers is None:
            return torch.empty(entry.shape, dtype=entry.torch_dtype, device=self.device)
        key = (entry.name, entry.dtype, entry.shape)
        tensor = self._buffers.get(key)
        if tensor is None:
            tensor = torch.empty(entry.shape, dtype=entry.torch_dtype, device=self.device)
            self._buffers[key] = tensor
        return tensor

    @property
    def pending_names(self) -> list[str]:
        """Tensors with some but not all chunks received."""
        return sorted(self._pending)

    def add(self, entry: BucketEntry, chunk: torch.Tensor) -> torch.Tensor | None:
        """Place one chunk; returns the whole tensor once its last chunk arrived, else None.

        Raises:
            ValueError: the chunk lies outside its tensor, overlaps one received before, or its
                size differs from its entry.
        """
        if chunk.numel() != entry.nbytes or chunk.dtype != torch.uint8:
            raise ValueError(f"chunk of {entry.name!r}: expected {entry.nbytes} uint8 bytes")
        if entry.tensor_offset < 0 or entry.tensor_offset + entry.nbytes > entry.tensor_nbytes:
            raise ValueError(
                f"chunk of {entry.name!r} at byte {entry.tensor_offset} (+{entry.nbytes}) "
                f"lies outside the tensor's {entry.tensor_nbytes} bytes"
            )
        pending = self._pending.get(entry.name)
        if pending is None:
            pending = self._pending[entry.name] = _Pending(self._allocate(entry))
        start, stop = entry.tensor_offset, entry.tensor_offset + entry.nbytes
        pending.claim(entry.name, start, stop)
        byte_view(pending.tensor)[start:stop].copy_(chunk)
        if pending.received_bytes < entry.tensor_nbytes:
            return None
        del self._pending[entry.name]
        return pending.tensor


def unpack_bucket(
    bucket: BucketPlan, buffer: torch.Tensor, assembler: ChunkAssembler
) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors completed by one bucket: zero-copy views for whole tensors, reassembled
    tensors for the last chunk of a split one.

    The views alias `buffer`: consume them before the buffer is reused.
    """
    for entry in bucket.entries:
        view = entry_view(buffer, entry)
        if not entry.is_chunk:
            yield entry.name, view
            continue
        tensor = assembler.add(entry, view)
        if tensor is not None:
            yield entry.name, tensor
