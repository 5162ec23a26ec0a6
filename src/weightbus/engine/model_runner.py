"""`ModelRunner`: the model, its KV cache, and one forward pass over a packed batch."""

import logging
from dataclasses import dataclass

import torch

from weightbus.engine.kv_cache import KVCache
from weightbus.layers.attention import AttentionMetadata
from weightbus.models.config import ModelConfig
from weightbus.models.loader import create_model, load_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelInput:
    """A packed batch: new token ids of all sequences, concatenated, and their layout."""

    token_ids: torch.Tensor  # int64 [num_tokens]
    meta: AttentionMetadata

    def positions(self) -> torch.Tensor:
        """Position of every packed token (each sequence continues from its cached prefix)."""
        return torch.cat(
            [
                torch.arange(start, start + num_new)
                for start, num_new in zip(
                    self.meta.start_positions, self.meta.num_new_tokens, strict=True
                )
            ]
        )


class ModelRunner:
    """Owns this rank's model shard and KV cache; runs forward passes.

    Args:
        config: architecture.
        source: `tiny` or a Hugging Face directory to load weights from.
        dtype: parameter and activation dtype.
        max_num_seqs: KV-cache slots (sequences that can run at once).
        max_model_len: longest sequence (prompt + completion) in tokens.
        seed: seed of the `tiny` weights.
    """

    def __init__(
        self,
        *,
        config: ModelConfig,
        source: str,
        dtype: torch.dtype,
        max_num_seqs: int,
        max_model_len: int,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.model = create_model(config, dtype)
        load_model(self.model, source, seed)
        self._kv_cache_shape = {
            "num_layers": config.num_hidden_layers,
            "num_slots": max_num_seqs,
            "max_model_len": max_model_len,
            "num_kv_heads": self.model.model.layers[0].self_attn.num_kv_heads,
            "head_dim": config.head_dim,
            "dtype": dtype,
        }
        self.kv_cache: KVCache | None = None
        self.resume_kv_cache()
        logger.info(
            "model ready: %d layers, KV cache %d slots x %d tokens (%.1f MiB reserved)",
            config.num_hidden_layers,
            max_num_seqs,
            max_model_len,
            self.kv_cache.nbytes / 2**20,
        )

    def release_kv_cache(self) -> None:
        """Free the KV cache (no sequence may be running)."""
        self.kv_cache = None
        for layer in self.model.model.layers:
            layer.self_attn.attn.k_cache = layer.self_attn.attn.v_cache = torch.empty(0)

    def resume_kv_cache(self) -> None:
        """Allocate the KV cache (again) and bind it into the model."""
        if self.kv_cache is None:
            self.kv_cache = KVCache(**self._kv_cache_shape)
            self.kv_cache.bind(self.model)

    @torch.inference_mode()
    def forward(self, batch: ModelInput, *, all_logits: bool = False) -> torch.Tensor:
        """Run the model on a packed batch and update the KV cache.

        Args:
            batch: new tokens and their layout.
            all_logits: return logits of every token instead of the last of each sequence.

        Returns:
            float32 logits, `[num_seqs, vocab_size]` (or `[num_tokens, vocab_size]`).
        """
        hidden = self.model(batch.token_ids, batch.positions(), batch.meta)
        if not all_logits:
            last = torch.tensor(batch.meta.num_new_tokens).cumsum(0) - 1
            hidden = hidden[last]
        return self.model.compute_logits(hidden).float()
