"""Continuous batching: which sequences run in the next forward pass.

Every step runs all running sequences (one decode token each) plus as many waiting prompts as
free KV slots and the token budget allow: new requests join the running batch between decode
steps, and finished ones leave it, freeing their slot at once (with prefix caching: retaining
it, `engine/prefix_cache.py`).
"""

import logging
from collections import deque

from weightbus.engines.reference.engine.prefix_cache import PrefixCache, common_prefix
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
        prefix_cache: reuse the KV of prompt prefixes that running and finished sequences
            computed under the current weights (None: every prompt is computed whole).
    """

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))  # pop() gives slot 0 first
        self.prefix_cache = prefix_cache
        # the step's KV copies, (destination slot, source slot, positions [0, n)), in order
        self.kv_copies: list[tuple[int, int, int]] = []
        # running sequences whose KV is computed again from the next step (`recompute_running`)
        self._recompute: list[Sequence] = []

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

    def schedule(
        self, *, run: bool = True, admit: bool = True, use_cache: bool = True
    ) -> list[Sequence]:
        """Sequences of the next step: the running ones, then newly admitted prompts.

        Args:
            run: whether running sequences may step at all (False: an empty batch).
            admit: whether waiting prompts may start (False: running sequences only).
            use_cache: whether admitted prompts may reuse cached KV (False: the weights change
                before this step's forward pass).
        """
        self.kv_copies = []
        self._restart_kv()
        if not run:
            return []
        # decode: every running sequence brings its last token
        budget = self.max_num_batched_tokens - len(self.running)
        admitted: list[Sequence] = []
        # prefill: admit waiting prompts while slots and budget last
        while admit and self.waiting and (self.free_slots or self._num_retained()):
            seq = self.waiting[0]
            source, num_cached = self._lookup(seq, admitted) if use_cache else (_NO_LOOKUP, 0)
            if admitted and len(seq) - num_cached > budget:
                break
            if source == _HOLD:  # its prefix is computed this step: it copies it at the next
                break
            self.waiting.popleft()
            self._admit(seq, source, num_cached)
            budget -= len(seq) - num_cached
            admitted.append(seq)
        return list(self.running)

    def _num_retained(self) -> int:
        return 0 if self.prefix_cache is None else len(self.prefix_cache)

    def _admit(self, seq: Sequence, source: int, num_cached: int) -> None:
        cache = self.prefix_cache
        if cache is not None and source != _NO_LOOKUP:
            cache.record(len(seq), num_cached)
            if source in cache.retained:
                cache.touch(source)
        if self.free_slots:
            seq.slot = self.free_slots.pop()
        else:
            assert cache is not None, "admitted without a free slot"
            if source in cache.retained:  # the matched slot itself: nothing to copy
                cache.take(source)
                seq.slot = source
            else:
                seq.slot = cache.evict()
        if num_cached and seq.slot != source:
            self.kv_copies.append((seq.slot, source, num_cached))
        seq.num_cached_tokens = num_cached
        seq.status = SequenceStatus.RUNNING
        if cache is not None:
            seq.kv_epoch = cache.epoch
        self.running.append(seq)

    def _lookup(self, seq: Sequence, admitted: list[Sequence]) -> tuple[int, int]:
        """The slot holding the longest cached prefix of `seq`'s prompt and its length
        ((-1, 0): none; (_HOLD, 0): a sequence admitted this step will hold a longer one;
        (_NO_LOOKUP, 0): no cache, or a prompt that must be computed whole)."""
        cache = self.prefix_cache
        if cache is None or seq.params.prompt_logprobs:
            return _NO_LOOKUP, 0
        prompt = seq.token_ids
        limit = len(prompt) - 1  # the last prompt token is computed: it gives the logits
        best_slot, best = -1, 0
        fresh = {id(s) for s in admitted}
        for other in self.running:
            if id(other) in fresh or other.kv_epoch != cache.epoch:
                continue
            end = min(limit, other.num_cached_tokens)  # its KV holds these positions
            n = common_prefix(prompt, other.token_ids, end, cache.block_size)
            if n > best:
                best_slot, best = other.slot, n
        for slot, token_ids in cache.retained.items():
            n = common_prefix(prompt, token_ids, limit, cache.block_size)
            if n > best:
                best_slot, best = slot, n
        # a group arriving together: wait for the first of it to be prefilled
        for other in admitted:
            if common_prefix(prompt, other.token_ids, limit, cache.block_size) > best:
                return _HOLD, 0
        return best_slot, best

    def recompute_running(self) -> None:
        """Running sequences compute their KV again from the first token, from the next step
        on (the weights change at this step's boundary; this step's tokens are appended
        first). Those admitted at this step without cached tokens compute on the new weights
        already."""
        self._recompute = [seq for seq in self.running if seq.num_cached_tokens > 0]

    def _restart_kv(self) -> None:
        for seq in self._recompute:
            if seq.status is SequenceStatus.RUNNING:
                seq.num_cached_tokens = seq.num_draft_cached_tokens = 0
                seq.kv_recomputed = True
                if self.prefix_cache is not None:
                    seq.kv_epoch = self.prefix_cache.epoch
        self._recompute = []

    def drop_cached(self, *, new_epoch: bool) -> None:
        """Drop the retained slots (`new_epoch`: the weights served changed, so running
        sequences' KV no longer matches either)."""
        cache = self.prefix_cache
        if cache is None:
            return
        self.free_slots += cache.new_epoch() if new_epoch else cache.clear()

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
            self._release_slot(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _release_slot(self, seq: Sequence) -> None:
        """Retain a finished sequence's slot with the tokens its KV holds, else free it."""
        cache = self.prefix_cache
        cached = seq.token_ids[: seq.num_cached_tokens]
        if cache is None or seq.kv_epoch != cache.epoch or not cache.retain(seq.slot, cached):
            self.free_slots.append(seq.slot)


_HOLD = -2  # `_lookup`: admit the sequence at the next step
_NO_LOOKUP = -3  # `_lookup`: the prompt was not looked up
