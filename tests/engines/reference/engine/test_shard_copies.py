"""The slice map (`shard_copies`) is exactly what `load_weights` does, on every rank."""

import pytest
import torch

from weightbus.core.fp8 import Fp8Block, quantize_weights
from weightbus.core.plan.shard import ShardCopy
from weightbus.engines.reference.layers.moe import EXPERT_NAME
from weightbus.engines.reference.layers.parallel import TPContext, tp_context
from weightbus.engines.reference.models.config import ModelConfig, tiny_config
from weightbus.engines.reference.models.experts import ExpertLayout
from weightbus.engines.reference.models.loader import create_model, random_hf_weights


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("num_kv_heads", [4, 1], ids=["kv4", "kv1-replicated"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_applying_the_slice_map_equals_load_weights(tp_size, num_kv_heads, tied):
    config = tiny_config()
    config.num_key_value_heads = num_kv_heads
    config.tie_word_embeddings = tied
    config.__post_init__()
    full = dict(random_hf_weights(config, seed=3))
    for rank in range(tp_size):
        with tp_context(TPContext(tp_rank=rank, tp_size=tp_size)):
            loaded = create_model(config)
            mapped = create_model(config)
        for param in [*loaded.parameters(), *mapped.parameters()]:
            param.data.zero_()
        loaded.load_weights(full.items())
        params = dict(mapped.named_parameters())
        copies = mapped.shard_copies()
        assert sorted(name for name, _, _ in copies) == sorted(full)
        for hf_name, param_name, copy in copies:
            copy.apply(params[param_name].data, full[hf_name])
        for (name, want), (_, got) in zip(
            loaded.named_parameters(), mapped.named_parameters(), strict=True
        ):
            assert torch.equal(got, want), (rank, name)


def test_a_wrong_full_shape_is_named():
    with tp_context(TPContext(tp_rank=0, tp_size=2)):
        model = create_model(tiny_config())
    layer = model.model.layers[0].self_attn.qkv_proj
    with pytest.raises(ValueError, match=r"shape mismatch: expected \(128, 256\), got \(64, 256\)"):
        layer.shard_copy(layer.weight, (64, 256), "k")
    with pytest.raises(ValueError, match="unknown qkv shard id 'x'"):
        layer.shard_copy(layer.weight, (128, 256), "x")


def _moe_config(layout: ExpertLayout, quantization: Fp8Block | None = None) -> ModelConfig:
    config = ModelConfig(
        model_type="qwen3_moe",
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        qk_norm=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=(1,),
        quantization=quantization,
    )
    config.expert_layout = layout
    return config


MOE_LAYOUTS = {
    "tp": ExpertLayout(),
    "ep-linear": ExpertLayout(expert_parallel=True),
    "ep-round-robin-redundant": ExpertLayout(
        expert_parallel=True, placement="round_robin", redundant_experts=2
    ),
}


@pytest.mark.parametrize("fp8", [False, True], ids=["dense", "fp8"])
@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_slice_map_holds_this_ranks_experts_and_equals_load_weights(
    layout: str, fp8: bool
) -> None:
    # 16x16 blocks: at TP 2 each rank's 16 of moe_intermediate_size is one block
    config = _moe_config(MOE_LAYOUTS[layout], Fp8Block(16, 16) if fp8 else None)
    full = dict(random_hf_weights(config, seed=3))
    if fp8:
        full = dict(quantize_weights(full.items(), config.quantization))
    expert_names = {name for name in full if EXPERT_NAME.match(name)}
    # 2 MoE layers (0 and 2), 8 experts, 3 matrices (and their scales)
    assert len(expert_names) == 2 * 8 * 3 * (2 if fp8 else 1)
    for rank in range(2):
        with tp_context(TPContext(tp_rank=rank, tp_size=2)):
            loaded, mapped = create_model(config), create_model(config)
        for param in [*loaded.parameters(), *mapped.parameters()]:
            param.data.zero_()
        assert loaded.load_weights(full.items()) == set(full)  # every name, held or not
        assert loaded.expected_weight_names() == list(full)
        copies = mapped.shard_copies()
        names = [name for name, _, _ in copies]
        assert len(names) == len(set(names))  # one entry per name on a rank
        ep_rank = rank if MOE_LAYOUTS[layout].expert_parallel else 0
        held = set(mapped.expert_map.slots[ep_rank])
        assert set(names) == (set(full) - expert_names) | {
            name for name in expert_names if int(EXPERT_NAME.match(name).group(2)) in held
        }
        params = dict(mapped.named_parameters())
        for hf_name, param_name, copy in copies:
            copy.apply(params[param_name].data, full[hf_name])
        for (name, want), (_, got) in zip(
            loaded.named_parameters(), mapped.named_parameters(), strict=True
        ):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (rank, name)


def test_expert_slices_go_into_the_slot_and_the_ranks_intermediate_range() -> None:
    full_shape, down_shape = (32, 64), (64, 32)
    for layout, rank, expert, want in [
        # TP: every expert on every rank, rows [16, 32) of gate (and of up, after gate's 16)
        ("tp", 1, 5, (16, 0, 16, 5)),
        # EP round-robin with redundancy: rank 1 [1 3 5 7 0]; expert 0 in slot 4, whole
        ("ep-round-robin-redundant", 1, 0, (0, 0, 32, 4)),
    ]:
        with tp_context(TPContext(tp_rank=rank, tp_size=2)):
            model = create_model(_moe_config(MOE_LAYOUTS[layout]))
        experts = model.model.layers[0].mlp.experts
        start, offset, length, slot = want
        assert experts.expert_copy(full_shape, expert, "gate_proj") == (
            "w13_weight",
            ShardCopy(0, start, 0, offset, length, dst_slot=slot),
        )
        assert experts.expert_copy(full_shape, expert, "up_proj")[1] == ShardCopy(
            0, start, 0, offset + length, length, dst_slot=slot
        )
        assert experts.expert_copy(down_shape, expert, "down_proj") == (
            "w2_weight",
            ShardCopy(1, start, 1, 0, length, dst_slot=slot),
        )
    assert experts.expert_copy(full_shape, 2, "gate_proj") == ("w13_weight", None)  # rank 0's


def test_a_wrong_expert_tensor_is_named() -> None:
    model = create_model(_moe_config(ExpertLayout()))
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    with pytest.raises(ValueError, match=rf"tensor '{name}': shape mismatch"):
        model.load_weights([(name, torch.zeros(64, 32))])
    with pytest.raises(
        ValueError, match=r"tensor 'model\.layers\.0\.mlp\.experts\.8.*unknown expert 8"
    ):
        model.load_weights([("model.layers.0.mlp.experts.8.up_proj.weight", torch.zeros(32, 64))])
    with pytest.raises(ValueError, match=r"unknown tensor 'model\.layers\.1\.mlp\.experts\.0"):
        model.load_weights([("model.layers.1.mlp.experts.0.up_proj.weight", torch.zeros(32, 64))])


def test_fp8_expert_scales_go_into_the_slot_in_block_units() -> None:
    with tp_context(TPContext(tp_rank=1, tp_size=2)):
        model = create_model(_moe_config(ExpertLayout(), Fp8Block(16, 16)))
    experts = model.model.layers[0].mlp.experts
    assert tuple(experts.w13_weight_scale_inv.shape) == (8, 2, 4)  # gate block, up block
    assert tuple(experts.w2_weight_scale_inv.shape) == (8, 4, 1)
    assert experts.expert_copy((2, 4), 5, "up_proj", scale=True) == (
        "w13_weight_scale_inv",
        ShardCopy(0, 1, 0, 1, 1, dst_slot=5),
    )
    assert experts.expert_copy((4, 2), 5, "down_proj", scale=True) == (
        "w2_weight_scale_inv",
        ShardCopy(1, 1, 1, 0, 1, dst_slot=5),
    )
    with pytest.raises(ValueError, match="fp8-block: this engine serves"):
        experts.load_expert(torch.zeros(32, 64), 5, "up_proj")
