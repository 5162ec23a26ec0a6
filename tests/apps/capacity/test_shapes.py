"""`weightbus.apps.capacity.shapes`: the tensors of a push from a config alone, named and shaped as
the model's checkpoint (what transformers' `save_pretrained` writes), MoE experts included."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from weightbus.apps.capacity.shapes import load_config, model_tensors, preset_names

CONFIGS = Path(__file__).parent / "configs"


def _saved_checkpoint(config_path: Path, folder: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the checkpoint transformers saves for this config (real weights)."""
    fields = json.loads(config_path.read_text())
    for key in ("quantization_config", "torch_dtype"):
        fields.pop(key, None)
    model_type = fields.pop("model_type")
    model_type = "deepseek_v3" if model_type == "kimi_k2" else model_type
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))
    model.save_pretrained(folder)
    shapes = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as handle:
            shapes.update({k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()})  # noqa: SIM118
    return shapes


@pytest.mark.parametrize("config", ["small-qwen3-moe.json", "small-deepseek-v3.json"])
def test_names_and_shapes_equal_the_saved_checkpoint(config: str, tmp_path: Path) -> None:
    planned = model_tensors(CONFIGS / config, "bfloat16")
    assert {m.name: m.shape for m in planned.metas} == _saved_checkpoint(CONFIGS / config, tmp_path)


def test_moe_experts_are_per_expert_tensors() -> None:
    metas = {m.name: m for m in model_tensors(CONFIGS / "small-qwen3-moe.json").metas}
    for expert in range(8):
        prefix = f"model.layers.1.mlp.experts.{expert}"
        assert metas[f"{prefix}.gate_proj.weight"].shape == (32, 64)
        assert metas[f"{prefix}.up_proj.weight"].shape == (32, 64)
        assert metas[f"{prefix}.down_proj.weight"].shape == (64, 32)
    assert not any("gate_up_proj" in name for name in metas)
    assert metas["model.layers.1.mlp.gate.weight"].shape == (8, 64)


def test_a_remote_code_model_type_builds_from_its_architecture() -> None:
    assert load_config(CONFIGS / "small-deepseek-v3.json")[1]["model_type"] == "kimi_k2"
    names = {m.name for m in model_tensors(CONFIGS / "small-deepseek-v3.json").metas}
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in names
    assert "model.layers.2.mlp.shared_experts.down_proj.weight" in names


def test_fp8_block_quantizes_decoder_linears_with_block_scales() -> None:
    model = model_tensors(CONFIGS / "small-deepseek-v3.json")  # its config says block FP8
    metas = {m.name: m for m in model.metas}
    expert = "model.layers.1.mlp.experts.3.gate_proj.weight"
    assert metas[expert].dtype == torch.float8_e4m3fn
    assert metas[f"{expert}_scale_inv"].dtype == torch.float32
    assert metas[f"{expert}_scale_inv"].shape == (1, 2)  # (128, 256) in 128x128 blocks
    q_b = "model.layers.0.self_attn.q_b_proj.weight"  # (4 * 48, 128): 2 x 1 blocks
    assert metas[f"{q_b}_scale_inv"].shape == (math.ceil(192 / 128), 1)
    for kept in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.0.input_layernorm.weight",
    ):
        assert metas[kept].dtype == torch.bfloat16
        assert f"{kept}_scale_inv" not in metas
    bf16 = model_tensors(CONFIGS / "small-deepseek-v3.json", "bfloat16")
    assert not any(m.name.endswith("_scale_inv") for m in bf16.metas)


def test_tied_embeddings_are_pushed_once(tmp_path: Path) -> None:
    fields = json.loads((CONFIGS / "small-qwen3-moe.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**fields, "tie_word_embeddings": True}))
    names = {m.name for m in model_tensors(tmp_path).metas}
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names


@pytest.mark.parametrize(
    ("preset", "params"),
    [
        # the model cards: Qwen3-235B-A22B "235B"; DeepSeek-V3 main model 671B (MTP layer
        # not pushed); Kimi-K2 "1T"
        ("qwen3-235b-a22b", 235.09e9),
        ("deepseek-v3", 671.03e9),
        ("kimi-k2", 1026.41e9),
    ],
)
def test_presets_count_the_published_parameters(preset: str, params: float) -> None:
    model = model_tensors(preset, "bfloat16")
    assert model.num_params == pytest.approx(params, rel=1e-4)
    # bf16, but for the routers' float32 correction biases (as the checkpoints store them)
    float32 = sum(m.numel for m in model.metas if m.dtype == torch.float32)
    assert all(
        m.name.endswith("e_score_correction_bias") for m in model.metas if m.dtype == torch.float32
    )
    assert model.total_bytes == 2 * model.num_params + 2 * float32
    assert preset in preset_names()


def test_bad_input_is_named() -> None:
    with pytest.raises(
        FileNotFoundError,
        match=r"no config\.json at 'nope' and no preset of that name; presets: deepseek-v3, kimi",
    ):
        model_tensors("nope")
    with pytest.raises(
        ValueError,
        match="unknown dtype 'int4'; choose one of bfloat16, float16, float32, fp8-block",
    ):
        model_tensors(CONFIGS / "small-qwen3-moe.json", "int4")


def test_unknown_architectures_are_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "mystery", "architectures": ["MysteryForCausalLM"]})
    )
    with pytest.raises(
        ValueError,
        match=r"unknown model_type 'mystery' \(architectures \['MysteryForCausalLM'\]\); "
        "transformers knows neither",
    ):
        model_tensors(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="a config must be a JSON object, got list"):
        model_tensors(tmp_path)


def test_configs_transformers_cannot_build_are_named(tmp_path: Path) -> None:
    fields = json.loads((CONFIGS / "small-qwen3-moe.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**fields, "num_attention_heads": 0}))
    with pytest.raises(ValueError, match="transformers cannot build model_type 'qwen3_moe': "):
        model_tensors(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON: Expecting property name"):
        model_tensors(tmp_path)
