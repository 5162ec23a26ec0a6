"""Continuous batching: which sequences run in the next forward pass.

Every step runs all running sequences (one decode token each) plus as many waiting prompts as
free KV slots and the token budget allow: new requests join the running batch between decode
steps, and finished ones leave it, freeing their slot at once.
"""

import logging
from collections import deque

from weightbus.engines.reference.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the waiting queue, the running set and the KV-cache slots (rank 0 only).

    Args:
        max_num_seqs: KV-cache slots, so sequences running at once.
        max_model_len: longest sequence in tokens (prompt + completion).
        max_num_batched_tokens: token budget of one step; one prompt may exceed it alone.
        vocab_size: prompt token ids must be below it.
        eos_token_ids: tokens that end a sequence unless it ignores them.
    """

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))  # pop() gives slot 0 first

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence.

        Raises:
            ValueError: the prompt is empty, leaves no room for a completion token, or has a
                token id outside the vocabulary.
        """
        if not 0 < len(seq) < self.max_model_len:
            raise ValueError(
                f"prompt of {len(seq)} tokens must be between 1 and {self.max_model_len - 1}"
            )
        if any(not 0 <= t < self.vocab_size for t in seq.token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a sequence wherever it is; returns whether it was found."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self._finish(seq, "abort")
                return True
        for seq in self.running:
            if seq.request_id == request_id:
                self._finish(seq, "abort")
                return True
        return False

    def abort_all(self, *, include_waiting: bool) -> list[Sequence]:
        """Finish every running (and optionally waiting) sequence with reason "abort"."""
        aborted = list(self.running)
        if include_waiting:
            aborted += self.waiting
            self.waiting.clear()
        for seq in aborted:
            self._finish(seq, "abort")
        return aborted

    def schedule(self, *, run: bool = True, admit: bool = True) -> list[Sequence]:
        """Sequences of the next step: the running ones, then newly admitted prompts.

        Args:
            run: whether running sequences may step at all (False: an empty batch).
            admit: whether waiting prompts may start (False: running sequences only).
        """
        if not run:
            return []
        # decode: every running sequence brings its last token
        budget = self.max_num_batched_tokens - len(self.running)
        admitted_any = False
        # prefill: admit waiting prompts while slots and budget last
        while admit and self.waiting and self.free_slots:
            seq = self.waiting[0]
            if admitted_any and len(seq) > budget:
                break
            self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= len(seq)
            admitted_any = True
        return list(self.running)

    def postprocess(self, batch: list[Sequence], token_ids: list[int]) -> None:
        """Append each sequence's new token and finish those that are done."""
        for seq, token_id in zip(batch, token_ids, strict=True):
            self.append_tokens(seq, [token_id])

    def append_tokens(self, seq: Sequence, token_ids: list[int]) -> int:
        """Append a step's tokens one by one, stopping at the first that finishes `seq`.

        Each token's predecessors are in the KV cache once it is appended (a speculative step
        verified them), so `num_cached_tokens` ends one short of the sequence.

        Returns:
            The number of tokens appended (from 1 to `len(token_ids)`).
        """
        for num_appended, token_id in enumerate(token_ids, start=1):
            seq.num_cached_tokens = len(seq)
            seq.token_ids.append(token_id)
            if token_id in self.eos_token_ids and not seq.params.ignore_eos:
                self._finish(seq, "stop")
            elif (
                seq.num_completion_tokens >= seq.params.max_tokens or len(seq) >= self.max_model_len
            ):
                self._finish(seq, "length")
            if seq.status is SequenceStatus.FINISHED:
                return num_appended
        return len(token_ids)

    def num_tokens_left(self, seq: Sequence) -> int:
        """Tokens `seq` may still generate (by `max_tokens` and the context length)."""
        return min(seq.params.max_tokens - seq.num_completion_tokens, self.max_model_len - len(seq))

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
