"""Byte copies and reads shared by the transports that write ranks' slices themselves."""

import numpy as np
import torch

from weightbus.core.plan.bucket import byte_view

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_elements(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy through numpy (same-sized integers, so bf16/fp8 too): one thread, GIL released."""
    int_dtype = _INT_OF_SIZE.get(source.element_size())
    if int_dtype is None:  # complex128: no 16-byte integer
        destination.copy_(source)
        return
    np.copyto(destination.view(int_dtype).numpy(), source.view(int_dtype).numpy())


def row_major_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes in row-major order (in place when contiguous), for digests."""
    return byte_view(tensor if tensor.is_contiguous() else tensor.contiguous()).numpy()
