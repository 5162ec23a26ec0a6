"""What each engine rank holds of each pushed tensor: vLLM's tensor- and expert-parallel rules.

The rules are those of vLLM's (and SGLang's) linear layers, which the reference engine follows
(`layers/linear.py`, `layers/embedding.py`): column-parallel matrices split their rows, row-
parallel ones their columns, KV heads are replicated when there are fewer than ranks, the
vocabulary is split in ranges of `ceil(vocab / tp)` rows, everything else is replicated. With
expert parallelism the routed experts are divided into `ep` contiguous groups of `tp / ep` ranks,
and each group splits its experts' matrices like a dense MLP. An FP8 `weight_scale_inv` is split
like its weight, in 128-row/column blocks.
"""

import re
from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import Any

from weightbus.meta import TensorMeta

_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.(weight|weight_scale_inv|bias)$")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")
_KV = ("k_proj", "v_proj")
_COLUMN = ("q_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "w1", "w3")
_ROW = ("o_proj", "down_proj", "w2")
_EXPERT_COLUMN = ("gate_proj", "up_proj", "w1", "w3", "gate_up_proj")


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """One engine replica: `tp` ranks, experts spread over `ep` groups of `tp // ep` ranks."""

    tp: int
    ep: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.ep < 1:
            raise ValueError(f"engine tp and ep must be >= 1, got tp={self.tp} ep={self.ep}")
        if self.tp % self.ep:
            raise ValueError(f"engine ep ({self.ep}) must divide engine tp ({self.tp})")


def split_length(size: int, parts: int, index: int) -> int:
    """Length of part `index` when `size` is cut into `parts` ranges of `ceil(size / parts)`
    (the last ones shorter or empty): the reference engine's vocabulary rule, and an even
    split when `parts` divides `size`."""
    chunk = -(-size // parts)
    return max(0, min(chunk, size - index * chunk))


def rank_shares(meta: TensorMeta, config: dict[str, Any], layout: EngineLayout) -> tuple[int, ...]:
    """Bytes of `meta` that each engine rank of a replica holds, by TP rank."""
    expert = _EXPERT.search(meta.name)
    if expert:
        group = int(expert[1]) * layout.ep // num_experts(config)
        kind = ("expert", expert[2] in _EXPERT_COLUMN, group)
    elif meta.name.endswith(_VOCAB):
        kind = ("column",)
    else:
        kind = _kind(_module(meta.name), meta.name.endswith("bias"), config, layout.tp)
    return _shares(kind, meta.shape, meta.element_bytes, layout)


def rank_share_bytes(
    meta: TensorMeta, config: dict[str, Any], layout: EngineLayout, rank: int
) -> int:
    """Bytes of `meta` that engine rank `rank` of a replica holds."""
    return rank_shares(meta, config, layout)[rank]


def _module(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else ""


def _kind(module: str, bias: bool, config: dict[str, Any], tp: int) -> tuple:
    if bias and module in _ROW:
        return ("replicated",)
    if module in _KV:
        heads = config.get("num_key_value_heads") or config.get("num_attention_heads") or tp
        return ("column",) if heads >= tp else ("kv_replicated", heads)
    if module in _COLUMN:
        return ("column",)
    if module in _ROW:
        return ("row",)
    return ("replicated",)


@lru_cache(maxsize=4096)
def _shares(kind: tuple, shape: tuple[int, ...], element_bytes: int, layout: EngineLayout) -> tuple:
    nbytes = prod(shape) * element_bytes
    if kind[0] == "replicated" or not shape:
        return (nbytes,) * layout.tp
    if kind[0] == "kv_replicated":
        return (nbytes // kind[1],) * layout.tp  # one head per rank, on tp // heads ranks each
    if kind[0] == "expert":
        _, column, group = kind
        group_ranks = layout.tp // layout.ep
        inner = [
            _split(shape, nbytes, 0 if column else 1, group_ranks, p) for p in range(group_ranks)
        ]
        return tuple(
            inner[r % group_ranks] if r // group_ranks == group else 0 for r in range(layout.tp)
        )
    dim = 0 if kind[0] == "column" else 1
    return tuple(_split(shape, nbytes, dim, layout.tp, rank) for rank in range(layout.tp))


def _split(shape: tuple[int, ...], nbytes: int, dim: int, parts: int, index: int) -> int:
    if dim >= len(shape) or not shape[dim]:
        return nbytes
    return nbytes // shape[dim] * split_length(shape[dim], parts, index)


def check_layout(config: dict[str, Any], layout: EngineLayout) -> None:
    """Raise ValueError where vLLM's layers would refuse this layout for this model: attention
    heads not divided by tp, KV heads neither a multiple nor a divisor of tp, experts not
    divided by ep."""
    heads = config.get("num_attention_heads")
    if heads and heads % layout.tp:
        raise ValueError(f"engine tp ({layout.tp}) must divide num_attention_heads ({heads})")
    kv_heads = config.get("num_key_value_heads") or heads
    if kv_heads and (kv_heads % layout.tp if kv_heads >= layout.tp else layout.tp % kv_heads):
        raise ValueError(
            f"engine tp ({layout.tp}) and num_key_value_heads ({kv_heads}): "
            "one must divide the other"
        )
    experts = num_experts(config)
    if layout.ep > 1 and (not experts or experts % layout.ep):
        raise ValueError(f"engine ep ({layout.ep}) must divide the routed experts ({experts})")


def num_experts(config: dict[str, Any]) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if config.get(key):
            return int(config[key])
    return 0
