"""Tensor-parallel linear layers (vLLM's names) and their weight loaders.

Column-parallel layers split the output features over ranks, row-parallel layers split the input
features and sum the partial products. Fused layers (`QKVParallelLinear`,
`MergedColumnParallelLinear`) hold several Hugging Face matrices stacked along the output
dimension; their loader takes a `shard_id` that says which one arrives. Every loader checks the
full (unsharded) shape, then applies its `shard_copy` (`plan/shard.py`): its rank's slice is
copied into the existing parameter storage, never reallocated and never aliased.
"""

import torch
from torch import nn
from torch.nn.functional import linear

from weightbus.core.plan.shard import ShardCopy, check_full_shape
from weightbus.engines.reference.layers.parallel import all_reduce, divide, get_tp


def _new_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LinearBase(nn.Module):
    """A linear layer whose weight is `[output_size, input_size]` of this rank's shard."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool) -> None:
        super().__init__()
        ctx = get_tp()
        self.tp_rank, self.tp_size = ctx.tp_rank, ctx.tp_size
        self.weight = _new_param(output_size, input_size)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _new_param(output_size)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def shard_copy(
        self, param: nn.Parameter, full_shape: tuple[int, ...], shard_id: str | int | None = None
    ) -> ShardCopy:
        """Where this rank's slice of a full tensor of `full_shape` goes in `param`.

        Raises:
            ValueError: `full_shape` is not what this parameter is a slice of.
        """
        raise NotImplementedError

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        """Copy this rank's slice of the full tensor `loaded` into `param`, in place."""
        self.shard_copy(param, tuple(loaded.shape), shard_id).apply(param.data, loaded)


class ColumnParallelLinear(LinearBase):
    """`y = x W^T + b` with W's rows (output features) split over ranks; no gather."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False) -> None:
        tp_size = get_tp().tp_size
        super().__init__(input_size, divide(output_size, tp_size, "output features"), bias=bias)

    def shard_copy(
        self, param: nn.Parameter, full_shape: tuple[int, ...], shard_id: str | int | None = None
    ) -> ShardCopy:
        shard_size = param.shape[0]
        check_full_shape(full_shape, (shard_size * self.tp_size, *param.shape[1:]))
        return ShardCopy(0, self.tp_rank * shard_size, 0, 0, shard_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked along the output (e.g. gate and up).

    Each rank holds `[shard of matrix 0; shard of matrix 1; ...]`.
    """

    def __init__(self, input_size: int, output_sizes: list[int], *, bias: bool = False) -> None:
        tp_size = get_tp().tp_size
        for size in output_sizes:
            divide(size, tp_size, "output features")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias=bias)

    def shard_copy(
        self, param: nn.Parameter, full_shape: tuple[int, ...], shard_id: str | int | None = None
    ) -> ShardCopy:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"unknown merged shard id {shard_id!r}")
        full_size = self.output_sizes[shard_id]
        shard_size = full_size // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        check_full_shape(full_shape, (full_size, *param.shape[1:]))
        return ShardCopy(0, self.tp_rank * shard_size, 0, offset, shard_size)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections split by attention heads.

    Query heads are split over ranks. Key/value heads are split too when there are at least
    `tp_size` of them; otherwise each rank holds one KV head, replicated on
    `tp_size // total_num_kv_heads` consecutive ranks (vLLM's rule).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        *,
        bias: bool = False,
    ) -> None:
        tp_size = get_tp().tp_size
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        else:
            if tp_size % total_num_kv_heads:
                raise ValueError(
                    f"tp_size ({tp_size}) is not a multiple of num_key_value_heads "
                    f"({total_num_kv_heads})"
                )
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp_size // total_num_kv_heads
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias=bias)

    @property
    def q_size(self) -> int:
        """Query features on this rank."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Key (or value) features on this rank."""
        return self.num_kv_heads * self.head_dim

    def shard_copy(
        self, param: nn.Parameter, full_shape: tuple[int, ...], shard_id: str | int | None = None
    ) -> ShardCopy:
        if shard_id == "q":
            offset, shard_size, total_heads = 0, self.q_size, self.total_num_heads
            source_rank = self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            shard_size, total_heads = self.kv_size, self.total_num_kv_heads
            source_rank = self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"unknown qkv shard id {shard_id!r}")
        check_full_shape(full_shape, (total_heads * self.head_dim, *param.shape[1:]))
        return ShardCopy(0, source_rank * shard_size, 0, offset, shard_size)


class RowParallelLinear(LinearBase):
    """`y = x W^T + b` with W's columns (input features) split over ranks; sums partials.

    The input arrives already split (the output of a column-parallel layer). The bias is
    replicated and added once, after the sum.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False) -> None:
        tp_size = get_tp().tp_size
        super().__init__(divide(input_size, tp_size, "input features"), output_size, bias=bias)

    def shard_copy(
        self, param: nn.Parameter, full_shape: tuple[int, ...], shard_id: str | int | None = None
    ) -> ShardCopy:
        if param.dim() == 1:  # bias: replicated
            check_full_shape(full_shape, tuple(param.shape))
            return ShardCopy.whole(tuple(param.shape))
        shard_size = param.shape[1]
        check_full_shape(full_shape, (param.shape[0], shard_size * self.tp_size))
        return ShardCopy(1, self.tp_rank * shard_size, 1, 0, shard_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return linear(x, self.weight, self.bias)
        y = all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias
