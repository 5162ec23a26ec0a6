"""Prefix caching over the KV-cache slots, keyed by the weights epoch (rank 0's bookkeeping).

A finished sequence's slot is not freed at once: it is retained, with the tokens whose KV it
holds, in a least-recently-used order. A new sequence takes a free slot first, else the least
recently used retained one. At admission the scheduler looks for the longest common prefix,
in whole blocks of `block_size` tokens, between the new prompt and the tokens of the running
and retained slots of the current epoch; the ranks copy those KV positions into the new slot
before the step's forward pass, and the sequence computes only the rest of its prompt.

Any change to the weights served starts a new epoch (`new_epoch`): KV computed under the old
weights is never reused, unless the push asked to keep it (`keep_prefix_cache`).
"""

from collections import OrderedDict
from collections.abc import Sequence

BLOCK_SIZE = 16


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int, block_size: int) -> int:
    """Length of the common prefix of `a` and `b` in whole blocks, at most `limit` tokens."""
    end = min(len(a), len(b), limit)
    n = 0
    while n + block_size <= end and a[n : n + block_size] == b[n : n + block_size]:
        n += block_size
    return n


class PrefixCache:
    """Retained slots (their tokens, least recently used first), the epoch, the counters.

    Args:
        block_size: a match counts whole blocks of this many tokens.
    """

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.epoch = 0
        # slot -> the tokens whose KV it holds (positions [0, len)); first: least recently used
        self.retained: OrderedDict[int, list[int]] = OrderedDict()
        self.num_queries = 0  # prompt tokens looked up
        self.num_hits = 0  # prompt tokens whose KV came from the cache
        self._reported = (0, 0)

    def __len__(self) -> int:
        return len(self.retained)

    def retain(self, slot: int, token_ids: list[int]) -> bool:
        """Keep a finished sequence's slot; False (the caller frees it) if it holds no block."""
        if len(token_ids) < self.block_size:
            return False
        self.retained[slot] = token_ids
        return True

    def evict(self) -> int:
        """Drop the least recently used retained slot and return it (for a new sequence)."""
        slot, _ = self.retained.popitem(last=False)
        return slot

    def take(self, slot: int) -> None:
        """A new sequence takes this retained slot (the one it matched)."""
        del self.retained[slot]

    def touch(self, slot: int) -> None:
        """A retained slot was just matched: it is the most recently used."""
        self.retained.move_to_end(slot)

    def new_epoch(self) -> list[int]:
        """The weights served changed: drop every retained slot; returns them (to free)."""
        self.epoch += 1
        return self.clear()

    def clear(self) -> list[int]:
        """Drop every retained slot (e.g. the KV memory is released); returns them."""
        slots = list(self.retained)
        self.retained.clear()
        return slots

    def record(self, num_queries: int, num_hits: int) -> None:
        self.num_queries += num_queries
        self.num_hits += num_hits

    def unreported(self) -> tuple[int, int]:
        """Queries and hits since the last call (rank 0 sends them with a step's outputs)."""
        queries, hits = self.num_queries - self._reported[0], self.num_hits - self._reported[1]
        self._reported = (self.num_queries, self.num_hits)
        return queries, hits
