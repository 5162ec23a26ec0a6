"""Causal attention over a per-sequence KV cache, for a batch of variable-length sequences.

The batch is "packed": the tokens of all sequences are concatenated (`[num_tokens, ...]`), and
`AttentionMetadata` says where each sequence starts in the cache and how many new tokens it
brings. Prefill (many new tokens) and decode (one) sequences can share a batch.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-sequence layout of a packed batch.

    Attributes:
        slots: KV-cache slot of each sequence.
        start_positions: tokens already in the cache for each sequence (its first new position).
        num_new_tokens: new tokens of each sequence in this batch, in packing order.
    """

    slots: list[int]
    start_positions: list[int]
    num_new_tokens: list[int]


class Attention(nn.Module):
    """Writes this step's keys/values into the cache, then attends over each sequence's prefix."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        # [num_slots, max_model_len, num_kv_heads, head_dim], set by the model runner
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        offset = 0
        for slot, start, num_new in zip(
            meta.slots, meta.start_positions, meta.num_new_tokens, strict=True
        ):
            end = start + num_new
            new = slice(offset, offset + num_new)
            self.k_cache[slot, start:end] = k[new]
            self.v_cache[slot, start:end] = v[new]
            out[new] = self._attend(q[new], slot, start, end)
            offset += num_new
        return out

    def _attend(self, q: torch.Tensor, slot: int, start: int, end: int) -> torch.Tensor:
        # [1, heads, tokens, head_dim] views, as scaled_dot_product_attention wants them
        query = q.transpose(0, 1).unsqueeze(0)
        key = self.k_cache[slot, :end].transpose(0, 1).unsqueeze(0)
        value = self.v_cache[slot, :end].transpose(0, 1).unsqueeze(0)
        num_new = end - start
        mask, is_causal = None, False
        if num_new > 1 and start == 0:
            is_causal = True  # plain prefill
        elif num_new > 1:
            # new tokens after a cached prefix: token i sees the prefix and new tokens <= i
            mask = torch.ones(num_new, end, dtype=torch.bool).tril(diagonal=start)
        attn = scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            is_causal=is_causal,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return attn.squeeze(0).transpose(0, 1)
