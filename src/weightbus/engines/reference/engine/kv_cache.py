"""The KV cache: one contiguous `[max_model_len]` region per sequence slot, per layer.

A slot is the simplest cache layout that supports continuous batching: a sequence owns one
slot from admission to finish, and its position `p` lives at index `p` of that slot. Pages
(vLLM's blocks) would share memory better; slots keep the attention a plain slice.
"""

import torch

from weightbus.engines.reference.models.llama import LlamaForCausalLM


class KVCache:
    """Keys and values of every layer for `num_slots` sequences, bound into the model."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        max_model_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        shape = (num_layers, num_slots, max_model_len, num_kv_heads, head_dim)
        # zeros, not empty: the OS maps untouched pages lazily, so unused slots cost nothing
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.num_slots = num_slots
        self.max_model_len = max_model_len

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def bind(self, model: LlamaForCausalLM) -> None:
        """Point every attention layer of `model` at its layer of this cache."""
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.attn.k_cache = self.k[i]
            layer.self_attn.attn.v_cache = self.v[i]
