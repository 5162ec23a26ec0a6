"""LoRA on the tensor-parallel linear layers, applied unmerged: `y = base(x) + (B (A x)) * s`.

Each adapted Hugging Face projection is a `LoraPart` of the layer that holds it (fused layers
hold several: q, k, v in `qkv_proj`; gate, up in `gate_up_proj`), sliced as the base layer is
(vLLM's rule): on a column-parallel layer every rank holds A whole and the rows of B its
output rows need; on a row-parallel layer every rank holds the columns of A its input columns
need and B whole, and adds its partial `B (A_rank x_rank)` before the all-reduce, so the sum
over ranks is `B (A x)`. Each part's slice of a pushed tensor is a `ShardCopy`, as for the
weights, so every transport places adapter slices like any others.

Unmerged, because an RL adapter changes every step: a push writes only the adapter's
`r * (in + out)` elements per projection and the base stays bit-exact, while merging would
rewrite every adapted base matrix per push and round `W + s B A` to the serving dtype
(docs/lora.md measures both). The price is two thin matmuls per adapted projection per step.

`LoraState` says whether the model applies its adapter and with which scale; each served model
(live and staging) has one, swapped with the parameters.
"""

import torch
from torch import nn
from torch.nn.functional import linear

from weightbus.core.plan.shard import ShardCopy, check_full_shape


class LoraState:
    """Whether a model applies its adapter (`active`) and the scale `s` of `B @ A`."""

    def __init__(self) -> None:
        self.active = False
        self.scaling = 0.0

    def set(self, active: bool, scaling: float) -> None:
        self.active, self.scaling = active, scaling

    def swap(self, other: "LoraState") -> None:
        """Exchange states with `other` (the parameters' swap moves the adapters)."""
        self.active, other.active = other.active, self.active
        self.scaling, other.scaling = other.scaling, self.scaling


class LoraPart(nn.Module):
    """One projection's adapter on this rank: A and B slices, where they come from in the
    pushed `(r, in)` and `(out, r)` matrices, and the rows of the layer's output it adds to.

    Args:
        a_full, b_full: the full shapes of the pushed A and B.
        a_copy, b_copy: this rank's slice of each (`ShardCopy`, destination its own parameter).
        rows: `(start, length)` of the layer's local output this projection fills.
        dtype: what A and B are held in (the input is cast to it, as peft does).
    """

    def __init__(
        self,
        a_full: tuple[int, int],
        b_full: tuple[int, int],
        a_copy: ShardCopy,
        b_copy: ShardCopy,
        *,
        rows: tuple[int, int],
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.full_shapes = {"lora_A": a_full, "lora_B": b_full}
        self.copies = {"lora_A": a_copy, "lora_B": b_copy}
        a_local, b_local = _local(a_full, a_copy), _local(b_full, b_copy)
        self.lora_A = nn.Parameter(torch.zeros(a_local, dtype=dtype), requires_grad=False)
        self.lora_B = nn.Parameter(torch.zeros(b_local, dtype=dtype), requires_grad=False)
        for param in (self.lora_A, self.lora_B):
            param.weight_loader = self.weight_loader
        self.rows = rows

    def shard_copy(self, param: nn.Parameter, full_shape: tuple[int, ...]) -> ShardCopy:
        """Where this rank's slice of the pushed `lora_A` / `lora_B` goes.

        Raises:
            ValueError: `full_shape` is not the matrix's (another rank or input size).
        """
        which = "lora_A" if param is self.lora_A else "lora_B"
        check_full_shape(full_shape, self.full_shapes[which])
        return self.copies[which]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's slice of the pushed matrix into `param`, in place."""
        self.shard_copy(param, tuple(loaded.shape)).apply(param.data, loaded)

    def delta(self, x: torch.Tensor, scaling: float) -> torch.Tensor:
        """`(B (A x)) * scaling` in the adapter's dtype, peft's order of operations (the caller
        adds it to the layer's output, rounded to the output's dtype as peft does)."""
        return linear(linear(x.to(self.lora_A.dtype), self.lora_A), self.lora_B) * scaling


def _local(full: tuple[int, int], copy: ShardCopy) -> tuple[int, int]:
    shape = list(full)
    shape[copy.dst_dim] = copy.length
    return shape[0], shape[1]


def column_part(
    rank: int, in_features: int, b_rows: ShardCopy, b_full_rows: int, dtype: torch.dtype
) -> LoraPart:
    """The adapter of a column-parallel projection: A whole, the rows `b_rows` of B (the
    base layer's own slice of that projection's weight, with its offset in the output)."""
    a_full, b_full = (rank, in_features), (b_full_rows, rank)
    b_copy = ShardCopy(0, b_rows.src_start, 0, 0, b_rows.length)
    rows = (b_rows.dst_start, b_rows.length)
    return LoraPart(a_full, b_full, ShardCopy.whole(a_full), b_copy, rows=rows, dtype=dtype)


def row_part(
    rank: int, out_features: int, a_cols: ShardCopy, a_full_cols: int, dtype: torch.dtype
) -> LoraPart:
    """The adapter of a row-parallel projection: the columns `a_cols` of A (the base layer's
    slice of its input), B whole."""
    a_full, b_full = (rank, a_full_cols), (out_features, rank)
    a_copy = ShardCopy(1, a_cols.src_start, 1, 0, a_cols.length)
    whole_b = ShardCopy.whole(b_full)
    return LoraPart(a_full, b_full, a_copy, whole_b, rows=(0, out_features), dtype=dtype)
