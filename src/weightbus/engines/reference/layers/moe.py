"""Mixture-of-experts layers: the router (`TopKRouter`, Hugging Face's `mlp.gate`) and the
experts held fused the way engines hold them (`FusedMoE`), combined in `SparseMoeBlock`.

`FusedMoE` holds one slot per local expert copy: `w13_weight` `[slots, 2 * I_tp, H]` (the
gate rows, then the up rows, as vLLM) and `w2_weight` `[slots, H, I_tp]`. Without expert
parallelism every rank holds every expert with its intermediate dimension split over the
ranks (`I_tp = I / tp`, like `MergedColumnParallelLinear` then `RowParallelLinear`); with it,
whole experts (`I_tp = I`). Either way each rank computes its slots' contributions for every
token and the TP all-reduce sums them. Which slot holds which expert, and which tokens each
copy takes, is the layer's `routes` (set from an `ExpertMap`, `models/experts.py`).

Block-FP8 experts (`quant`) hold `w13_weight` / `w2_weight` in float8_e4m3fn with
`w13_weight_scale_inv` `[slots, 2 * ceil(I_tp / block_rows), ceil(H / block_cols)]` (the gate
part's scales, then the up part's) and `w2_weight_scale_inv` `[slots, ceil(H / block_rows),
ceil(I_tp / block_cols)]`, and dequantize each slot in the matmul (W8A16), as
`layers/linear.py` does; a split over TP ranks must fall on block edges.
"""

import math
import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.functional import linear, softmax

from weightbus.core.fp8 import FP8_DTYPE, SCALE_SUFFIX, Fp8Block, dequantize
from weightbus.core.plan.shard import ShardCopy, check_full_shape
from weightbus.engines.reference.layers.activation import SiluAndMul
from weightbus.engines.reference.layers.parallel import all_reduce, divide, exchange, get_tp
from weightbus.engines.reference.layers.replicated import Replicated

# `model.layers.L.mlp.experts.E.gate_proj.weight` (or `.weight_scale_inv`): module, expert,
# projection, tensor
EXPERT_NAME = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$"
)
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class SlotRoute:
    """What one local slot computes: the tokens routed to `expert` whose index `i` in the
    batch has `i % num_replicas == replica` (replica `replica` of `num_replicas` copies)."""

    expert: int
    replica: int = 0
    num_replicas: int = 1


@dataclass(frozen=True, slots=True)
class SlotTransfer:
    """Slot `dst_slot` of expert-parallel rank `dst_rank` takes the expert that slot
    `src_slot` of rank `src_rank` holds."""

    dst_rank: int
    dst_slot: int
    src_rank: int
    src_slot: int


def _new_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class TopKRouter(Replicated, nn.Module):
    """`mlp.gate`: softmax over the experts in float32, the top `top_k`, renormalised when
    `norm_topk_prob` (transformers' `Qwen3MoeTopKRouter`). Replicated on every rank."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = _new_param(num_experts, hidden_size)
        self.weight.weight_loader = self.weight_loader

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(weights, expert ids)` of every token, `[num_tokens, top_k]` each."""
        logits = linear(x, self.weight)
        probs = softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids


class FusedMoE(nn.Module):
    """The experts of one MoE layer, in `routes`' slots (see the module docstring).

    Args:
        num_experts: logical experts of the model.
        hidden_size: H.
        intermediate_size: each expert's intermediate size I (`moe_intermediate_size`).
        routes: what each local slot holds (its length is the number of slots).
        expert_parallel: whole experts per rank; False: every expert split over the ranks.
        quant: block-FP8 storage (None: the default dtype).

    Raises:
        ValueError: I does not split over the TP ranks (on block edges with `quant`).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        routes: tuple[SlotRoute, ...],
        *,
        expert_parallel: bool,
        quant: Fp8Block | None = None,
    ) -> None:
        super().__init__()
        ctx = get_tp()
        self.quant = quant
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.expert_parallel = expert_parallel
        # the expert-parallel rank (0 of 1 without EP), and this rank's slice of I
        self.ep_rank = ctx.tp_rank if expert_parallel else 0
        tp_split = 1 if expert_parallel else ctx.tp_size
        self.intermediate_per_rank = divide(intermediate_size, tp_split, "moe_intermediate_size")
        self.intermediate_start = 0 if expert_parallel else ctx.tp_rank * self.intermediate_per_rank
        slots, size = len(routes), self.intermediate_per_rank
        dtype = None if quant is None else FP8_DTYPE
        self.w13_weight = _new_param(slots, 2 * size, hidden_size, dtype=dtype)
        self.w2_weight = _new_param(slots, hidden_size, size, dtype=dtype)
        if quant is not None:
            self._check_blocks(quant, tp_split)
            gate_rows, cols = quant.scale_shape((size, hidden_size))
            self.w13_weight_scale_inv = _new_param(slots, 2 * gate_rows, cols, dtype=torch.float32)
            down_scales = quant.scale_shape((hidden_size, size))
            self.w2_weight_scale_inv = _new_param(slots, *down_scales, dtype=torch.float32)
        self.routes = routes
        self.act_fn = SiluAndMul()

    def _check_blocks(self, quant: Fp8Block, tp_split: int) -> None:
        """Raise ValueError unless each rank's slice of I starts and ends on block edges."""
        block = math.lcm(quant.block_rows, quant.block_cols)
        if tp_split > 1 and self.intermediate_per_rank % block:
            raise ValueError(
                f"fp8-block: each expert holds {self.intermediate_per_rank} of "
                f"moe_intermediate_size per rank at --tp {tp_split}, not a multiple of {block} "
                f"({quant.block_rows}x{quant.block_cols} blocks)"
            )

    def set_routes(self, routes: tuple[SlotRoute, ...]) -> None:
        """Hold `routes` from now on (the slots' contents must already match)."""
        if len(routes) != self.w13_weight.shape[0]:
            raise ValueError(f"{len(routes)} routes for {self.w13_weight.shape[0]} slots")
        self.routes = routes

    def local_slot(self, expert: int) -> int | None:
        """The slot holding `expert` on this rank (None: this rank does not hold it)."""
        for slot, route in enumerate(self.routes):
            if route.expert == expert:
                return slot
        return None

    def expert_copy(
        self, full_shape: tuple[int, ...], expert: int, projection: str, *, scale: bool = False
    ) -> tuple[str, ShardCopy | None]:
        """Where this rank's slice of expert `expert`'s Hugging Face `projection` weight (or,
        with `scale`, of its block-FP8 `_scale_inv`) goes: the parameter's attribute name
        (`w13_weight`, `w2_weight`, or theirs + `_scale_inv`) and the copy (None: this rank
        holds no copy of the expert).

        Raises:
            ValueError: an unknown expert or projection, a scale of an unquantized layer, or
                a wrong full shape.
        """
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"unknown expert {expert}: this layer has {self.num_experts}")
        if projection not in EXPERT_PROJECTIONS:
            raise ValueError(f"unknown expert projection {projection!r}")
        if scale and self.quant is None:
            raise ValueError("a _scale_inv for experts that are not block-FP8")
        hidden, full_size = self.w13_weight.shape[2], self.intermediate_size
        down = projection == "down_proj"
        weight_shape = (hidden, full_size) if down else (full_size, hidden)
        check_full_shape(
            full_shape, self.quant.scale_shape(weight_shape) if scale else weight_shape
        )
        param_attr = ("w2_weight" if down else "w13_weight") + (SCALE_SUFFIX if scale else "")
        slot = self.local_slot(expert)
        if slot is None:
            return param_attr, None
        # rows of gate/up, columns of down: this rank's range of I (in blocks for scales)
        block = 1
        if scale:
            block = self.quant.block_cols if down else self.quant.block_rows
        start, size = (
            self.intermediate_start // block,
            math.ceil(self.intermediate_per_rank / block),
        )
        if down:
            return param_attr, ShardCopy(1, start, 1, 0, size, dst_slot=slot)
        offset = size if projection == "up_proj" else 0  # gate rows, then up rows
        return param_attr, ShardCopy(0, start, 0, offset, size, dst_slot=slot)

    def load_expert(
        self, loaded: torch.Tensor, expert: int, projection: str, *, scale: bool = False
    ) -> None:
        """Copy this rank's slice of an expert's full tensor into the slot holding it (none
        when this rank does not hold the expert).

        Raises:
            ValueError: see `expert_copy`; or an unquantized weight for block-FP8 experts (a
                cast would drop its scales).
        """
        param_attr, copy = self.expert_copy(tuple(loaded.shape), expert, projection, scale=scale)
        param = getattr(self, param_attr)
        if param.dtype == FP8_DTYPE and loaded.dtype != FP8_DTYPE:
            raise ValueError(
                f"fp8-block: this engine serves {FP8_DTYPE} with a _scale_inv, got "
                f"{loaded.dtype} (push with Publisher(quantize='fp8-block'))"
            )
        if copy is not None:
            copy.apply(param.data, loaded)

    def slot_parameters(self) -> list[nn.Parameter]:
        """The parameters a slot has a part of (what moves with an expert)."""
        params = [self.w13_weight, self.w2_weight]
        if self.quant is not None:
            params += [self.w13_weight_scale_inv, self.w2_weight_scale_inv]
        return params

    def move(self, transfers: list[SlotTransfer], routes: tuple[SlotRoute, ...]) -> None:
        """Fill the slots `transfers` name from their sources (a collective over the TP
        group: every rank calls it with the same transfers), then hold `routes`."""
        me = self.ep_rank
        # slots move as bytes: gloo has no float8 type
        params = [param.data.view(torch.uint8) for param in self.slot_parameters()]
        sends, recvs, writes = [], [], []
        for index, transfer in enumerate(transfers):
            for j, param in enumerate(params):
                tag = index * len(params) + j
                if transfer.src_rank == me and transfer.dst_rank != me:
                    sends.append((transfer.dst_rank, tag, param[transfer.src_slot]))
                elif transfer.dst_rank == me:
                    # read every source before any slot is overwritten (slots may swap)
                    if transfer.src_rank == me:
                        incoming = param[transfer.src_slot].clone()
                    else:
                        incoming = torch.empty_like(param[transfer.dst_slot])
                        recvs.append((transfer.src_rank, tag, incoming))
                    writes.append((param, transfer.dst_slot, incoming))
        if sends or recvs:
            exchange(sends, recvs)
        for param, slot, incoming in writes:
            param[slot].copy_(incoming)
        self.set_routes(routes)

    def slot_weights(self, slot: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`(w13, w2)` of a slot in `dtype`: block-FP8 ones dequantized part by part."""
        if self.quant is None:
            return self.w13_weight[slot], self.w2_weight[slot]
        size = self.intermediate_per_rank
        rows = self.w13_weight_scale_inv.shape[1] // 2
        w13, w13_scales = self.w13_weight[slot], self.w13_weight_scale_inv[slot]
        gate = dequantize(w13[:size], w13_scales[:rows], self.quant)
        up = dequantize(w13[size:], w13_scales[rows:], self.quant)
        w2 = dequantize(self.w2_weight[slot], self.w2_weight_scale_inv[slot], self.quant)
        return torch.cat([gate, up]).to(dtype), w2.to(dtype)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's part of the experts' weighted sum, `[num_tokens, H]` (not reduced)."""
        out = torch.zeros_like(x)
        token_index = torch.arange(x.shape[0])
        for slot, route in enumerate(self.routes):
            hit = topk_ids == route.expert
            if route.num_replicas > 1:
                hit &= (token_index % route.num_replicas == route.replica).unsqueeze(-1)
            tokens, k = torch.where(hit)
            if tokens.numel() == 0:
                continue
            w13, w2 = self.slot_weights(slot, x.dtype)
            hidden = self.act_fn(linear(x[tokens], w13))
            y = linear(hidden, w2) * topk_weights[tokens, k].unsqueeze(-1)
            out.index_add_(0, tokens, y)
        return out


class SparseMoeBlock(nn.Module):
    """`mlp` of an MoE decoder layer: `gate` (the router) and `experts`, summed over ranks.

    Args:
        num_experts, top_k, norm_topk_prob: the router (Hugging Face's config fields).
        hidden_size, intermediate_size, routes, expert_parallel, quant: see `FusedMoE`.
    """

    def __init__(
        self,
        *,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        hidden_size: int,
        intermediate_size: int,
        routes: tuple[SlotRoute, ...],
        expert_parallel: bool,
        quant: Fp8Block | None = None,
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(num_experts, hidden_size, top_k, norm_topk_prob)
        self.experts = FusedMoE(
            num_experts,
            hidden_size,
            intermediate_size,
            routes,
            expert_parallel=expert_parallel,
            quant=quant,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        return all_reduce(self.experts(x, topk_weights, topk_ids))
