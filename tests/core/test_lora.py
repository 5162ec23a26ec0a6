"""LoRA adapters in one process: what `peft` holds becomes an adapter push (names, config,
refusals), each TP rank holds its slice of A and B, and the reference model with an adapter
computes what transformers + peft compute (subset targets, rsLoRA)."""

import copy
import json

import pytest
import torch
from engine_harness import NUM_GREEDY_TOKENS, PROMPT, greedy_generate, hf_reference

from helpers import SMALL_LLAMA as CONFIG
from weightbus.core.lora import adapter_spec, adapter_tensors, base_weights, check_adapter
from weightbus.core.wire.adapter import AdapterSpec, adapter_names, served_fingerprint
from weightbus.engines.reference.engine.model_runner import ModelRunner
from weightbus.engines.reference.layers.parallel import TPContext, tp_context
from weightbus.engines.reference.models.config import LoraShape, ModelConfig
from weightbus.engines.reference.models.loader import create_model, resolve_config

BASE = "0" * 32


def _peft_model(targets, rank: int = 4, **options):
    """A Llama with a peft adapter whose B is trained away from zero (one SGD step)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    config = LoraConfig(r=rank, lora_alpha=8, target_modules=targets, lora_dropout=0.0, **options)
    model = get_peft_model(copy.deepcopy(base), config)
    ids = torch.randint(
        0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1)
    )
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    return base, model.eval()


@pytest.fixture(scope="module")
def all_linear():
    return _peft_model("all-linear")


def test_a_peft_model_gives_its_adapter_under_peft_names_and_its_base_under_hf_names(all_linear):
    base, model = all_linear
    tensors = adapter_tensors(model)
    a_name, b_name = adapter_names(1, "down_proj")
    assert a_name == "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    assert tensors[a_name].shape == (4, 128)
    assert tensors[b_name].shape == (64, 4)
    assert len(tensors) == 2 * 7 * CONFIG["num_hidden_layers"]
    assert not torch.equal(tensors[b_name], torch.zeros_like(tensors[b_name]))  # trained
    # the same names from the state dict peft saves, with or without the adapter's name
    from peft import get_peft_model_state_dict

    saved = get_peft_model_state_dict(model)
    assert adapter_tensors(saved).keys() == tensors.keys()
    inner = {k.replace("lora_A.weight", "lora_A.default.weight"): v for k, v in saved.items()}
    assert adapter_tensors(inner).keys() == tensors.keys()
    hf = base_weights(model)
    assert hf.keys() == base.state_dict().keys()
    assert all(torch.equal(hf[name], t) for name, t in base.state_dict().items())


def test_a_state_dict_holding_base_weights_is_refused_by_name(all_linear):
    base, _ = all_linear
    with pytest.raises(ValueError, match="is not a LoRA matrix") as refused:
        adapter_tensors(base.state_dict())
    assert str(refused.value) == (
        "adapter: 'model.embed_tokens.weight' is not a LoRA matrix (an adapter push carries "
        "lora_A and lora_B weights only; push the base model without adapter=)"
    )


def test_the_spec_reads_a_peft_config_and_the_adapter_config_json_peft_writes(all_linear, tmp_path):
    _, model = all_linear
    config = model.peft_config["default"]
    spec = adapter_spec(config, BASE)
    model.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    assert spec == adapter_spec(written, BASE)
    assert (spec.r, spec.lora_alpha, spec.scaling) == (4, 8.0, 2.0)
    assert spec.target_modules == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    rslora = adapter_spec({**config.to_dict(), "use_rslora": True}, BASE)
    assert rslora.scaling == 8 / 2  # alpha / sqrt(r)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"use_dora": True}, "adapter: DoRA (use_dora) is not supported (got True)"),
        ({"bias": "lora_only"}, "adapter: LoRA biases (bias) is not supported (got 'lora_only')"),
        ({"fan_in_fan_out": True}, "adapter: fan_in_fan_out is not supported (got True)"),
        (
            {"rank_pattern": {"q_proj": 8}},
            "adapter: per-module ranks (rank_pattern) is not supported (got {'q_proj': 8})",
        ),
        (
            {"alora_invocation_tokens": [5, 6]},
            "adapter: aLoRA (alora_invocation_tokens) is not supported (got [5, 6])",
        ),
        (
            {"layer_replication": [[0, 1]]},
            "adapter: layer_replication is not supported (got [[0, 1]])",
        ),
        (
            {"target_parameters": {"mlp.experts.gate_up_proj"}},
            "adapter: target_parameters is not supported (got {'mlp.experts.gate_up_proj'})",
        ),
        (
            {"target_modules": ["q_proj", "lm_head"]},
            (
                "adapter: target_modules ['lm_head'] are not decoder projections an engine "
                "adapts (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
            ),
        ),
        (
            {"target_modules": ".*proj"},
            (
                "adapter: target_modules must list projections among q_proj, k_proj, v_proj, "
                "o_proj, gate_proj, up_proj, down_proj (got '.*proj'; a regex is not supported)"
            ),
        ),
    ],
)
def test_peft_options_an_engine_cannot_serve_are_refused_by_name(option, message):
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **option}
    with pytest.raises(ValueError, match=r"^adapter: ") as refused:
        adapter_spec(config, BASE)
    assert str(refused.value) == message


def test_options_that_are_off_or_only_describe_training_pass():
    config = {
        "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "modules_to_save": [],
        "bias": "none", "lora_dropout": 0.1, "init_lora_weights": "gaussian",
        "peft_version": "0.21.2", "task_type": "CAUSAL_LM",
        "target_parameters": set(),  # peft 0.21's LoraConfig on a Qwen3-MoE model
    }  # fmt: skip
    assert adapter_spec(config, BASE).target_modules == ["q_proj"]


def test_a_base_fingerprint_that_is_not_one_is_refused():
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    with pytest.raises(ValueError, match="must be a fingerprint") as refused:
        adapter_spec(config, "step-3")
    assert str(refused.value) == (
        "adapter: base_fingerprint must be a fingerprint (32 hex digits), got 'step-3'"
    )


def test_tensors_off_the_config_are_refused_each_named(all_linear):
    _, model = all_linear
    tensors = adapter_tensors(model)
    spec = AdapterSpec(base_fingerprint=BASE, r=8, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"^adapter: ") as refused:
        check_adapter(tensors, spec)
    a_name, b_name = adapter_names(0, "q_proj")
    message = str(refused.value)
    assert f"{a_name}: shape (4, 64) is not of rank 8" in message
    assert f"{b_name}: shape (64, 4) is not of rank 8" in message
    assert f"{adapter_names(0, 'v_proj')[0]}: v_proj is not among target_modules" in message


def test_the_served_fingerprint_names_base_adapter_and_scale():
    spec = AdapterSpec(base_fingerprint=BASE, r=4, lora_alpha=8, target_modules=["q_proj"])
    served = served_fingerprint(spec, "1" * 32)
    assert served not in (BASE, "1" * 32)
    other_base = AdapterSpec(
        base_fingerprint="2" * 32, r=4, lora_alpha=8, target_modules=["q_proj"]
    )
    other_alpha = AdapterSpec(base_fingerprint=BASE, r=4, lora_alpha=16, target_modules=["q_proj"])
    assert served_fingerprint(other_base, "1" * 32) != served
    assert served_fingerprint(other_alpha, "1" * 32) != served
    assert served_fingerprint(spec, "3" * 32) != served
    removal = AdapterSpec(
        base_fingerprint=BASE, r=4, lora_alpha=8, target_modules=["q_proj"], active=False
    )
    assert served_fingerprint(removal, "1" * 32) == BASE  # the base alone
    with pytest.raises(ValueError, match="sorted and distinct"):
        AdapterSpec(base_fingerprint=BASE, r=4, lora_alpha=8, target_modules=["v_proj", "q_proj"])


def test_engine_lora_flags_are_checked_naming_the_flag():
    with pytest.raises(ValueError, match=r"--lora-rank must be in \[1, 4096\], got 0"):
        LoraShape(0)
    with pytest.raises(
        ValueError, match=r"--lora-targets must name projections among .* got qkv_proj"
    ):
        LoraShape(4, ("qkv_proj",))
    with pytest.raises(ValueError, match="--lora-rank with block FP8"):
        resolve_config("tiny", "fp8-block", LoraShape(4))


def _config_with(lora: LoraShape) -> ModelConfig:
    config = ModelConfig.from_hf_dict({**CONFIG, "model_type": "llama", "eos_token_id": None})
    config.lora = lora
    return config


def test_each_rank_holds_its_slice_of_a_and_b(all_linear):
    _, model = all_linear
    tensors = adapter_tensors(model)
    config = _config_with(LoraShape(4))
    for rank in (0, 1):
        with tp_context(TPContext(rank, 2)):
            engine_model = create_model(config)
        assert engine_model.load_adapter(tensors.items()) == set(tensors)
        params = dict(engine_model.named_parameters())
        attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
        q_a, q_b = (tensors[name] for name in adapter_names(0, "q_proj"))
        k_b = tensors[adapter_names(0, "k_proj")[1]]
        o_a, o_b = (tensors[name] for name in adapter_names(0, "o_proj"))
        down_a, down_b = (tensors[name] for name in adapter_names(0, "down_proj"))
        # column-parallel: A whole, B's rows of this rank (q: 2 of 4 heads, k: 1 of 2)
        assert torch.equal(params[f"{attn}.qkv_proj.lora.q_proj.lora_A"], q_a)
        assert torch.equal(params[f"{attn}.qkv_proj.lora.q_proj.lora_B"], q_b[32 * rank :][:32])
        assert torch.equal(params[f"{attn}.qkv_proj.lora.k_proj.lora_B"], k_b[16 * rank :][:16])
        # row-parallel: A's columns of this rank, B whole
        assert torch.equal(params[f"{attn}.o_proj.lora.o_proj.lora_A"], o_a[:, 32 * rank :][:, :32])
        assert torch.equal(params[f"{attn}.o_proj.lora.o_proj.lora_B"], o_b)
        assert torch.equal(
            params[f"{mlp}.down_proj.lora.down_proj.lora_A"], down_a[:, 64 * rank :][:, :64]
        )
        assert torch.equal(params[f"{mlp}.down_proj.lora.down_proj.lora_B"], down_b)
        with pytest.raises(ValueError, match=r"tensor '.*q_proj.lora_A.weight': shape mismatch"):
            engine_model.load_adapter([(adapter_names(0, "q_proj")[0], torch.zeros(8, 64))])


def test_replicated_kv_heads_hold_the_b_rows_of_their_head(all_linear):
    """TP 4 over 2 KV heads: ranks 0-1 hold head 0, ranks 2-3 head 1 (vLLM's rule)."""
    _, model = all_linear
    tensors = adapter_tensors(model)
    k_a, k_b = (tensors[name] for name in adapter_names(1, "k_proj"))
    q_b = tensors[adapter_names(1, "q_proj")[1]]
    for rank in range(4):
        with tp_context(TPContext(rank, 4)):
            engine_model = create_model(_config_with(LoraShape(4)))
        engine_model.load_adapter(tensors.items())
        part = engine_model.model.layers[1].self_attn.qkv_proj.lora
        head = rank // 2
        assert torch.equal(part["k_proj"].lora_A, k_a)
        assert torch.equal(part["k_proj"].lora_B, k_b[16 * head : 16 * (head + 1)])
        assert torch.equal(part["q_proj"].lora_B, q_b[16 * rank : 16 * (rank + 1)])
        assert part["k_proj"].rows == (16, 16)  # after this rank's one q head


def test_a_bf16_engine_applies_a_float32_adapter_as_peft_does(tmp_path):
    """peft keeps an adapter in float32 on a bf16 base (its default): the engine holds it in
    float32 (`--lora-dtype`'s default) and adds the product to the bf16 output, as peft."""
    base, model = _peft_model(["q_proj", "down_proj"], rank=2)
    base.to(torch.bfloat16).save_pretrained(tmp_path)
    model = model.to(torch.bfloat16)
    for name, param in model.named_parameters():
        if "lora_" in name:  # float32, as peft's autocast_adapter_dtype leaves them; a larger
            scale = 20.0 if "lora_B" in name else 1.0  # update, well above bf16's rounding
            param.data = param.data.float() * scale
    config = _config_with(LoraShape(2, ("q_proj", "down_proj")))
    runner = ModelRunner(
        config=config, source=str(tmp_path), dtype=torch.bfloat16, max_num_seqs=1, max_model_len=64
    )
    assert runner.served.weight_dtypes(torch.bfloat16)[adapter_names(0, "q_proj")[0]] == (
        torch.float32
    )
    base_logits, _ = greedy_generate(runner, PROMPT, 2)
    tensors = adapter_tensors(model)
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    runner.served.load_weights(tensors.items())
    runner.served.lora_state.set(True, adapter_spec(model.peft_config["default"], BASE).scaling)
    logits, _ = greedy_generate(runner, PROMPT, 2, slot=0)
    peft_logits, _ = hf_reference(model)
    gap = (logits.float() - peft_logits.float()).abs().max()
    moved = (logits.float() - base_logits.float()).abs().max()
    assert gap < moved / 10, (gap, moved)  # bf16 rounding, far below the adapter's change


@pytest.mark.parametrize("use_rslora", [False, True], ids=["lora", "rslora"])
def test_the_engine_model_with_an_adapter_computes_what_peft_computes(tmp_path, use_rslora):
    """TP 1, an adapter on q_proj and down_proj only: one of each layer kind."""
    base, model = _peft_model(["q_proj", "down_proj"], rank=2, use_rslora=use_rslora)
    base.save_pretrained(tmp_path)
    config = _config_with(LoraShape(2, ("q_proj", "down_proj")))
    runner = ModelRunner(
        config=config, source=str(tmp_path), dtype=torch.float32, max_num_seqs=1, max_model_len=64
    )
    base_logits, base_tokens = greedy_generate(runner, PROMPT, NUM_GREEDY_TOKENS)
    tensors = adapter_tensors(model)
    spec = adapter_spec(model.peft_config["default"], BASE)
    runner.served.load_weights(tensors.items())
    runner.served.lora_state.set(True, spec.scaling)
    logits, tokens = greedy_generate(runner, PROMPT, NUM_GREEDY_TOKENS, slot=0)
    peft_logits, peft_tokens = hf_reference(model)
    torch.testing.assert_close(logits, peft_logits, atol=1e-4, rtol=1e-4)
    assert tokens == peft_tokens
    assert not torch.allclose(logits, base_logits, atol=1e-3)  # the adapter changes outputs
    runner.served.lora_state.set(False, 0.0)  # off: the base's outputs, bit for bit
    off_logits, off_tokens = greedy_generate(runner, PROMPT, NUM_GREEDY_TOKENS)
    assert torch.equal(off_logits, base_logits)
    assert off_tokens == base_tokens
