"""Vocabulary-parallel token embedding and LM head.

The vocabulary is split in contiguous ranges of `ceil(vocab_size / tp_size)` rows; the last
range is padded with zero rows so every rank holds the same shape.
"""

import torch
from torch import nn
from torch.nn.functional import embedding, linear

from weightbus.core.plan.shard import ShardCopy, check_full_shape
from weightbus.engines.reference.layers.parallel import all_gather_last_dim, all_reduce, get_tp


class VocabParallelEmbedding(nn.Module):
    """Embedding table whose rows (token ids) are split over ranks; partial lookups are summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        ctx = get_tp()
        self.tp_rank, self.tp_size = ctx.tp_rank, ctx.tp_size
        if num_embeddings < self.tp_size:
            raise ValueError(f"vocab_size ({num_embeddings}) is smaller than tp_size")
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(
            self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings
        )
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def shard_copy(
        self, param: nn.Parameter, full_shape: tuple[int, ...], shard_id: None = None
    ) -> ShardCopy:
        """This rank's vocabulary range; the padding rows after it stay zero."""
        check_full_shape(full_shape, (self.num_embeddings, param.shape[1]))
        num_rows = self.vocab_end_index - self.vocab_start_index
        return ShardCopy(0, self.vocab_start_index, 0, 0, num_rows)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy = self.shard_copy(param, tuple(loaded.shape))
        copy.apply(param.data, loaded)
        param.data[copy.length :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index) * in_range
        out = embedding(local_ids, self.weight)
        out.masked_fill_(~in_range.unsqueeze(-1), 0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to vocabulary logits; each rank computes its range, then all gather."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden_states, self.weight)
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits)[..., : self.num_embeddings]
        return logits
