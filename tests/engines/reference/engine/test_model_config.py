"""`ModelConfig` from Hugging Face config.json dicts, and errors that name the field or flag."""

import pytest

from weightbus.core.fp8 import Fp8Block
from weightbus.engines.reference.models.config import LoraShape, ModelConfig, tiny_config
from weightbus.engines.reference.models.experts import ExpertLayout
from weightbus.engines.reference.server.launcher import ServeConfig

LLAMA = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "eos_token_id": [1, 2],
}


def test_transformers4_rope_fields() -> None:
    config = ModelConfig.from_hf_dict(
        LLAMA | {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.head_dim == 16
    assert config.eos_token_ids == (1, 2)


def test_transformers5_rope_parameters() -> None:
    rope = {"rope_type": "default", "rope_theta": 1000.0}
    config = ModelConfig.from_hf_dict(LLAMA | {"rope_parameters": rope, "head_dim": 32})
    assert (config.rope_theta, config.rope_scaling, config.head_dim) == (1000.0, None, 32)


def test_qwen2_has_qkv_bias_only() -> None:
    config = ModelConfig.from_hf_dict(LLAMA | {"model_type": "qwen2"})
    assert (config.qkv_bias, config.o_proj_bias) == (True, False)
    llama = ModelConfig.from_hf_dict(LLAMA | {"attention_bias": True})
    assert (llama.qkv_bias, llama.o_proj_bias) == (True, True)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"eos_token_id": 500}, "eos_token_id"),
    ],
)
def test_unsupported_fields_are_named(override: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict(LLAMA | override)


def test_tp_must_split_heads() -> None:
    config = tiny_config()
    config.validate_tp(2)
    with pytest.raises(ValueError, match=r"--tp 3 does not split this model: num_attention_heads"):
        config.validate_tp(3)
    # 3 KV heads can be neither split over 4 ranks nor replicated evenly
    gqa = ModelConfig.from_hf_dict(
        LLAMA | {"num_attention_heads": 12, "num_key_value_heads": 3, "head_dim": 16}
    )
    with pytest.raises(ValueError, match=r"--tp 4 .*num_key_value_heads"):
        gqa.validate_tp(4)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"tp_size": 0}, "--tp"),
        ({"port": 70000}, "--port"),
        ({"dtype": "float64"}, "--dtype"),
        ({"model": "/nonexistent"}, "--model"),
        ({"max_num_seqs": 0}, "--max-num-seqs"),
        ({"max_model_len": 1}, "--max-model-len"),
    ],
)
def test_serve_flags_are_named(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        ServeConfig(**kwargs)


QWEN3_MOE = LLAMA | {
    "model_type": "qwen3_moe",
    "head_dim": 16,
    "num_hidden_layers": 4,
    "num_local_experts": 8,  # transformers 5's name of num_experts
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
}


def test_qwen3_has_qk_norm_and_attention_bias_on_all_projections() -> None:
    config = ModelConfig.from_hf_dict(LLAMA | {"model_type": "qwen3", "attention_bias": True})
    assert (config.qk_norm, config.qkv_bias, config.o_proj_bias) == (True, True, True)
    assert config.moe_layers == ()


def test_qwen3_moe_fields() -> None:
    config = ModelConfig.from_hf_dict(QWEN3_MOE)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        8,
        2,
        32,
    )
    assert config.norm_topk_prob
    assert config.qk_norm
    assert config.moe_layers == (0, 2, 3)


@pytest.mark.parametrize(("step", "mlp_only"), [(1, []), (2, []), (1, [0, 3]), (2, [1])])
def test_moe_layers_are_transformers_sparse_blocks(step: int, mlp_only: list[int]) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fields = {"decoder_sparse_step": step, "mlp_only_layers": mlp_only}
    hf = {key: value for key, value in QWEN3_MOE.items() if key != "model_type"} | fields
    hf_model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf))
    sparse = tuple(i for i, layer in enumerate(hf_model.model.layers) if hasattr(layer.mlp, "gate"))
    assert ModelConfig.from_hf_dict(QWEN3_MOE | fields).moe_layers == sparse


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok must be in"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size must be"),
        ({"mlp_only_layers": [4]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ],
)
def test_moe_fields_are_named(override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(QWEN3_MOE | override)


def test_experts_need_a_moe_model_type() -> None:
    dense = ModelConfig.from_hf_dict(LLAMA | {"model_type": "qwen3"})
    dense.num_experts = 8
    with pytest.raises(ValueError, match="num_experts: model_type qwen3 has no experts"):
        dense.__post_init__()


def test_expert_layouts_are_checked_against_the_model() -> None:
    moe = ModelConfig.from_hf_dict(QWEN3_MOE)
    moe.validate_tp(2)
    with pytest.raises(ValueError, match=r"--tp 4 does not split this model: moe_intermediate"):
        ModelConfig.from_hf_dict(QWEN3_MOE | {"moe_intermediate_size": 30}).validate_tp(4)
    moe.expert_layout = ExpertLayout(expert_parallel=True, redundant_experts=1)
    with pytest.raises(ValueError, match=r"9 physical slots do not divide over 2 expert-parallel"):
        moe.validate_tp(2)
    moe.expert_layout = ExpertLayout(expert_parallel=True, redundant_experts=2)
    moe.validate_tp(2)
    dense = ModelConfig.from_hf_dict(LLAMA)
    dense.expert_layout = ExpertLayout(expert_parallel=True)
    with pytest.raises(ValueError, match="--expert-parallel needs a mixture-of-experts model"):
        dense.validate_options()


def test_mlp_adapters_are_refused_on_moe() -> None:
    moe = ModelConfig.from_hf_dict(QWEN3_MOE)
    moe.lora = LoraShape(8, ("q_proj", "up_proj"))
    with pytest.raises(ValueError, match="--lora-targets up_proj: the experts"):
        moe.validate_options()
    moe.lora = LoraShape(8, ("q_proj", "v_proj"))
    moe.validate_options()


def test_fp8_experts_split_over_tp_on_block_edges_only() -> None:
    moe = ModelConfig.from_hf_dict(QWEN3_MOE | {"moe_intermediate_size": 48})
    moe.quantization = Fp8Block(16, 16)
    with pytest.raises(ValueError, match="moe_intermediate_size gives 24 per rank, not a multiple"):
        moe.validate_tp(2)
    moe.expert_layout = ExpertLayout(expert_parallel=True)  # whole experts: any size
    moe.validate_tp(2)


def test_intermediate_size_is_not_checked_when_every_layer_is_moe() -> None:
    ModelConfig.from_hf_dict(
        QWEN3_MOE | {"intermediate_size": 7, "mlp_only_layers": []}
    ).validate_tp(2)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"redundant_experts": 2}, "--redundant-experts needs --expert-parallel"),
        ({"expert_placement": "round_robin"}, "--expert-placement round_robin needs"),
        ({"expert_parallel": True, "expert_placement": "random"}, "--expert-placement must"),
        ({"expert_parallel": True, "redundant_experts": -1}, "--redundant-experts must be"),
    ],
)
def test_expert_flags_are_named(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        ServeConfig(**kwargs)


def test_serving_a_dense_model_expert_parallel_is_refused() -> None:
    from weightbus.engines.reference.server.launcher import checked_model

    with pytest.raises(ValueError, match="--expert-parallel needs a mixture-of-experts model"):
        checked_model(ServeConfig(tp_size=2, expert_parallel=True))
