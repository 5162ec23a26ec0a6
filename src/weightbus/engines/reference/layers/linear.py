"""Tensor-parallel linear layers (vLLM's names) and their weight loaders.

Column-parallel layers split the output features over ranks, row-parallel layers split the input
features and sum the partial products. Fused layers (`QKVParallelLinear`,
`MergedColumnParallelLinear`) hold several Hugging Face matrices stacked along the output
dimension; their loader takes a `shard_id` that says which one arrives. Every loader checks the
full (unsharded) shape, then applies its `shard_copy` (`plan/shard.py`): its rank's slice is
copied into the existing parameter storage, never reallocated and never aliased.

Block-FP8 layers (`quant`) hold the weight in `float8_e4m3fn` plus `weight_scale_inv`, one
float32 per block of each Hugging Face matrix they hold a part of, and dequantize in the matmul
(W8A16). A fused layer's scales are its parts' scales stacked; a part split over ranks must be
split on block boundaries (vLLM's rule), so each rank's scales are a slice of the full ones.
"""

import math

import torch
from torch import nn
from torch.nn.functional import linear

from weightbus.core.fp8 import FP8_DTYPE, Fp8Block, dequantize
from weightbus.core.plan.shard import ShardCopy, check_full_shape
from weightbus.engines.reference.layers.lora import LoraPart, LoraState, column_part, row_part
from weightbus.engines.reference.layers.parallel import all_reduce, divide, get_tp

ShardId = str | int | None


def _new_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LinearBase(nn.Module):
    """A linear layer whose weight is `[output_size, input_size]` of this rank's shard.

    Subclasses name the Hugging Face matrices they hold (`_full_weight_shape` by shard id,
    `_row_parts`: the rows of each on this rank, in order) and where a rank's slice of one goes
    (`_weight_copy`).
    """

    def __init__(
        self, input_size: int, output_size: int, *, bias: bool, quant: Fp8Block | None = None
    ) -> None:
        super().__init__()
        ctx = get_tp()
        self.tp_rank, self.tp_size = ctx.tp_rank, ctx.tp_size
        self.quant = quant
        weight_dtype = None if quant is None else FP8_DTYPE
        self.weight = _new_param(output_size, input_size, dtype=weight_dtype)
        self.weight.weight_loader = self.weight_loader
        if quant is not None:
            self._check_blocks(quant)
            scale_rows = sum(math.ceil(rows / quant.block_rows) for rows in self._row_parts())
            scale_cols = math.ceil(input_size / quant.block_cols)
            self.weight_scale_inv = _new_param(scale_rows, scale_cols, dtype=torch.float32)
            self.weight_scale_inv.weight_loader = self.weight_loader
        if bias:
            self.bias = _new_param(output_size)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.lora = nn.ModuleDict()  # Hugging Face projection -> its adapter (`attach_lora`)
        self.lora_state: LoraState | None = None

    def attach_lora(
        self, projection: str, shard_id: ShardId, rank: int, dtype: torch.dtype, state: LoraState
    ) -> None:
        """Hold a rank-`rank` adapter of the Hugging Face `projection` (`shard_id` of this
        layer) in `dtype`, applied while `state.active`."""
        self.lora[projection] = self._lora_part(shard_id, rank, dtype)
        self.lora_state = state

    def _lora_part(self, shard_id: ShardId, rank: int, dtype: torch.dtype) -> LoraPart:
        raise NotImplementedError

    def _add_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` plus each adapter's `(B (A x)) * s` on its rows (in place), while active."""
        state = self.lora_state
        if state is None or not state.active:
            return y
        for part in self.lora.values():
            start, length = part.rows
            y[..., start : start + length] += part.delta(x, state.scaling)
        return y

    def _row_parts(self) -> list[int]:
        """Rows on this rank of each Hugging Face matrix the weight stacks, in order."""
        return [self.weight.shape[0]]

    def _part_index(self, shard_id: ShardId) -> int:
        return 0

    def _full_weight_shape(self, shard_id: ShardId) -> tuple[int, int]:
        """The full shape of the Hugging Face matrix `shard_id` names."""
        raise NotImplementedError

    def _check_blocks(self, quant: Fp8Block) -> None:
        """Raise ValueError unless every split of a matrix over ranks falls on a block edge."""
        if self.tp_size == 1:
            return
        for rows in self._row_parts():
            if rows % quant.block_rows:
                raise ValueError(
                    f"fp8-block: {type(self).__name__} holds {rows} rows of a matrix per rank "
                    f"at --tp {self.tp_size}, not a multiple of the {quant.block_rows}-row block"
                )

    def _weight_copy(self, param: nn.Parameter, full_shape: tuple[int, ...], shard_id: ShardId):
        raise NotImplementedError

    def shard_copy(
        self, param: nn.Parameter, full_shape: tuple[int, ...], shard_id: ShardId = None
    ) -> ShardCopy:
        """Where this rank's slice of a full tensor of `full_shape` goes in `param`.

        Raises:
            ValueError: `full_shape` is not what this parameter is a slice of.
        """
        if self.quant is not None and param is self.weight_scale_inv:
            return self._scale_copy(full_shape, shard_id)
        return self._weight_copy(param, full_shape, shard_id)

    def _scale_copy(self, full_shape: tuple[int, ...], shard_id: ShardId) -> ShardCopy:
        # the weight's slice in block units: splits fall on block edges (`_check_blocks`), and
        # a whole part's partial last block is counted by the ceiling
        quant = self.quant
        weight_full = self._full_weight_shape(shard_id)
        check_full_shape(full_shape, quant.scale_shape(weight_full))
        copy = self._weight_copy(self.weight, weight_full, shard_id)
        if copy.src_dim == 1:
            start, length = copy.src_start // quant.block_cols, copy.length / quant.block_cols
            return ShardCopy(1, start, 1, 0, math.ceil(length))
        parts = self._row_parts()[: self._part_index(shard_id)]
        before = sum(math.ceil(rows / quant.block_rows) for rows in parts)
        start, length = copy.src_start // quant.block_rows, copy.length / quant.block_rows
        return ShardCopy(0, start, 0, before, math.ceil(length))

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        """Copy this rank's slice of the full tensor `loaded` into `param`, in place.

        Raises:
            ValueError: a wrong shape, or a block-FP8 weight that is not float8_e4m3fn (a
                cast would drop its scales).
        """
        if param.dtype == FP8_DTYPE and loaded.dtype != FP8_DTYPE:
            raise ValueError(
                f"fp8-block: this engine serves {FP8_DTYPE} with a _scale_inv, got "
                f"{loaded.dtype} (push with Publisher(quantize='fp8-block'))"
            )
        self.shard_copy(param, tuple(loaded.shape), shard_id).apply(param.data, loaded)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype`: block-FP8 weights dequantized part by part."""
        if self.quant is None:
            return self.weight
        rows = self._row_parts()
        scale_rows = [math.ceil(r / self.quant.block_rows) for r in rows]
        parts = zip(self.weight.split(rows), self.weight_scale_inv.split(scale_rows), strict=True)
        dense = [dequantize(weight, scales, self.quant) for weight, scales in parts]
        return torch.cat(dense).to(dtype)


class ColumnParallelLinear(LinearBase):
    """`y = x W^T + b` with W's rows (output features) split over ranks; no gather."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        quant: Fp8Block | None = None,
    ) -> None:
        tp_size = get_tp().tp_size
        output_size = divide(output_size, tp_size, "output features")
        super().__init__(input_size, output_size, bias=bias, quant=quant)

    def _full_weight_shape(self, shard_id: ShardId) -> tuple[int, int]:
        return self.weight.shape[0] * self.tp_size, self.weight.shape[1]

    def _weight_copy(
        self, param: nn.Parameter, full_shape: tuple[int, ...], shard_id: ShardId = None
    ) -> ShardCopy:
        shard_size = param.shape[0]
        check_full_shape(full_shape, (shard_size * self.tp_size, *param.shape[1:]))
        return ShardCopy(0, self.tp_rank * shard_size, 0, 0, shard_size)

    def _lora_part(self, shard_id: ShardId, rank: int, dtype: torch.dtype) -> LoraPart:
        full = self._full_weight_shape(shard_id)
        rows = self._weight_copy(self.weight, full, shard_id)
        return column_part(rank, self.weight.shape[1], rows, full[0], dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_lora(x, linear(x, self.dense_weight(x.dtype), self.bias))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked along the output (e.g. gate and up).

    Each rank holds `[shard of matrix 0; shard of matrix 1; ...]`.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool = False,
        quant: Fp8Block | None = None,
    ) -> None:
        tp_size = get_tp().tp_size
        for size in output_sizes:
            divide(size, tp_size, "output features")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias=bias, quant=quant)

    def _row_parts(self) -> list[int]:
        return [size // self.tp_size for size in self.output_sizes]

    def _part_index(self, shard_id: ShardId) -> int:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"unknown merged shard id {shard_id!r}")
        return shard_id

    def _full_weight_shape(self, shard_id: ShardId) -> tuple[int, int]:
        return self.output_sizes[self._part_index(shard_id)], self.weight.shape[1]

    def _weight_copy(
        self, param: nn.Parameter, full_shape: tuple[int, ...], shard_id: ShardId = None
    ) -> ShardCopy:
        self._part_index(shard_id)
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
        quant: Fp8Block | None = None,
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
        super().__init__(hidden_size, output_size, bias=bias, quant=quant)

    @property
    def q_size(self) -> int:
        """Query features on this rank."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Key (or value) features on this rank."""
        return self.num_kv_heads * self.head_dim

    def _row_parts(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def _part_index(self, shard_id: ShardId) -> int:
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"unknown qkv shard id {shard_id!r}")
        return "qkv".index(shard_id)

    def _full_weight_shape(self, shard_id: ShardId) -> tuple[int, int]:
        heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        return heads * self.head_dim, self.weight.shape[1]

    def _weight_copy(
        self, param: nn.Parameter, full_shape: tuple[int, ...], shard_id: ShardId = None
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

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        quant: Fp8Block | None = None,
    ) -> None:
        tp_size = get_tp().tp_size
        input_size = divide(input_size, tp_size, "input features")
        super().__init__(input_size, output_size, bias=bias, quant=quant)

    def _check_blocks(self, quant: Fp8Block) -> None:
        if self.tp_size > 1 and self.weight.shape[1] % quant.block_cols:
            raise ValueError(
                f"fp8-block: {type(self).__name__} holds {self.weight.shape[1]} columns of a "
                f"matrix per rank at --tp {self.tp_size}, not a multiple of the "
                f"{quant.block_cols}-column block"
            )

    def _full_weight_shape(self, shard_id: ShardId) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1] * self.tp_size

    def _weight_copy(
        self, param: nn.Parameter, full_shape: tuple[int, ...], shard_id: ShardId = None
    ) -> ShardCopy:
        if param.dim() == 1:  # bias: replicated
            check_full_shape(full_shape, tuple(param.shape))
            return ShardCopy.whole(tuple(param.shape))
        shard_size = param.shape[1]
        check_full_shape(full_shape, (param.shape[0], shard_size * self.tp_size))
        return ShardCopy(1, self.tp_rank * shard_size, 1, 0, shard_size)

    def _lora_part(self, shard_id: ShardId, rank: int, dtype: torch.dtype) -> LoraPart:
        full = self._full_weight_shape(shard_id)
        cols = self._weight_copy(self.weight, full, shard_id)
        return row_part(rank, self.weight.shape[0], cols, full[1], dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.dense_weight(x.dtype)
        if self.tp_size == 1:
            return self._add_lora(x, linear(x, weight, self.bias))
        # each rank adds B (A_rank x_rank): the all-reduce sums them to B (A x)
        y = all_reduce(self._add_lora(x, linear(x, weight)))
        return y if self.bias is None else y + self.bias
