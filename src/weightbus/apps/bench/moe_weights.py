"""Qwen3-MoE-shaped weights of a chosen size, with the checkpoint's per-expert names."""

import math
from dataclasses import dataclass
from math import prod

import torch

HEAD_DIM = 64


@dataclass(frozen=True, slots=True)
class MoeShape:
    """A Qwen3-MoE: every layer an MoE block of `num_experts` experts, `top_k` per token."""

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    vocab_size: int
    num_layers: int

    @property
    def num_heads(self) -> int:
        return self.hidden_size // HEAD_DIM

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.num_heads // 4)

    def dense_shapes(self, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        """A layer's attention, norms and router."""
        h, q, kv = self.hidden_size, self.num_heads * HEAD_DIM, self.num_kv_heads * HEAD_DIM
        prefix = f"model.layers.{layer}"
        return [
            (f"{prefix}.input_layernorm.weight", (h,)),
            (f"{prefix}.self_attn.q_proj.weight", (q, h)),
            (f"{prefix}.self_attn.k_proj.weight", (kv, h)),
            (f"{prefix}.self_attn.v_proj.weight", (kv, h)),
            (f"{prefix}.self_attn.o_proj.weight", (h, q)),
            (f"{prefix}.self_attn.q_norm.weight", (HEAD_DIM,)),
            (f"{prefix}.self_attn.k_norm.weight", (HEAD_DIM,)),
            (f"{prefix}.post_attention_layernorm.weight", (h,)),
            (f"{prefix}.mlp.gate.weight", (self.num_experts, h)),
        ]

    def expert_shapes(self, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        """A layer's experts, each as the checkpoint names it."""
        h, i = self.hidden_size, self.moe_intermediate_size
        shapes = []
        for expert in range(self.num_experts):
            prefix = f"model.layers.{layer}.mlp.experts.{expert}"
            shapes += [
                (f"{prefix}.gate_proj.weight", (i, h)),
                (f"{prefix}.up_proj.weight", (i, h)),
                (f"{prefix}.down_proj.weight", (h, i)),
            ]
        return shapes

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor's name and shape, in a checkpoint's order."""
        shapes = [("model.embed_tokens.weight", (self.vocab_size, self.hidden_size))]
        for layer in range(self.num_layers):
            shapes += self.dense_shapes(layer) + self.expert_shapes(layer)
        shapes += [
            ("model.norm.weight", (self.hidden_size,)),
            ("lm_head.weight", (self.vocab_size, self.hidden_size)),
        ]
        return shapes

    def expert_numel(self) -> int:
        """Elements of every expert of every layer."""
        return sum(prod(shape) for layer in range(self.num_layers)
                   for _, shape in self.expert_shapes(layer))  # fmt: skip


def moe_shape(total_bytes: int, num_experts: int = 64, top_k: int = 4) -> MoeShape:
    """A bf16 Qwen3-MoE of at least `total_bytes` (hidden 1024, experts of 512, as many layers
    as that takes)."""
    one = MoeShape(1024, 512, num_experts, top_k, 8192, 1)
    fixed = 2 * one.vocab_size * one.hidden_size * 2
    layer = sum(prod(s) for _, s in one.dense_shapes(0) + one.expert_shapes(0)) * 2
    layers = max(1, math.ceil((total_bytes - fixed) / layer))
    return MoeShape(1024, 512, num_experts, top_k, 8192, layers)


def moe_weights(shape: MoeShape, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Random bf16 weights of `shape` (small values, so the model's outputs stay finite)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (name, (torch.randn(dims, generator=generator) * 0.02).to(torch.bfloat16))
        for name, dims in shape.tensor_shapes()
    ]


def moe_config(shape: MoeShape) -> dict:
    """A Hugging Face `config.json` for a Qwen3-MoE of `shape`."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": 4 * shape.hidden_size,
        "moe_intermediate_size": shape.moe_intermediate_size,
        "num_experts": shape.num_experts,
        "num_experts_per_tok": shape.top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
