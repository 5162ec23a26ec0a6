"""Per-parameter loaders: every rank's shard is the right slice of the Hugging Face tensors.

Shards of both ranks of TP 2 are built in this process with `tp_context` (loading needs no
process group), then compared with slices of the full tensors.
"""

import pytest
import torch

from weightbus.engines.reference.layers.parallel import TPContext, tp_context
from weightbus.engines.reference.models.config import ModelConfig
from weightbus.engines.reference.models.llama import LlamaForCausalLM, hf_weight_shapes
from weightbus.engines.reference.models.loader import create_model, random_hf_weights


def small_config(**overrides: object) -> ModelConfig:
    fields = {
        "vocab_size": 101,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "qkv_bias": True,
        "o_proj_bias": True,
    }
    return ModelConfig(**(fields | overrides))


def build(config: ModelConfig, tp_rank: int, tp_size: int) -> LlamaForCausalLM:
    with tp_context(TPContext(tp_rank=tp_rank, tp_size=tp_size)):
        return create_model(config)


def full_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    return dict(random_hf_weights(config, seed))


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_tp2_shards_are_slices_of_hf_tensors(num_kv_heads: int) -> None:
    config = small_config(num_key_value_heads=num_kv_heads)
    full = full_weights(config)
    head_dim, q_size = config.head_dim, config.num_attention_heads * config.head_dim
    for rank in range(2):
        model = build(config, rank, 2)
        assert model.load_weights(full.items()) == set(full)
        params = dict(model.named_parameters())
        attn = "model.layers.1.self_attn"
        # q: this rank's half of the heads; k/v: half of the heads, or the one head it shares
        kv_heads_here = max(1, num_kv_heads // 2)
        kv_head0 = rank * num_kv_heads // 2
        kv = slice(kv_head0 * head_dim, (kv_head0 + kv_heads_here) * head_dim)
        q = slice(rank * q_size // 2, (rank + 1) * q_size // 2)
        for suffix in ("weight", "bias"):
            expected = torch.cat(
                [
                    full[f"{attn}.q_proj.{suffix}"][q],
                    full[f"{attn}.k_proj.{suffix}"][kv],
                    full[f"{attn}.v_proj.{suffix}"][kv],
                ]
            )
            assert torch.equal(params[f"{attn}.qkv_proj.{suffix}"], expected)
        half = slice(rank * q_size // 2, (rank + 1) * q_size // 2)
        assert torch.equal(params[f"{attn}.o_proj.weight"], full[f"{attn}.o_proj.weight"][:, half])
        assert torch.equal(params[f"{attn}.o_proj.bias"], full[f"{attn}.o_proj.bias"])
        mlp = "model.layers.1.mlp"
        inter = slice(rank * 24, (rank + 1) * 24)
        expected = torch.cat(
            [full[f"{mlp}.gate_proj.weight"][inter], full[f"{mlp}.up_proj.weight"][inter]]
        )
        assert torch.equal(params[f"{mlp}.gate_up_proj.weight"], expected)
        assert torch.equal(
            params[f"{mlp}.down_proj.weight"], full[f"{mlp}.down_proj.weight"][:, inter]
        )
        norm = "model.layers.1.input_layernorm.weight"
        assert torch.equal(params[norm], full[norm])


def test_vocab_shards_pad_the_last_rank_with_zeros() -> None:
    config = small_config()  # vocab 101 -> 51 rows per rank, the last one padding on rank 1
    full = full_weights(config)
    shards = []
    for rank in range(2):
        model = build(config, rank, 2)
        model.load_weights(full.items())
        shards.append(model.model.embed_tokens.weight)
        assert torch.equal(
            model.lm_head.weight[: 51 - rank], full["lm_head.weight"][rank * 51 :][:51]
        )
    assert torch.equal(torch.cat(shards)[:101], full["model.embed_tokens.weight"])
    assert torch.count_nonzero(shards[1][50:]) == 0


def test_expected_names_cover_every_parameter_once() -> None:
    for tied in (False, True):
        config = small_config(tie_word_embeddings=tied)
        model = build(config, 0, 1)
        names = model.expected_weight_names()
        assert names == list(hf_weight_shapes(config))
        assert ("lm_head.weight" in names) is not tied
        assert model.load_weights(random_hf_weights(config, 0)) == set(names)


def test_tied_head_shares_the_embedding_and_skips_lm_head() -> None:
    config = small_config(tie_word_embeddings=True)
    model = build(config, 0, 1)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    skipped = model.load_weights([("lm_head.weight", torch.zeros(101, 32))])
    assert skipped == set()


def test_unknown_tensor_is_named() -> None:
    model = build(small_config(), 0, 1)
    with pytest.raises(ValueError, match=r"unknown tensor 'model.layers.0.mlp.fc1.weight'"):
        model.load_weights([("model.layers.0.mlp.fc1.weight", torch.zeros(4))])
    with pytest.raises(ValueError, match=r"unknown tensor 'model.layers.9.input_layernorm.weight'"):
        model.load_weights([("model.layers.9.input_layernorm.weight", torch.zeros(32))])


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("model.layers.0.self_attn.k_proj.weight", (8, 32)),
        ("model.layers.0.mlp.up_proj.weight", (48, 31)),
        ("model.layers.1.self_attn.o_proj.weight", (32, 33)),
        ("model.embed_tokens.weight", (100, 32)),
        ("model.norm.weight", (33,)),
    ],
)
def test_shape_mismatch_is_named(name: str, shape: tuple[int, ...]) -> None:
    model = build(small_config(), 1, 2)
    with pytest.raises(ValueError, match=rf"tensor '{name}': shape mismatch: expected .*, got"):
        model.load_weights([(name, torch.zeros(shape))])


def test_reload_copies_in_place_and_keeps_no_reference() -> None:
    config = small_config()
    model = build(config, 1, 2)
    model.load_weights(random_hf_weights(config, 0))
    params = dict(model.named_parameters())
    pointers = {name: p.data_ptr() for name, p in params.items()}

    # new values arrive as views into one flat buffer, as a transport would hand them over
    new = full_weights(config, seed=1)
    subset = {k: v for k, v in new.items() if "layers.1" in k}
    buffer = torch.cat([t.flatten() for t in subset.values()])
    views, offset = [], 0
    for name, tensor in subset.items():
        views.append((name, buffer[offset : offset + tensor.numel()].view(tensor.shape)))
        offset += tensor.numel()
    assert model.load_weights(views) == set(subset)
    buffer.fill_(float("nan"))  # the transport reuses its buffer

    reference = build(config, 1, 2)
    reference.load_weights(random_hf_weights(config, 0))
    reference.load_weights(subset.items())
    for name, param in model.named_parameters():
        assert param.data_ptr() == pointers[name], f"{name} was reallocated"
        assert torch.equal(param, dict(reference.named_parameters())[name]), name


def test_bfloat16_parameters_take_float32_tensors() -> None:
    config = small_config()
    with tp_context(TPContext()):
        model = create_model(config, torch.bfloat16)
    full = full_weights(config)
    model.load_weights(full.items())
    norm = model.model.norm.weight
    assert norm.dtype == torch.bfloat16
    assert torch.equal(norm, full["model.norm.weight"].to(torch.bfloat16))
