"""Bit-wise element access for every wire dtype: tensors seen as rows of same-sized integers.

A float is compared, gathered and scattered through an integer view of its bytes, so `-0.0`
differs from `0.0`, every NaN payload is kept, and float8 / float4 types (which torch cannot
index) work like any other. An element of 16 bytes (complex128) is a row of two int64 words.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Elements compared per task: small enough to stay in cache, large enough to amortise a task.
CHUNK_ELEMENTS = 1 << 21


def element_words(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's elements as an `(numel, words)` integer view (no copy)."""
    size = tensor.element_size()
    word_dtype = _INT_OF_SIZE[min(size, 8)]
    return tensor.reshape(-1).view(word_dtype).view(-1, max(size // 8, 1))


def index_dtype(numel: int) -> torch.dtype:
    """The narrowest index type that addresses `numel` elements."""
    return torch.int32 if numel < 2**31 else torch.int64


def changed_indices(
    base: torch.Tensor, new: torch.Tensor, pool: ThreadPoolExecutor | None = None
) -> torch.Tensor:
    """Flat indices, increasing, of the elements whose bits differ between two contiguous
    tensors of one dtype and shape (compared in chunks, on `pool` when given)."""
    old_words, new_words = element_words(base).numpy(), element_words(new).numpy()
    numel = old_words.shape[0]
    out_dtype = np.int32 if index_dtype(numel) == torch.int32 else np.int64

    def chunk(start: int) -> np.ndarray:
        stop = min(start + CHUNK_ELEMENTS, numel)
        differs = old_words[start:stop] != new_words[start:stop]
        found = np.flatnonzero(differs.any(axis=1) if differs.shape[1] > 1 else differs)
        return (found + start).astype(out_dtype, copy=False)

    starts = range(0, numel, CHUNK_ELEMENTS)
    parts = list(pool.map(chunk, starts)) if pool is not None else [chunk(s) for s in starts]
    return torch.from_numpy(np.concatenate(parts) if parts else np.empty(0, out_dtype))


def gather(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The elements of a contiguous tensor at flat `indices`, as a 1-D tensor of its dtype."""
    words = element_words(tensor)[indices.long()]
    return words.view(-1).view(tensor.dtype)


def scatter(destination: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """`destination.flat[indices] = values`, bit-exact; `destination` may be a strided view
    (a rank's column slice), whose elements are then addressed in row-major order."""
    if destination.is_contiguous():
        element_words(destination)[indices.long()] = element_words(values)
        return
    coords = torch.unravel_index(indices.long(), destination.shape)
    if destination.element_size() > 8:  # complex128: torch indexes it natively, bit-exact
        destination[coords] = values
        return
    word_dtype = _INT_OF_SIZE[destination.element_size()]
    destination.view(word_dtype)[coords] = values.view(word_dtype)
