"""Speculative decoding with a draft model: the draft proposes, the model verifies in one pass.

A speculative step replaces a decode step when every sequence of the batch is decoding:

    plan_step (rank 0) -> propose (K draft passes) -> verify (one model pass) -> accept (rank 0)

- `plan_step`: how many tokens each sequence may propose (`num_speculative_tokens`, fewer when
  `max_tokens` or the context length leave less room: a step never generates past them), and
  what the draft's KV cache lacks of each sequence (it catches up lazily, at its first pass).
  Rank 0 broadcasts the plan after the batch, so every rank runs the same passes.
- `propose` (all ranks): draft pass `t` feeds what the draft lacks (t = 0) or proposal `t - 1`;
  rank 0 picks proposal `t` (argmax, or a draw from the sampler's distribution with the
  sequence's generator) and broadcasts the proposals, so every rank feeds the same tokens.
- `verify` (all ranks): the model runs the sequences' uncached tokens plus their proposals in
  one forward pass, with the logits of every position.
- `accept` (rank 0): `rejection.accept_greedy` / `rejection.accept_sampled` keep a prefix of
  the proposals and add one token of the model's. Other ranks need not know: the model's KV
  entries of rejected proposals are overwritten later, since attention reads a slot only up to
  the sequence's length and `num_cached_tokens` counts the valid entries.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from weightbus.engines.reference.engine.model_runner import ModelInput, ModelRunner
from weightbus.engines.reference.engine.rejection import accept_greedy, accept_sampled
from weightbus.engines.reference.engine.sampler import SampleResult, sampling_probs, token_logprobs
from weightbus.engines.reference.engine.scheduler import Scheduler
from weightbus.engines.reference.engine.sequence import Sequence
from weightbus.engines.reference.layers.attention import AttentionMetadata


@dataclass(frozen=True, slots=True)
class SpecPlan:
    """What every rank needs to run one speculative step (rank 0 builds it).

    Attributes:
        num_proposals: draft tokens each sequence proposes (0: it only samples the model).
        draft_start_positions: tokens of each sequence the draft's KV cache holds.
        draft_token_ids: the tokens it lacks (up to the sequence's last), fed at its first pass.
    """

    num_proposals: list[int]
    draft_start_positions: list[int]
    draft_token_ids: list[list[int]]

    @property
    def num_passes(self) -> int:
        """Draft forward passes of the step."""
        return max(self.num_proposals)

    def seq_lens(self) -> list[int]:
        """Length of each sequence before the step."""
        return [
            start + len(tokens)
            for start, tokens in zip(self.draft_start_positions, self.draft_token_ids, strict=True)
        ]

    def pack(self) -> torch.Tensor:
        """int64 `[num_proposals | draft starts | draft counts | draft token ids]`."""
        counts = [len(tokens) for tokens in self.draft_token_ids]
        flat = [t for tokens in self.draft_token_ids for t in tokens]
        return torch.tensor(
            [*self.num_proposals, *self.draft_start_positions, *counts, *flat], dtype=torch.int64
        )

    @staticmethod
    def unpack(payload: torch.Tensor, num_seqs: int) -> "SpecPlan":
        """The plan `pack` wrote, for a batch of `num_seqs` sequences."""
        num_proposals, starts, counts = payload[: 3 * num_seqs].view(3, num_seqs).tolist()
        flat = payload[3 * num_seqs :].split(counts)
        return SpecPlan(num_proposals, starts, [tokens.tolist() for tokens in flat])


def plan_step(
    batch: list[Sequence], num_speculative_tokens: int, scheduler: Scheduler
) -> SpecPlan | None:
    """The speculative plan of a batch (rank 0), or None for a plain step.

    Args:
        batch: the step's sequences.
        num_speculative_tokens: draft tokens a sequence proposes at most.
        scheduler: knows how many tokens each sequence may still generate.

    Returns:
        None when a sequence is prefilling (such steps run as without a draft) or none has room
        for more than one token.
    """
    if not batch or any(seq.num_cached_tokens == 0 for seq in batch):
        return None
    # a step emits up to num_proposals + 1 tokens
    num_proposals = [
        min(num_speculative_tokens, scheduler.num_tokens_left(seq) - 1) for seq in batch
    ]
    if max(num_proposals) <= 0:
        return None
    return SpecPlan(
        num_proposals=num_proposals,
        draft_start_positions=[seq.num_draft_cached_tokens for seq in batch],
        draft_token_ids=[seq.token_ids[seq.num_draft_cached_tokens :] for seq in batch],
    )


@dataclass(slots=True)
class Proposals:
    """The draft's tokens of one step, per sequence, and (rank 0) the distributions drawn from."""

    token_ids: list[list[int]]
    draft_probs: list[list[torch.Tensor]]


@dataclass(frozen=True, slots=True)
class SpecOutcome:
    """What rank 0 accepted (rank 0 only).

    Attributes:
        token_ids: tokens to emit per sequence: kept proposals, then the model's token.
        target_logits: the model's raw logits behind each of them, `[len(token_ids[i]), vocab]`.
        num_accepted: proposals kept per sequence.
    """

    token_ids: list[list[int]]
    target_logits: list[torch.Tensor]
    num_accepted: list[int]


class SpeculativeDecoder:
    """Runs the draft and verification passes of speculative steps on one rank.

    Args:
        runner: this rank's models (with a draft) and KV caches.
        is_driver: rank 0, which picks proposals, broadcasts them and accepts.
        tp_size: ranks of the TP group (1: no broadcasts).
    """

    def __init__(self, runner: ModelRunner, *, is_driver: bool, tp_size: int) -> None:
        assert runner.draft is not None, "speculative decoding needs a draft model"
        self.runner = runner
        self.is_driver = is_driver
        self.tp_size = tp_size

    # --- propose ---

    def propose(
        self, batch_input: ModelInput, plan: SpecPlan, batch: list[Sequence] | None
    ) -> Proposals:
        """Run the draft `plan.num_passes` times; every rank ends with rank 0's proposals.

        Args:
            batch_input: the step's batch (slots of the sequences).
            plan: the step's plan.
            batch: the sequences (rank 0; None elsewhere).
        """
        num_seqs = len(plan.num_proposals)
        proposals = Proposals([[] for _ in range(num_seqs)], [[] for _ in range(num_seqs)])
        for pass_index in range(plan.num_passes):
            members = [i for i in range(num_seqs) if plan.num_proposals[i] > pass_index]
            draft_input = _draft_input(batch_input, plan, proposals, members, pass_index)
            logits = self.runner.forward(draft_input, draft=True)
            chosen = self._choose(logits, members, batch, proposals) if self.is_driver else None
            broadcast = self._broadcast_tokens(chosen, len(members))
            for i, token_id in zip(members, broadcast, strict=True):
                proposals.token_ids[i].append(token_id)
        return proposals

    def _choose(
        self,
        logits: torch.Tensor,
        members: list[int],
        batch: list[Sequence],
        proposals: Proposals,
    ) -> list[int]:
        # rank 0: one proposal per member sequence, from the draft's logits
        chosen = []
        for row, i in enumerate(members):
            seq = batch[i]
            if seq.params.greedy:
                chosen.append(int(logits[row].argmax()))
                continue
            probs = sampling_probs(logits[row : row + 1], seq.params)[0]
            proposals.draft_probs[i].append(probs)
            chosen.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
        return chosen

    def _broadcast_tokens(self, token_ids: list[int] | None, num_tokens: int) -> list[int]:
        # rank 0's choice reaches every rank, so all feed the same tokens to both models
        if self.tp_size == 1:
            assert token_ids is not None
            return token_ids
        if token_ids is None:
            tensor = torch.empty(num_tokens, dtype=torch.int64)
        else:
            tensor = torch.tensor(token_ids, dtype=torch.int64)
        dist.broadcast(tensor, src=0)
        return tensor.tolist()

    # --- verify ---

    def verify(self, batch_input: ModelInput, plan: SpecPlan, proposals: Proposals) -> torch.Tensor:
        """One model pass over each sequence's uncached tokens and its proposals.

        Returns:
            float32 logits of every fed position, `[num_tokens, vocab_size]`.
        """
        meta = batch_input.meta
        pieces = []
        for tokens, proposed in zip(
            batch_input.token_ids.split(meta.num_new_tokens), proposals.token_ids, strict=True
        ):
            pieces += [tokens, torch.tensor(proposed, dtype=torch.int64)]
        num_new_tokens = [
            n + k for n, k in zip(meta.num_new_tokens, plan.num_proposals, strict=True)
        ]
        verify_meta = AttentionMetadata(meta.slots, meta.start_positions, num_new_tokens)
        return self.runner.forward(ModelInput(torch.cat(pieces), verify_meta), all_logits=True)

    # --- accept (rank 0) ---

    def accept(
        self,
        logits: torch.Tensor,
        batch_input: ModelInput,
        proposals: Proposals,
        batch: list[Sequence],
    ) -> SpecOutcome:
        """Keep a prefix of each sequence's proposals and add the model's next token.

        Args:
            logits: `verify`'s logits.
            batch_input: the step's batch (each sequence's uncached tokens).
            proposals: `propose`'s proposals and draft distributions.
            batch: the sequences.
        """
        num_rows = [
            n + len(proposed)
            for n, proposed in zip(
                batch_input.meta.num_new_tokens, proposals.token_ids, strict=True
            )
        ]
        token_ids, target_logits, num_accepted = [], [], []
        for i, rows in enumerate(logits.split(num_rows)):
            proposed = proposals.token_ids[i]
            # the model's logits after the context, then after each proposal
            target = rows[-(len(proposed) + 1) :]
            emitted = _accept_one(target, proposed, proposals.draft_probs[i], batch[i])
            token_ids.append(emitted)
            target_logits.append(target[: len(emitted)])
            num_accepted.append(len(emitted) - 1)
        return SpecOutcome(token_ids, target_logits, num_accepted)


def _accept_one(
    target_logits: torch.Tensor,
    proposed: list[int],
    draft_probs: list[torch.Tensor],
    seq: Sequence,
) -> list[int]:
    if seq.params.greedy:
        return accept_greedy(target_logits.argmax(-1).tolist(), proposed)
    target_probs = sampling_probs(target_logits, seq.params)
    vocab_size = target_probs.shape[-1]
    stacked = torch.stack(draft_probs) if draft_probs else torch.empty(0, vocab_size)
    return accept_sampled(target_probs, stacked, proposed, seq.generator)


def _draft_input(
    batch_input: ModelInput,
    plan: SpecPlan,
    proposals: Proposals,
    members: list[int],
    pass_index: int,
) -> ModelInput:
    # pass 0 feeds what the draft's cache lacks; pass t feeds proposal t - 1
    slots = [batch_input.meta.slots[i] for i in members]
    if pass_index == 0:
        starts = [plan.draft_start_positions[i] for i in members]
        tokens = [plan.draft_token_ids[i] for i in members]
    else:
        seq_lens = plan.seq_lens()
        starts = [seq_lens[i] + pass_index - 1 for i in members]
        tokens = [[proposals.token_ids[i][pass_index - 1]] for i in members]
    meta = AttentionMetadata(slots, starts, [len(t) for t in tokens])
    flat = [t for seq_tokens in tokens for t in seq_tokens]
    return ModelInput(torch.tensor(flat, dtype=torch.int64), meta)


def emit(
    outcome: SpecOutcome, plan: SpecPlan, batch: list[Sequence], scheduler: Scheduler
) -> tuple[SampleResult, list[int]]:
    """Append the accepted tokens to their sequences (rank 0) and account both KV caches.

    Tokens are appended one by one up to the first that finishes a sequence (end of sequence,
    `max_tokens`, context length).

    Returns:
        The appended tokens of all sequences in batch order, with the model's logprobs (of its
        raw distribution, like a plain step), and the number appended per sequence.
    """
    counts = []
    for seq, tokens, seq_len, num_proposed, num_kept in zip(
        batch,
        outcome.token_ids,
        plan.seq_lens(),
        plan.num_proposals,
        outcome.num_accepted,
        strict=True,
    ):
        counts.append(scheduler.append_tokens(seq, tokens))
        if num_proposed > 0:
            # the draft cached the sequence and its proposals but the last; the kept ones are valid
            seq.num_draft_cached_tokens = seq_len + min(num_kept, num_proposed - 1)
    rows = torch.cat([logits[:n] for logits, n in zip(outcome.target_logits, counts, strict=True)])
    flat = [t for tokens, n in zip(outcome.token_ids, counts, strict=True) for t in tokens[:n]]
    num_logprobs = [
        seq.params.num_logprobs for seq, n in zip(batch, counts, strict=True) for _ in range(n)
    ]
    return token_logprobs(rows, flat, num_logprobs), counts
