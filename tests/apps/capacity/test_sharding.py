"""`weightbus.apps.capacity.sharding` and `traffic`: what each engine rank holds and receives,
by the
tensor- and expert-parallel rules, checked on small configs whose shares are known by hand."""

from pathlib import Path

import pytest
import torch

from weightbus.apps.capacity.shapes import model_tensors
from weightbus.apps.capacity.sharding import (
    EngineLayout,
    check_layout,
    rank_shares,
    split_length,
    unmatched_modules,
)
from weightbus.apps.capacity.traffic import traffic
from weightbus.core.meta import TensorMeta

CONFIGS = Path(__file__).parent / "configs"
MOE = model_tensors(CONFIGS / "small-qwen3-moe.json", "bfloat16")
BF16 = 2


def _shares(name: str, layout: EngineLayout) -> tuple[int, ...]:
    meta = next(m for m in MOE.metas if m.name == name)
    return rank_shares(meta, MOE.config, layout)


def test_split_length_is_the_vocabulary_rule() -> None:
    assert [split_length(250, 4, i) for i in range(4)] == [63, 63, 63, 61]
    assert [split_length(8, 2, i) for i in range(2)] == [4, 4]
    assert [split_length(3, 4, i) for i in range(4)] == [1, 1, 1, 0]


def test_dense_rules_split_rows_columns_and_replicate() -> None:
    tp2 = EngineLayout(2)
    assert _shares("model.layers.0.self_attn.q_proj.weight", tp2) == (32 * 64 * BF16,) * 2
    assert _shares("model.layers.0.self_attn.o_proj.weight", tp2) == (64 * 32 * BF16,) * 2
    assert _shares("model.layers.0.self_attn.k_proj.weight", tp2) == (16 * 64 * BF16,) * 2
    assert _shares("model.layers.0.self_attn.q_norm.weight", tp2) == (16 * BF16,) * 2
    assert _shares("model.layers.0.mlp.gate.weight", tp2) == (8 * 64 * BF16,) * 2  # router
    assert _shares("model.embed_tokens.weight", tp2) == (125 * 64 * BF16,) * 2
    assert _shares("lm_head.weight", EngineLayout(4)) == tuple(
        r * 64 * BF16 for r in (63, 63, 63, 61)
    )


def test_kv_heads_fewer_than_ranks_are_replicated() -> None:
    # 2 KV heads of 16 rows on 4 ranks: each rank holds one head (ranks 0-1 head 0, 2-3 head 1)
    assert (
        _shares("model.layers.0.self_attn.v_proj.weight", EngineLayout(4)) == (16 * 64 * BF16,) * 4
    )


def test_experts_are_split_by_tp_or_owned_whole_under_ep() -> None:
    gate = "model.layers.1.mlp.experts.5.gate_proj.weight"  # (32, 64)
    down = "model.layers.1.mlp.experts.5.down_proj.weight"  # (64, 32)
    assert _shares(gate, EngineLayout(2)) == (16 * 64 * BF16,) * 2
    assert _shares(down, EngineLayout(2)) == (64 * 16 * BF16,) * 2
    # ep 2 of tp 2: experts 0-3 on rank 0, 4-7 on rank 1, whole
    assert _shares(gate, EngineLayout(2, 2)) == (0, 32 * 64 * BF16)
    # ep 2 of tp 4: experts 4-7 on ranks 2-3, split between them
    assert _shares(down, EngineLayout(4, 2)) == (0, 0, 64 * 16 * BF16, 64 * 16 * BF16)


def test_placements_and_redundant_experts_follow_the_engines_expert_map() -> None:
    whole = 32 * 64 * BF16
    gate = "model.layers.1.mlp.experts.{}.gate_proj.weight"
    # round robin over 2 ranks: expert 4 on rank 0, expert 5 on rank 1
    assert _shares(gate.format(4), EngineLayout(2, 2, "round_robin")) == (whole, 0)
    assert _shares(gate.format(5), EngineLayout(2, 2, "round_robin")) == (0, whole)
    # 8 experts + 2 redundant slots, linear: rank 0 holds 0-3 and 4, rank 1 holds 4-7 and 0
    redundant = EngineLayout(2, 2, "linear", 2)
    assert _shares(gate.format(4), redundant) == (whole, whole)
    assert _shares(gate.format(0), redundant) == (whole, whole)
    assert _shares(gate.format(1), redundant) == (whole, 0)
    with pytest.raises(ValueError, match="redundant"):
        check_layout(MOE.config, EngineLayout(2, 2, "linear", 1))


def test_every_byte_is_held_once_per_replica_except_replicated_ones() -> None:
    one = traffic(MOE, EngineLayout(1), "nixl", bucket_bytes=1 << 20)
    for layout in (EngineLayout(2), EngineLayout(2, 2)):  # KV heads (2) >= tp: split
        moved = traffic(MOE, layout, "nixl", bucket_bytes=1 << 20)
        replicated = sum(
            m.nbytes * (layout.tp - 1)
            for m in MOE.metas
            if rank_shares(m, MOE.config, layout) == (m.nbytes,) * layout.tp
        )
        assert sum(moved.share_bytes) == one.total_bytes + replicated


def test_patterns_decide_what_ranks_receive_and_trainers_send() -> None:
    layout = EngineLayout(2)
    parts = traffic(MOE, layout, "dist", replicas=3, bucket_bytes=1 << 20)
    broadcast = traffic(MOE, layout, "dist-broadcast", replicas=3, bucket_bytes=1 << 20)
    assert parts.transport == "dist-parts"  # dist's auto: every rank has tp > 1
    assert parts.receive_bytes == parts.share_bytes
    assert sum(parts.trainer_send_bytes) == 3 * sum(parts.share_bytes)
    assert broadcast.receive_bytes == (MOE.total_bytes,) * 2
    assert broadcast.trainer_send_bytes == (MOE.total_bytes,)
    spread = traffic(MOE, layout, "nixl", replicas=3, trainer_ranks=4, bucket_bytes=1 << 20)
    assert sum(spread.trainer_send_bytes) == 3 * sum(spread.share_bytes)
    assert (
        max(spread.trainer_send_bytes) - min(spread.trainer_send_bytes)
        <= max(m.nbytes for m in MOE.metas) * 6
    )


def test_layouts_the_model_cannot_take_are_refused() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by 3 ranks"):
        traffic(MOE, EngineLayout(3), "nixl", bucket_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"engine ep \(3\) must divide engine tp \(4\)"):
        EngineLayout(4, 3)
    with pytest.raises(
        ValueError, match="unknown transport 'tcp'; choose one of shm, shm-slots, nixl, dist"
    ):
        traffic(MOE, EngineLayout(2), "tcp", bucket_bytes=1 << 20)


DSV3 = model_tensors(CONFIGS / "small-deepseek-v3.json")  # block FP8, as its config says


def _dsv3_shares(name: str, layout: EngineLayout) -> tuple[int, ...]:
    meta = next(m for m in DSV3.metas if m.name == name)
    return rank_shares(meta, DSV3.config, layout)


def test_mla_down_projections_are_replicated_and_shared_experts_split() -> None:
    tp2 = EngineLayout(2)
    attention = "model.layers.1.self_attn"
    # kv_a_proj_with_mqa: (64 + 16, 256) fp8, 1 byte per element; q_a_proj (128, 256)
    assert _dsv3_shares(f"{attention}.kv_a_proj_with_mqa.weight", tp2) == (80 * 256,) * 2
    assert _dsv3_shares(f"{attention}.q_a_proj.weight", tp2) == (128 * 256,) * 2
    # q_b_proj: 4 heads x (32 + 16) = 192 rows of 128, split by rows
    assert _dsv3_shares(f"{attention}.q_b_proj.weight", EngineLayout(1)) == (192 * 128,)
    shared = "model.layers.2.mlp.shared_experts"
    assert _dsv3_shares(f"{shared}.down_proj.weight", EngineLayout(1)) == (256 * 128,)


def test_fp8_scales_split_with_their_weights_under_ep() -> None:
    # expert 5's gate_proj (128, 256) and its scales (1, 2); ep 2 of tp 2: experts 4-7 on rank 1
    expert = "model.layers.1.mlp.experts.5.gate_proj"
    assert _dsv3_shares(f"{expert}.weight", EngineLayout(2, 2)) == (0, 128 * 256)
    assert _dsv3_shares(f"{expert}.weight_scale_inv", EngineLayout(2, 2)) == (0, 2 * 4)


def test_fp8_blocks_cut_by_a_split_are_refused() -> None:
    # the dense MLP's intermediate size 384 over 2 ranks: 192 columns each, a block and a half
    with pytest.raises(
        ValueError,
        match=r"fp8-block: model\.layers\.0\.mlp\.down_proj\.weight splits 384 over 2 ranks, "
        "192 each: not a multiple of the 128-wide blocks",
    ):
        traffic(DSV3, EngineLayout(2), "nixl", bucket_bytes=1 << 20)
    bf16 = model_tensors(CONFIGS / "small-deepseek-v3.json", "bfloat16")
    assert traffic(bf16, EngineLayout(2), "nixl", bucket_bytes=1 << 20).share_bytes[0] > 0


def test_fused_projections_split_and_unknown_matrices_are_named() -> None:
    fused = [
        TensorMeta("model.layers.0.self_attn.qkv_proj.weight", torch.bfloat16, (96, 32)),
        TensorMeta("model.layers.0.mlp.gate_up_proj.weight", torch.bfloat16, (128, 32)),
        TensorMeta("model.layers.0.mlp.mystery.weight", torch.bfloat16, (8, 32)),
    ]
    config = {"num_attention_heads": 2}
    shares = [rank_shares(meta, config, EngineLayout(2)) for meta in fused]
    assert shares[:2] == [(48 * 32 * BF16,) * 2, (64 * 32 * BF16,) * 2]
    assert shares[2] == (8 * 32 * BF16,) * 2  # no rule: replicated...
    assert unmatched_modules(fused) == ["mystery"]  # ...and said so


def test_expert_tensors_without_an_expert_count_plan_under_tp() -> None:
    meta = TensorMeta("model.layers.0.mlp.experts.3.down_proj.weight", torch.bfloat16, (64, 32))
    assert rank_shares(meta, {}, EngineLayout(2)) == (64 * 16 * BF16,) * 2


def test_model_widths_must_divide_over_the_ranks() -> None:
    with pytest.raises(
        ValueError, match=r"moe_intermediate_size \(32\) is not divisible by 64 ranks"
    ):
        check_layout(
            {**MOE.config, "num_attention_heads": 64, "num_key_value_heads": 64}, EngineLayout(64)
        )
    with pytest.raises(ValueError, match=r"engine ep \(2\): the model has no routed experts"):
        check_layout({"num_attention_heads": 4}, EngineLayout(2, 2))
