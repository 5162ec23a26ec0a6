"""Digests and fingerprints: the identity of a tensor and of a whole model version.

A digest is computed over a tensor's bytes in row-major order cut into fixed blocks of
`DIGEST_BLOCK_BYTES` (128 KiB): xxh3-128 of each block, then xxh3-128 of the blocks' digests in
order. The blocks depend only on the tensor's bytes, never on who holds them, so processes that
each hold part of a tensor (the ranks of a sharded trainer) compute the same digest as one
process holding all of it: each hashes the blocks it holds whole, and only a block cut by a
shard boundary travels to one of them (`weightbus.core.trainer.digests`). It costs ~2% against one
xxh3 over the whole tensor (~25 GB/s; MD5 is ~30x slower).

A fingerprint is xxh3-128 over the name-sorted `(name, dtype, shape, digest)` list, so trainer
and engine agree on it whatever order the tensors travelled in.
"""

from collections.abc import Iterable
from itertools import pairwise

import msgspec
import numpy as np
import torch
import xxhash

from weightbus.core.meta import dtype_name
from weightbus.core.plan.bucket import byte_view
from weightbus.core.weights import NameMap, Weights, normalize_weights

# Bumped if the fingerprint's canonical encoding or the digest's definition ever changes
# (2: digests over 128 KiB blocks).
FINGERPRINT_FORMAT = 2
DIGEST_BLOCK_BYTES = 128 << 10


def block_digest(data: object) -> bytes:
    """xxh3-128 of one block (any buffer), as the 16 raw bytes that `combine_blocks` joins."""
    return xxhash.xxh3_128_digest(data)


def combine_blocks(block_digests: Iterable[bytes]) -> str:
    """A digest from its blocks' digests, in order."""
    return xxhash.xxh3_128_hexdigest(b"".join(block_digests))


class TensorHasher:
    """The digest of a byte stream fed in parts of any size (`update`), equal to
    `bytes_digest` of the whole stream: whole blocks are hashed where they lie, and only the
    bytes of a block cut between two parts are copied."""

    def __init__(self) -> None:
        self._blocks: list[bytes] = []
        self._partial = bytearray()

    def update(self, data: object) -> None:
        view = memoryview(data).cast("B")
        if self._partial:
            take = min(DIGEST_BLOCK_BYTES - len(self._partial), len(view))
            self._partial += view[:take]
            view = view[take:]
            if len(self._partial) < DIGEST_BLOCK_BYTES:
                return
            self._blocks.append(block_digest(self._partial))
            self._partial.clear()
        whole = len(view) - len(view) % DIGEST_BLOCK_BYTES
        self._blocks.extend(
            block_digest(view[start : start + DIGEST_BLOCK_BYTES])
            for start in range(0, whole, DIGEST_BLOCK_BYTES)
        )
        self._partial += view[whole:]

    def hexdigest(self) -> str:
        blocks = self._blocks + ([block_digest(self._partial)] if self._partial else [])
        return combine_blocks(blocks)


def bytes_digest(data: torch.Tensor | np.ndarray) -> str:
    """The digest of a contiguous CPU `uint8` tensor (or array), read in place."""
    hasher = TensorHasher()
    hasher.update(data.numpy() if isinstance(data, torch.Tensor) else data)
    return hasher.hexdigest()


def tensor_digest(tensor: torch.Tensor) -> str:
    """The digest of a tensor's bytes in row-major order.

    A contiguous CPU tensor is hashed in place; others are made contiguous on the CPU first.
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return bytes_digest(byte_view(tensor.contiguous()))


def fingerprint_of_digests(items: Iterable[tuple[str, str, Iterable[int], str]]) -> str:
    """Fingerprint of `(name, dtype_name, shape, digest)` records, in any order.

    Raises:
        ValueError: a name appears twice.
    """
    records = sorted((name, dtype, list(shape), digest) for name, dtype, shape, digest in items)
    names = [record[0] for record in records]
    if len(set(names)) != len(names):
        duplicates = sorted({n for a, n in pairwise(names) if a == n})
        raise ValueError(f"duplicate tensor names: {duplicates}")
    return xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode([FINGERPRINT_FORMAT, records]))


def fingerprint(weights: Weights, name_map: NameMap | None = None) -> str:
    """The fingerprint of a model version: what engines report after a push of `weights`.

    The one definition, used by `Publisher.fingerprint`, by every rank of a sharded trainer
    and by the engines: the tensors are taken as a push takes them (`normalize_weights`: a
    tensor held twice is counted once, a head tied to its embeddings is not counted), then
    xxh3-128 over their name-sorted `(name, dtype, shape, digest)` list.

    Args:
        weights: an `nn.Module`, a state dict or `(name, tensor)` pairs (HF names).
        name_map: renames, as for a push (a name mapped to None is left out).

    Returns:
        A 32-character hex string; equal on any process for bit-identical weights, however
        they are sharded.

    Raises:
        ValueError: a name appears twice or a dtype is unsupported.
    """
    return fingerprint_of_tensors(normalize_weights(weights, name_map))


def fingerprint_of_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The fingerprint of exactly these `(name, tensor)` pairs (no tensor left out: what an
    engine serves, or tensors already normalized)."""
    return fingerprint_of_digests(
        (name, dtype_name(t.dtype), tuple(t.shape), tensor_digest(t)) for name, t in named_tensors
    )
