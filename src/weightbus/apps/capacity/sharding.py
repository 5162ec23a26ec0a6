"""What each engine rank holds of each pushed tensor: tensor- and expert-parallel rules.

Tensor parallelism follows vLLM's linear layers, which the reference engine follows too
(`layers/linear.py`, `layers/embedding.py`): column-parallel matrices split their rows,
row-parallel ones their columns, KV heads are replicated when there are fewer than ranks,
routers, norms and MLA's down-projections are replicated. The vocabulary is split in ranges of
`ceil(vocab / tp)` rows (the reference engine's rule; vLLM pads the vocabulary to a multiple of
64 first, which moves a few rows between ranks). Expert parallelism divides the routed experts
into `ep` groups of `tp / ep` ranks, each splitting its experts like a dense MLP (SGLang's
layout; `ep = tp` is vLLM's and the reference engine's: whole experts per rank), placed as the
reference engine places them (`linear`: contiguous ranges, or `round_robin`), with
`redundant_experts` second copies of some experts (EPLB's redundant slots) on other groups.
A block-FP8 `weight_scale_inv` is split like its weight, in 128-row/column blocks.
"""

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import Any

import torch

from weightbus.core.meta import TensorMeta
from weightbus.engines.reference.models.experts import (
    PLACEMENTS,
    linear_placement,
    round_robin_placement,
)

FP8_BLOCK_ROWS = 128
_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.(weight|weight_scale_inv|bias)$")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")
_KV = ("k_proj", "v_proj")
_COLUMN = ("q_proj", "qkv_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "gate_up_proj")
_ROW = ("o_proj", "down_proj")
_REPLICATED = ("gate", "q_a_proj", "kv_a_proj_with_mqa", "shared_expert_gate")
_EXPERT_COLUMN = ("gate_proj", "up_proj", "gate_up_proj")


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """One engine replica: `tp` ranks, experts spread over `ep` groups of `tp // ep` ranks,
    placed `linear` or `round_robin`, with `redundant_experts` second copies (the reference
    engine's placements, `engines/reference/models/experts.py`, which follow vLLM's EPLB)."""

    tp: int
    ep: int = 1
    placement: str = "linear"
    redundant_experts: int = 0

    def __post_init__(self) -> None:
        if self.tp < 1 or self.ep < 1:
            raise ValueError(f"engine tp and ep must be >= 1, got tp={self.tp} ep={self.ep}")
        if self.tp % self.ep:
            raise ValueError(f"engine ep ({self.ep}) must divide engine tp ({self.tp})")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"expert placement must be one of {PLACEMENTS}: {self.placement!r}")
        if self.redundant_experts < 0 or (self.redundant_experts and self.ep < 2):
            raise ValueError(
                f"redundant experts ({self.redundant_experts}) need ep >= 2 and a count >= 0"
            )

    @property
    def expert_group_ranks(self) -> int:
        return self.tp // self.ep


def split_length(size: int, parts: int, index: int) -> int:
    """Length of part `index` when `size` is cut into `parts` ranges of `ceil(size / parts)`
    (the last ones shorter or empty): the reference engine's vocabulary rule, and an even
    split when `parts` divides `size`."""
    chunk = -(-size // parts)
    return max(0, min(chunk, size - index * chunk))


def rank_shares(meta: TensorMeta, config: dict[str, Any], layout: EngineLayout) -> tuple[int, ...]:
    """Bytes of `meta` that each engine rank of a replica holds, by TP rank."""
    return _shares(_kind_of(meta, config, layout), meta.shape, meta.element_bytes, layout)


def unmatched_modules(metas: Iterable[TensorMeta]) -> list[str]:
    """Modules of decoder-layer matrices no rule names: planned as replicated on every rank,
    which overstates their bytes if the engine splits them."""
    known = (*_KV, *_COLUMN, *_ROW, *_REPLICATED)
    modules = {
        _module(m.name)
        for m in metas
        if ".layers." in m.name and len(m.shape) == 2 and not _EXPERT.search(m.name)
    }
    return sorted(modules - set(known))


def _kind_of(meta: TensorMeta, config: dict[str, Any], layout: EngineLayout) -> tuple:
    expert = _EXPERT.search(meta.name)
    if expert:
        experts = num_experts(config)
        groups = (0,)
        if layout.ep > 1:
            placed = _expert_groups(experts, layout.ep, layout.placement, layout.redundant_experts)
            groups = placed[int(expert[1])]
        return ("expert", expert[2] in _EXPERT_COLUMN, groups)
    if meta.name.endswith(_VOCAB):
        return ("column",)
    return _dense_kind(_module(meta.name), meta.name.endswith("bias"), config, layout.tp)


def _dense_kind(module: str, bias: bool, config: dict[str, Any], tp: int) -> tuple:
    if bias and module in _ROW:
        return ("replicated",)
    if module in _KV:
        heads = config.get("num_key_value_heads") or config.get("num_attention_heads") or 1
        return ("column",) if heads >= tp else ("kv_replicated", heads)
    if module in _COLUMN:
        return ("column",)
    if module in _ROW:
        return ("row",)
    return ("replicated",)


def _module(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else ""


def _split_of(kind: tuple, layout: EngineLayout) -> tuple[int, int] | None:
    """`(dim, parts)` a kind splits a matrix along, or None when it does not split it."""
    if kind[0] == "column" and layout.tp > 1:
        return 0, layout.tp
    if kind[0] == "row" and layout.tp > 1:
        return 1, layout.tp
    if kind[0] == "expert" and layout.expert_group_ranks > 1:
        return (0 if kind[1] else 1), layout.expert_group_ranks
    return None


@lru_cache(maxsize=4096)
def _shares(kind: tuple, shape: tuple[int, ...], element_bytes: int, layout: EngineLayout) -> tuple:
    nbytes = prod(shape) * element_bytes
    if kind[0] == "kv_replicated":
        return (nbytes // kind[1],) * layout.tp  # one head per rank, on tp // heads ranks each
    split = _split_of(kind, layout) if shape else None
    if kind[0] == "expert":
        group_ranks = layout.expert_group_ranks
        inner = [_split(shape, nbytes, split, p) for p in range(group_ranks)]
        return tuple(
            inner[r % group_ranks] if r // group_ranks in kind[2] else 0 for r in range(layout.tp)
        )
    return tuple(_split(shape, nbytes, split, rank) for rank in range(layout.tp))


@lru_cache(maxsize=64)
def _expert_groups(
    experts: int, ep: int, placement: str, redundant: int
) -> tuple[tuple[int, ...], ...]:
    """Per expert, the expert-parallel groups that hold a copy of it."""
    place = linear_placement if placement == "linear" else round_robin_placement
    expert_map = place(experts, ep, redundant)
    return tuple(
        tuple(sorted({rank for rank, _ in expert_map.replicas(e)})) for e in range(experts)
    )


def _split(shape: tuple[int, ...], nbytes: int, split: tuple[int, int] | None, index: int) -> int:
    if split is None or split[0] >= len(shape) or not shape[split[0]]:
        return nbytes
    dim, parts = split
    return nbytes // shape[dim] * split_length(shape[dim], parts, index)


def check_layout(config: dict[str, Any], layout: EngineLayout) -> None:
    """Raise ValueError where vLLM's layers would refuse this layout for this model: attention
    heads or MLP widths not divided by tp, KV heads neither a multiple nor a divisor of tp,
    experts not divided by ep."""
    divided = {
        "num_attention_heads": layout.tp,
        "intermediate_size": layout.tp,
        "moe_intermediate_size": layout.expert_group_ranks,
    }
    for field, parts in divided.items():
        value = config.get(field)
        if isinstance(value, int) and value and value % parts:
            raise ValueError(f"{field} ({value}) is not divisible by {parts} ranks")
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    if kv_heads and (kv_heads % layout.tp if kv_heads >= layout.tp else layout.tp % kv_heads):
        raise ValueError(
            f"engine tp ({layout.tp}) and num_key_value_heads ({kv_heads}): "
            "one must divide the other"
        )
    experts = num_experts(config)
    if layout.ep > 1 and not experts:
        raise ValueError(f"engine ep ({layout.ep}): the model has no routed experts")
    slots = experts + layout.redundant_experts
    if layout.ep > 1 and slots % layout.ep:
        raise ValueError(
            f"engine ep ({layout.ep}) must divide the routed experts ({experts}) plus the "
            f"redundant ones ({layout.redundant_experts})"
        )


def check_block_alignment(
    metas: Iterable[TensorMeta], config: dict[str, Any], layout: EngineLayout
) -> None:
    """Raise ValueError where a block-FP8 matrix would be split inside a 128x128 block (vLLM
    refuses such shards)."""
    for meta in metas:
        if meta.dtype != torch.float8_e4m3fn or len(meta.shape) != 2:
            continue
        split = _split_of(_kind_of(meta, config, layout), layout)
        if split and meta.shape[split[0]] % (split[1] * FP8_BLOCK_ROWS):
            size, parts = meta.shape[split[0]], split[1]
            raise ValueError(
                f"fp8-block: {meta.name} splits {size} over {parts} ranks, "
                f"{size / parts:g} each: not a multiple of the {FP8_BLOCK_ROWS}-wide blocks"
            )


def expert_index(name: str) -> int | None:
    """The routed expert a tensor belongs to (`...experts.17.gate_proj.weight`: 17), or None."""
    expert = _EXPERT.search(name)
    return None if expert is None else int(expert[1])


def num_experts(config: dict[str, Any]) -> int:
    """Routed experts per MoE layer (0 for a dense model or an unknown config key)."""
    for key in ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts"):
        if isinstance(config.get(key), int) and config[key]:
            return int(config[key])
    return 0
