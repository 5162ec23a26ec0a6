"""`ModelConfig` from Hugging Face config.json dicts, and errors that name the field or flag."""

import pytest

from weightbus.engines.reference.models.config import ModelConfig, tiny_config
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
