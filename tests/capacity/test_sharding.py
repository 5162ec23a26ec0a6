"""`weightbus.capacity.sharding` and `traffic`: what each engine rank holds and receives, by the
tensor- and expert-parallel rules, checked on small configs whose shares are known by hand."""

from pathlib import Path

import pytest

from weightbus.capacity.shapes import model_tensors
from weightbus.capacity.sharding import EngineLayout, rank_shares, split_length
from weightbus.capacity.traffic import traffic

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
    scatter = traffic(MOE, layout, "dist", replicas=3, bucket_bytes=1 << 20)
    broadcast = traffic(MOE, layout, "dist-broadcast", replicas=3, bucket_bytes=1 << 20)
    assert scatter.transport == "dist-scatter"  # dist's auto: every rank has tp > 1
    assert scatter.receive_bytes == scatter.share_bytes
    assert sum(scatter.trainer_send_bytes) == 3 * sum(scatter.share_bytes)
    assert broadcast.receive_bytes == (MOE.total_bytes,) * 2
    assert broadcast.trainer_send_bytes == (MOE.total_bytes,)
    spread = traffic(MOE, layout, "nixl", replicas=3, trainer_ranks=4, bucket_bytes=1 << 20)
    assert sum(spread.trainer_send_bytes) == 3 * sum(spread.share_bytes)
    assert (
        max(spread.trainer_send_bytes) - min(spread.trainer_send_bytes)
        <= max(m.nbytes for m in MOE.metas) * 6
    )


def test_layouts_the_model_cannot_take_are_refused() -> None:
    with pytest.raises(ValueError, match=r"engine tp \(3\) must divide num_attention_heads \(4\)"):
        traffic(MOE, EngineLayout(3), "nixl", bucket_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"engine ep \(3\) must divide engine tp \(4\)"):
        EngineLayout(4, 3)
    with pytest.raises(
        ValueError, match="unknown transport 'tcp'; choose one of shm, shm-slots, nixl, dist"
    ):
        traffic(MOE, EngineLayout(2), "tcp", bucket_bytes=1 << 20)
