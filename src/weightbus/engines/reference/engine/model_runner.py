"""`ModelRunner`: the model, its KV cache, and one forward pass over a packed batch."""

import logging
from dataclasses import dataclass

import torch

from weightbus.engines.reference.engine.kv_cache import KVCache
from weightbus.engines.reference.layers.attention import AttentionMetadata
from weightbus.engines.reference.models.config import ModelConfig
from weightbus.engines.reference.models.llama import LlamaForCausalLM
from weightbus.engines.reference.models.loader import create_model, load_model
from weightbus.engines.reference.models.served import ServedModels

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


@dataclass(frozen=True, slots=True)
class DraftSource:
    """Where a draft model comes from: `tiny` (seeded) or a Hugging Face directory."""

    config: ModelConfig
    source: str
    seed: int = 0


def _kv_cache_shape(
    model: LlamaForCausalLM, max_num_seqs: int, max_model_len: int, dtype: torch.dtype
) -> dict:
    return {
        "num_layers": model.config.num_hidden_layers,
        "num_slots": max_num_seqs,
        "max_model_len": max_model_len,
        "num_kv_heads": model.model.layers[0].self_attn.num_kv_heads,
        "head_dim": model.config.head_dim,
        "dtype": dtype,
    }


class ModelRunner:
    """Owns this rank's model shard (and draft model's), their KV caches; runs forward passes.

    Args:
        config: architecture.
        source: `tiny` or a Hugging Face directory to load weights from.
        dtype: parameter and activation dtype.
        max_num_seqs: KV-cache slots (sequences that can run at once).
        max_model_len: longest sequence (prompt + completion) in tokens.
        seed: seed of the `tiny` weights.
        draft: the draft model for speculative decoding (None: none). It shares the KV-cache
            slots of the main model (a sequence's slot holds both caches).
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
        draft: DraftSource | None = None,
    ) -> None:
        self.config = config
        self.model = create_model(config, dtype)
        load_model(self.model, source, seed)
        self.draft: LlamaForCausalLM | None = None
        if draft is not None:
            self.draft = create_model(draft.config, dtype)
            load_model(self.draft, draft.source, draft.seed)
        self.served = ServedModels(self.model, self.draft)
        self._kv_cache_shapes = [
            _kv_cache_shape(model, max_num_seqs, max_model_len, dtype)
            for model in (self.model, self.draft)
            if model is not None
        ]
        self.kv_cache: KVCache | None = None
        self.draft_kv_cache: KVCache | None = None
        self.resume_kv_cache()
        logger.info(
            "model ready: %d layers, KV cache %d slots x %d tokens (%.1f MiB reserved)",
            config.num_hidden_layers,
            max_num_seqs,
            max_model_len,
            self.kv_cache.nbytes / 2**20,
        )

    def release_kv_cache(self) -> None:
        """Free the KV caches (no sequence may be running)."""
        self.kv_cache = self.draft_kv_cache = None
        for model in (self.model, self.draft):
            for layer in [] if model is None else model.model.layers:
                layer.self_attn.attn.k_cache = layer.self_attn.attn.v_cache = torch.empty(0)

    def resume_kv_cache(self) -> None:
        """Allocate the KV caches (again) and bind them into the models."""
        if self.kv_cache is None:
            self.kv_cache = KVCache(**self._kv_cache_shapes[0])
            self.kv_cache.bind(self.model)
        if self.draft is not None and self.draft_kv_cache is None:
            self.draft_kv_cache = KVCache(**self._kv_cache_shapes[1])
            self.draft_kv_cache.bind(self.draft)

    def copy_kv(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy KV positions `[0, n)` of slot `src` into slot `dst`, for each `(dst, src, n)`
        in order, in every layer (prefix caching; the draft model's cache is not copied)."""
        assert self.kv_cache is not None, "KV copies while the KV cache is released"
        for dst, src, n in copies:
            self.kv_cache.k[:, dst, :n] = self.kv_cache.k[:, src, :n]
            self.kv_cache.v[:, dst, :n] = self.kv_cache.v[:, src, :n]

    @torch.inference_mode()
    def forward(
        self, batch: ModelInput, *, all_logits: bool = False, draft: bool = False
    ) -> torch.Tensor:
        """Run the model (or the draft model) on a packed batch and update its KV cache.

        Args:
            batch: new tokens and their layout.
            all_logits: return logits of every token instead of the last of each sequence.
            draft: run the draft model.

        Returns:
            float32 logits, `[num_seqs, vocab_size]` (or `[num_tokens, vocab_size]`).
        """
        model = self.draft if draft else self.model
        assert model is not None, "this engine has no draft model"
        hidden = model(batch.token_ids, batch.positions(), batch.meta)
        if not all_logits:
            last = torch.tensor(batch.meta.num_new_tokens).cumsum(0) - 1
            hidden = hidden[last]
        return model.compute_logits(hidden).float()
