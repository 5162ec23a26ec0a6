"""Llama-shaped weights of a chosen size, with Hugging Face names, for benchmarks."""

from dataclasses import dataclass

import torch

HEAD_DIM = 64


@dataclass(frozen=True, slots=True)
class LlamaShape:
    hidden_size: int
    intermediate_size: int
    num_kv_dims: int
    vocab_size: int
    num_layers: int

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """HF names and shapes, in the order a state dict lists them."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_kv_dims
        shapes: list[tuple[str, tuple[int, ...]]] = [
            ("model.embed_tokens.weight", (self.vocab_size, h))
        ]
        for layer in range(self.num_layers):
            prefix = f"model.layers.{layer}"
            shapes += [
                (f"{prefix}.self_attn.q_proj.weight", (h, h)),
                (f"{prefix}.self_attn.k_proj.weight", (kv, h)),
                (f"{prefix}.self_attn.v_proj.weight", (kv, h)),
                (f"{prefix}.self_attn.o_proj.weight", (h, h)),
                (f"{prefix}.mlp.gate_proj.weight", (i, h)),
                (f"{prefix}.mlp.up_proj.weight", (i, h)),
                (f"{prefix}.mlp.down_proj.weight", (h, i)),
                (f"{prefix}.input_layernorm.weight", (h,)),
                (f"{prefix}.post_attention_layernorm.weight", (h,)),
            ]
        shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab_size, h))]
        return shapes


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def llama_shape(total_bytes: int, element_bytes: int = 2) -> LlamaShape:
    """The widest Llama-like shape (hidden 4096 down to 64) whose size is near `total_bytes`."""
    for hidden_size in (4096, 2048, 1024, 512, 256, 128, 64):
        # Llama proportions: MLP ~8/3 x hidden (rounded to 256), 4:1 GQA, a 32k vocabulary
        # shrunk for small models so the embeddings do not dominate.
        intermediate_size = max(256, (hidden_size * 8 // 3 + 255) // 256 * 256)
        vocab_size = min(32000, hidden_size * 16)
        # 4:1 GQA, but at least one KV head (small models)
        num_kv_dims = max(HEAD_DIM, hidden_size // 4)
        one_layer = LlamaShape(hidden_size, intermediate_size, num_kv_dims, vocab_size, 1)
        layer_bytes = sum(_numel(s) for _, s in one_layer.tensor_shapes()) * element_bytes
        embed_bytes = 2 * vocab_size * hidden_size * element_bytes
        if layer_bytes <= total_bytes // 2:
            num_layers = max(1, round((total_bytes - embed_bytes) / (layer_bytes - embed_bytes)))
            return LlamaShape(hidden_size, intermediate_size, num_kv_dims, vocab_size, num_layers)
    return LlamaShape(64, 256, HEAD_DIM, 1024, 1)


def llama_weights(
    total_bytes: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """Random Llama-shaped weights of about `total_bytes`, with HF names."""
    shape = llama_shape(total_bytes, dtype.itemsize)
    generator = torch.Generator().manual_seed(seed)
    return [
        (name, torch.randn(dims, generator=generator, dtype=torch.float32).to(dtype))
        for name, dims in shape.tensor_shapes()
    ]


def hf_config(shape: LlamaShape) -> dict:
    """A Hugging Face `config.json` for a Llama of `shape` (head_dim 64)."""
    head_dim = HEAD_DIM
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.hidden_size // head_dim,
        "num_key_value_heads": shape.num_kv_dims // head_dim,
        "head_dim": head_dim,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
