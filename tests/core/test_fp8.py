"""Block-FP8 quantization (`weightbus.core.fp8`) against a quantizer written here from the
published definition, block by block; NaN/inf refused by name; the reference engine's FP8
layers hold each rank's slice of the weights and of their scales, and compute what
transformers computes on the dequantized weights."""

import copy
import json
import math

import pytest
import torch
from engine_harness import (
    NUM_GREEDY_TOKENS,
    PROMPT,
    fp8_block_llama,
    greedy_generate,
    hf_reference,
)
from safetensors.torch import save_file

from weightbus.core.digest import fingerprint_of_digests, fingerprint_of_tensors
from weightbus.core.finite import NonFiniteWeightsError
from weightbus.core.fp8 import (
    FP8_DTYPE,
    Fp8Block,
    dequantize,
    dequantize_weights,
    dequantized_model,
    quantize,
    quantize_weights,
)
from weightbus.core.publisher.probe import ROUNDING_MARGIN, LogprobProbe
from weightbus.engines.reference.engine.model_runner import ModelRunner
from weightbus.engines.reference.layers.parallel import TPContext, tp_context
from weightbus.engines.reference.models.config import ModelConfig
from weightbus.engines.reference.models.loader import (
    create_model,
    load_model,
    random_hf_weights,
    resolve_config,
    weights_records,
)
from weightbus.engines.reference.server.launcher import ServeConfig, checked_model

BLOCK = Fp8Block()


def reference_quantize(weight: torch.Tensor, rows: int = 128, cols: int = 128):
    """DeepSeek-V3's block FP8, one block at a time: scale = max(amax, 1e-4) / 448, value =
    clamp(w / scale, +-448) rounded to float8_e4m3fn."""
    out = torch.empty(weight.shape, dtype=FP8_DTYPE)
    scales = torch.empty(math.ceil(weight.shape[0] / rows), math.ceil(weight.shape[1] / cols))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = weight[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].float()
            scale = torch.clamp(block.abs().max(), min=1e-4) / 448.0
            scales[i, j] = scale
            out[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] = torch.clamp(
                block / scale, -448.0, 448.0
            ).to(FP8_DTYPE)
    return out, scales


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (128, 1), (5, 7)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantize_is_bit_exact_against_the_published_definition(shape, dtype):
    weight = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    weight[: min(shape[0], 128), : min(shape[1], 128)] *= 1e-6  # a block of tiny values
    fp8, scale_inv = quantize("w", weight, BLOCK)
    expected_fp8, expected_scales = reference_quantize(weight)
    assert (fp8.dtype, scale_inv.dtype) == (FP8_DTYPE, torch.float32)
    assert torch.equal(fp8.view(torch.uint8), expected_fp8.view(torch.uint8))
    assert torch.equal(scale_inv, expected_scales)
    # what it stands for is within e4m3's half-ulp (2**-4 relative) of every value
    error = (dequantize(fp8, scale_inv, BLOCK) - weight.float()).abs()
    assert bool((error <= weight.float().abs() / 16 + scale_inv.max() / 2**9).all())


def test_an_all_zero_block_keeps_a_finite_scale():
    fp8, scale_inv = quantize("w", torch.zeros(130, 130), BLOCK)
    assert torch.equal(scale_inv, torch.full((2, 2), 1e-4 / 448))
    assert torch.equal(fp8.float(), torch.zeros(130, 130))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_are_refused_naming_the_tensor(bad):
    weights = {
        "model.layers.0.mlp.up_proj.weight": torch.ones(8, 8),
        "model.layers.1.mlp.up_proj.weight": torch.ones(8, 8),
    }
    weights["model.layers.1.mlp.up_proj.weight"][3, 4] = bad
    counts = "(1 NaN, 0 inf)" if math.isnan(bad) else "(0 NaN, 1 inf)"
    weights["model.layers.0.mlp.up_proj.weight"][0, 0] = bad
    with pytest.raises(NonFiniteWeightsError) as refused:
        dict(quantize_weights(weights.items(), BLOCK))
    assert str(refused.value) == (
        f"fp8-block: model.layers.0.mlp.up_proj.weight {counts} cannot be quantized"
    )


def test_only_decoder_layer_matrices_are_quantized_each_followed_by_its_scales():
    weights = {
        "model.embed_tokens.weight": torch.randn(16, 8),
        "model.layers.0.input_layernorm.weight": torch.randn(8),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(8),
        "model.layers.0.mlp.gate.weight": torch.randn(4, 8),  # an MoE router
        "lm_head.weight": torch.randn(16, 8),
        "draft.model.layers.0.mlp.up_proj.weight": torch.randn(8, 8),
    }
    served = dict(quantize_weights(weights.items(), BLOCK))
    quantized = "model.layers.0.self_attn.q_proj.weight"
    assert list(served) == [*list(weights)[:3], quantized + "_scale_inv", *list(weights)[3:]]
    assert {n for n, t in served.items() if t.dtype == FP8_DTYPE} == {quantized}
    restored = dict(dequantize_weights(served.items(), BLOCK))
    assert list(restored) == list(weights)
    assert torch.allclose(restored[quantized], weights[quantized], rtol=2**-4, atol=1e-6)


def test_scales_of_another_block_count_are_refused():
    fp8, scale_inv = quantize("w", torch.randn(256, 256), BLOCK)
    with pytest.raises(ValueError, match=r"scale_inv shape \(2, 1\) is not one per \(128, 128\)"):
        dequantize(fp8, scale_inv[:, :1], BLOCK)


def test_block_sizes_come_from_the_checkpoint_config():
    assert Fp8Block.from_hf_config(Fp8Block(64, 32).hf_config()) == Fp8Block(64, 32)
    with pytest.raises(ValueError, match="only block FP8 is supported"):
        Fp8Block.from_hf_config({"quant_method": "fp8"})
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        Fp8Block.from_hf_config({"quant_method": "awq"})
    with pytest.raises(ValueError, match="activation_scheme 'static' is not supported"):
        Fp8Block.from_hf_config({**Fp8Block().hf_config(), "activation_scheme": "static"})
    with pytest.raises(ValueError, match="fmt 'e5m2' is not supported"):
        Fp8Block.from_hf_config({**Fp8Block().hf_config(), "fmt": "e5m2"})
    e5m2 = [("model.layers.0.mlp.up_proj.weight", torch.ones(4, 4).to(torch.float8_e5m2))]
    with pytest.raises(ValueError, match=r"is torch\.float8_e5m2, not float8_e4m3fn"):
        dict(quantize_weights(e5m2, BLOCK))


# --- the reference engine's FP8 layers ---

# 128-aligned at TP 2: q and kv 128 rows per rank, o_proj and down_proj 128/256 columns
CONFIG = {
    "vocab_size": 101,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 64,
}


def _config(**overrides) -> ModelConfig:
    return ModelConfig(**{**CONFIG, **overrides}, quantization=BLOCK)


def _checkpoint(tmp_path, config: ModelConfig) -> tuple[str, dict[str, torch.Tensor]]:
    """An FP8 Hugging Face directory of random weights, and its dense tensors."""
    dense = dict(random_hf_weights(config, seed=3))
    fp8 = dict(quantize_weights(dense.items(), BLOCK))
    save_file(fp8, str(tmp_path / "model.safetensors"))
    hf = {
        "model_type": "llama",
        **CONFIG,
        "rms_norm_eps": 1e-6,
        "quantization_config": BLOCK.hf_config(),
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return str(tmp_path), fp8


def test_each_rank_holds_its_slice_of_the_weights_and_of_their_scales(tmp_path):
    config = _config()
    path, fp8 = _checkpoint(tmp_path, config)
    assert ModelConfig.from_hf_dir(path).quantization == BLOCK
    ranks = []
    for rank in (0, 1):
        with tp_context(TPContext(rank, 2)):
            model = create_model(config)
        load_model(model, path)
        ranks.append(dict(model.named_parameters()))
    layer = "model.layers.1"
    q = fp8[f"{layer}.self_attn.q_proj.weight_scale_inv"]
    k = fp8[f"{layer}.self_attn.k_proj.weight_scale_inv"]
    o = fp8[f"{layer}.self_attn.o_proj.weight_scale_inv"]
    up = fp8[f"{layer}.mlp.up_proj.weight_scale_inv"]
    for rank, params in enumerate(ranks):
        qkv = params[f"{layer}.self_attn.qkv_proj.weight_scale_inv"]
        assert torch.equal(qkv[:1], q[rank : rank + 1])  # 256 q rows: one block per rank
        assert torch.equal(qkv[1:2], k[rank : rank + 1])
        assert torch.equal(
            params[f"{layer}.self_attn.o_proj.weight_scale_inv"], o[:, rank : rank + 1]
        )
        gate_up = params[f"{layer}.mlp.gate_up_proj.weight_scale_inv"]
        assert torch.equal(gate_up[2:], up[2 * rank : 2 * rank + 2])
        down = params[f"{layer}.mlp.down_proj.weight"]
        full_down = fp8[f"{layer}.mlp.down_proj.weight"]
        assert torch.equal(
            down.view(torch.uint8), full_down[:, 256 * rank : 256 * (rank + 1)].view(torch.uint8)
        )


def test_an_fp8_checkpoint_computes_what_transformers_computes_on_its_dequantized_weights(
    tmp_path,
):
    from transformers import LlamaConfig, LlamaForCausalLM

    path, fp8 = _checkpoint(tmp_path, _config())
    runner = ModelRunner(
        config=ModelConfig.from_hf_dir(path),
        source=path,
        dtype=torch.float32,
        max_num_seqs=1,
        max_model_len=64,
    )
    logits, tokens = greedy_generate(runner, PROMPT, NUM_GREEDY_TOKENS)
    hf = LlamaForCausalLM(LlamaConfig(**CONFIG, rms_norm_eps=1e-6, tie_word_embeddings=False))
    hf.load_state_dict(dict(dequantize_weights(fp8.items(), BLOCK)))
    hf_logits, hf_tokens = hf_reference(hf.eval())
    torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=1e-4)
    assert tokens == hf_tokens


def test_a_split_off_block_edges_is_refused_naming_the_field():
    config = _config(num_key_value_heads=2)
    with pytest.raises(ValueError, match="fp8 blocks") as refused:
        config.validate_tp(2)
    assert str(refused.value) == (
        "--tp 2 does not split this model on fp8 blocks of 128x128: num_key_value_heads * "
        "head_dim gives 64 per rank, not a multiple of 128"
    )
    with tp_context(TPContext(0, 2)), pytest.raises(ValueError, match="not a multiple of the"):
        create_model(config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_an_engine_quantizing_at_load_reports_what_a_trainer_in_its_dtype_pushes(dtype):
    """`--quantization fp8-block --dtype D` on a float32 checkpoint quantizes the values in D,
    as a trainer holding the weights in D does in its push: one fingerprint."""
    records = weights_records("tiny", resolve_config("tiny", "fp8-block"), 0, dtype)
    trainer = [(n, t.to(dtype)) for n, t in random_hf_weights(resolve_config("tiny"), 0)]
    pushed = fingerprint_of_tensors(quantize_weights(trainer, BLOCK))
    assert fingerprint_of_digests(records) == pushed


def test_an_fp8_draft_is_refused_at_start(tmp_path):
    path, _ = _checkpoint(tmp_path, _config())
    config = ServeConfig(model="tiny", draft_model=path, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="--draft-model is an FP8 checkpoint: a draft is served"):
        checked_model(config)


def test_a_bf16_models_quantized_probe_passes_bf16_rounding_and_fails_misplaced_scales():
    """The default tolerance of a bf16 model's probe is above what a bf16 engine's rounding
    does to the logprobs (up to twice the trainer's own over float32: ROUNDING_MARGIN is 4)
    and below what scales loaded into the wrong blocks do."""
    model = fp8_block_llama().to(torch.bfloat16)  # bf16, in whole 128x128 blocks
    probe = LogprobProbe.of_quantized_model(model, PROMPT, BLOCK)
    served = dequantized_model(model, BLOCK)
    in_float32 = LogprobProbe.of_model(copy.deepcopy(served).float(), PROMPT, tolerance=1.0)
    rounding = probe.gap(in_float32.logprobs)
    assert 0 < ROUNDING_MARGIN * rounding <= probe.tolerance
    # a matrix whose blocks differ in scale (its first 128 rows 8x the rest), its scales swapped
    name = "model.layers.0.mlp.down_proj.weight"
    weights = dict(served.named_parameters())
    with torch.no_grad():
        weight = weights[name].float()
        weight[:128] *= 8
        fp8, scale_inv = quantize(name, weight, BLOCK)
        weights[name].copy_(dequantize(fp8, scale_inv.flip(0), BLOCK))
    misloaded = LogprobProbe.of_model(served, PROMPT, tolerance=1.0)
    assert probe.gap(misloaded.logprobs) > probe.tolerance
