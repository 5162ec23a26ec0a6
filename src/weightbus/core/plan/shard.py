"""Where a rank's slice of a full Hugging Face tensor goes: one declarative copy per tensor.

Every tensor-parallel loader reduces to "take a range of the full tensor along one dimension
and copy it into a range of the parameter along one dimension". Spelling that out as data lets
other code than the loader apply it — a publisher writing straight into shared-memory
parameters, or a receiver copying a chunk of a tensor without reassembling it.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ShardCopy:
    """`param.narrow(dst_dim, dst_start, length) <- full.narrow(src_dim, src_start, length)`.

    With `dst_slot`, the parameter is first indexed on its leading dimension
    (`param[dst_slot]`, one dimension fewer) and then narrowed: how one expert's tensor of a
    mixture-of-experts checkpoint lands in its slot of a fused `[slots, ...]` parameter.
    """

    src_dim: int
    src_start: int
    dst_dim: int
    dst_start: int
    length: int
    dst_slot: int | None = None

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> "ShardCopy":
        """The whole tensor, unsplit (replicated parameters)."""
        return cls(0, 0, 0, 0, shape[0] if shape else 1)

    def source(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor (a view)."""
        return full.narrow(self.src_dim, self.src_start, self.length) if full.dim() else full

    def destination(self, param: torch.Tensor) -> torch.Tensor:
        """The part of the parameter the slice fills (a view)."""
        if self.dst_slot is not None:
            param = param[self.dst_slot]
        return param.narrow(self.dst_dim, self.dst_start, self.length) if param.dim() else param

    def apply(self, param: torch.Tensor, full: torch.Tensor) -> None:
        """Copy this rank's slice of `full` into `param` in place."""
        self.destination(param).copy_(self.source(full))


def check_full_shape(loaded_shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    """Raise ValueError unless the full tensor has the expected shape."""
    if tuple(loaded_shape) != tuple(expected):
        raise ValueError(f"shape mismatch: expected {tuple(expected)}, got {tuple(loaded_shape)}")
