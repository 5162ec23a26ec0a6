"""The draft model's part of a push: loaded in bounded chunks, measured, fingerprinted.

The draft's tensors travel in the same buckets as the main model's, so `load_weights` never
sees more of them at once than one bucket holds (`bucket_bytes`): no copy of the whole draft
is ever assembled on a rank. `DraftLoads` wraps a rank's loader and measures what it loaded
(bytes, the largest chunk, seconds); `draft_info` turns a verified push into the `DraftInfo`
the engine reports once it commits.
"""

import time
from collections.abc import Callable, Iterable, Mapping

import torch

from weightbus.core.digest import fingerprint_of_digests
from weightbus.core.meta import DRAFT_PREFIX, TensorMeta, dtype_name, is_draft_name
from weightbus.core.receiver import RankResult
from weightbus.engines.reference.engine import messages

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], set[str]]


class DraftLoads:
    """A `load_weights` that measures the draft tensors passing through it.

    Attributes:
        nbytes: draft bytes loaded.
        max_chunk_bytes: the most draft bytes one call loaded (one bucket's share at most).
        seconds: time spent in calls that loaded draft tensors.
    """

    def __init__(self, load_weights: LoadWeights) -> None:
        self._load_weights = load_weights
        self.nbytes = 0
        self.max_chunk_bytes = 0
        self.seconds = 0.0

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        weights = list(weights)
        chunk_bytes = sum(t.nbytes for name, t in weights if is_draft_name(name))
        tick = time.perf_counter()
        loaded = self._load_weights(weights)
        if chunk_bytes:
            self.seconds += time.perf_counter() - tick
            self.nbytes += chunk_bytes
            self.max_chunk_bytes = max(self.max_chunk_bytes, chunk_bytes)
        return loaded


def draft_info(
    version: str, expected: Mapping[str, TensorMeta], result: RankResult, loads: DraftLoads
) -> messages.DraftInfo:
    """The draft a verified push carried: its fingerprint as a model of its own (names without
    `draft.`, from the push's digests) and how this rank loaded it."""
    records = [
        (name.removeprefix(DRAFT_PREFIX), dtype_name(meta.dtype), meta.shape, result.digests[name])
        for name, meta in expected.items()
        if is_draft_name(name)
    ]
    return messages.DraftInfo(
        version=version,
        fingerprint=fingerprint_of_digests(records),
        nbytes=loads.nbytes,
        max_chunk_bytes=loads.max_chunk_bytes,
        load_s=loads.seconds,
    )
