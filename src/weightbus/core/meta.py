"""Tensor metadata and the dtype names used on the wire."""

from collections.abc import Iterable
from dataclasses import dataclass
from math import prod

import torch

# Stable wire names, in the order torch spells them. Newer float8/float4 dtypes are included
# only when the installed torch offers them, so an older torch still imports this module.
_WIRE_DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "complex128",
    "complex64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
)

DTYPES_BY_NAME: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _WIRE_DTYPE_NAMES if hasattr(torch, name)
}
NAMES_BY_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES_BY_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype.

    Raises:
        ValueError: the dtype has no wire name (quantized and sub-byte dtypes are not supported).
    """
    try:
        return NAMES_BY_DTYPE[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {dtype}; supported: {', '.join(DTYPES_BY_NAME)}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """Torch dtype of a wire name.

    Raises:
        ValueError: the name is unknown to this torch build.
    """
    try:
        return DTYPES_BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"unknown dtype name {name!r}; supported: {', '.join(DTYPES_BY_NAME)}"
        ) from None


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Name, dtype and shape of one tensor: all a plan needs to know about it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tensor name must be a non-empty string, got {self.name!r}")
        dtype_name(self.dtype)
        if any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: invalid shape {self.shape}")

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorMeta":
        """Metadata of a tensor."""
        return cls(name, tensor.dtype, tuple(tensor.shape))

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def element_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_bytes

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along dim 0 (the whole tensor for 0-d tensors)."""
        if not self.shape:
            return self.element_bytes
        return prod(self.shape[1:]) * self.element_bytes


def metas_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    """Metadata of named tensors, in order.

    Raises:
        ValueError: a name appears twice.
    """
    metas: list[TensorMeta] = []
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r}")
        seen.add(name)
        metas.append(TensorMeta.of(name, tensor))
    return metas


# A push may carry a draft model (speculative decoding) with its main model, as one version:
# the draft's tensors under this prefix + their own Hugging Face names.
DRAFT_PREFIX = "draft."


def is_draft_name(name: str) -> bool:
    """Whether a pushed tensor belongs to the draft model."""
    return name.startswith(DRAFT_PREFIX)
