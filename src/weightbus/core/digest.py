"""Digests and fingerprints: the identity of a tensor and of a whole model version.

A tensor is seen as its matrix `(rows, row_bytes)` (`(d0, d1 * ... * dn)`; a vector as one
element a row). Its digest is a tree over its rows: a range of rows is cut in two halves (the
first `ceil(n / 2)` rows, then the rest) until it fits in `LEAF_BYTES` (128 KiB) and was cut at
least `MIN_DEPTH` (8) times, or fits in `MIN_LEAF_BYTES` (64 KiB), or is a single row; such a leaf
is hashed whole (xxh3-128), and each node is xxh3-128 of its two children's digests. The root is
the digest.

The tree depends only on the tensor's bytes and shape, never on who holds them, and its cuts
fall where FSDP's (`torch.chunk`'s) shards split its rows into 2, 4, ..., 256 even parts (as
far as 64 KiB leaves go): ranks of a sharded trainer that each hold whole subtrees hash them in
place and exchange 16-byte digests; only a leaf cut by an uneven boundary travels, as bytes, to
one of them (`weightbus.core.trainer.digests`). Hashing its leaves takes ~10% longer than
128 KiB blocks (31 vs 28 ms for a 512 MiB Llama-shaped model on one thread; MD5 is ~30x
slower).

A fingerprint is xxh3-128 over the name-sorted `(name, dtype, shape, digest)` list, so trainer
and engine agree on it whatever order the tensors travelled in.
"""

import bisect
import functools
from collections.abc import Iterable, Iterator, Mapping
from itertools import pairwise
from math import prod

import msgspec
import numpy as np
import torch
import xxhash

from weightbus.core.finite import holds_nonfinite
from weightbus.core.meta import TensorMeta, dtype_name
from weightbus.core.plan.bucket import byte_view
from weightbus.core.weights import NameMap, Weights, normalize_weights

# Bumped if the fingerprint's canonical encoding or the digest's definition ever changes
# (2: digests over 128 KiB blocks; 3: a tree over rows, halved, leaves of at most 128 KiB).
FINGERPRINT_FORMAT = 3
LEAF_BYTES = 128 << 10
# every tensor is halved at least this many times (rows and MIN_LEAF_BYTES allowing): the shards
# of up to 2**MIN_DEPTH FSDP ranks are whole subtrees of a tensor of any size
MIN_DEPTH = 8
# not halved below this: each leaf is one xxh3 call holding the GIL (16 KiB leaves made a 512 MiB
# push 15-25% slower than 128 KiB blocks; 64 KiB, within 5%)
MIN_LEAF_BYTES = 64 << 10
# `checked_digest` checks for NaN/inf after hashing about this many bytes (still in cache)
CHECK_BYTES = 1 << 20


def _is_leaf(rows: int, row_bytes: int, depth: int) -> bool:
    nbytes = rows * row_bytes
    return rows <= 1 or nbytes <= MIN_LEAF_BYTES or (nbytes <= LEAF_BYTES and depth >= MIN_DEPTH)


@functools.lru_cache(maxsize=4096)
def leaf_rows(rows: int, row_bytes: int) -> tuple[tuple[int, int], ...]:
    """The leaves of the digest tree of `rows` rows of `row_bytes` bytes: `(first, stop)` row
    ranges, in order."""
    found: list[tuple[int, int]] = []
    pending = [(0, rows, 0)]
    while pending:
        first, stop, depth = pending.pop()
        if _is_leaf(stop - first, row_bytes, depth):
            found.append((first, stop))
            continue
        middle = first + (stop - first + 1) // 2
        pending += [(middle, stop, depth + 1), (first, middle, depth + 1)]  # first half next
    return tuple(found)


def combine_leaves(rows: int, row_bytes: int, leaves: Iterable[bytes]) -> str:
    """The digest of `rows` rows from their leaves' digests, in order (`leaf_rows`)."""
    nodes = list(leaves)
    append, digest = nodes.append, xxhash.xxh3_128_digest
    for left, right in _joins(rows, row_bytes):  # each node once its two children are known
        append(digest(nodes[left] + nodes[right]))
    return nodes[-1].hex()


@functools.lru_cache(maxsize=4096)
def _joins(rows: int, row_bytes: int) -> tuple[tuple[int, int], ...]:
    """The tree's inner nodes, children first: each `(left, right)` indexes the node list
    that starts with the leaves and grows by one node per join."""
    count = len(leaf_rows(rows, row_bytes))
    joins: list[tuple[int, int]] = []

    def node(first: int, stop: int, depth: int, leaf: Iterator[int]) -> int:
        if _is_leaf(stop - first, row_bytes, depth):
            return next(leaf)
        middle = first + (stop - first + 1) // 2
        left = node(first, middle, depth + 1, leaf)
        joins.append((left, node(middle, stop, depth + 1, leaf)))
        return count + len(joins) - 1

    node(0, rows, 0, iter(range(count)))
    return tuple(joins)


def matrix_of(shape: tuple[int, ...], element_bytes: int) -> tuple[int, int]:
    """`(rows, row_bytes)` of a tensor of `shape`: the matrix its digest tree is over."""
    if not shape:
        return 1, element_bytes
    return shape[0], prod(shape[1:]) * element_bytes


class TensorHasher:
    """The digest of `rows` rows of `row_bytes` bytes fed in row-major order, in parts of any
    size (`update`): whole leaves are hashed where they lie, and only the bytes of a leaf cut
    between two parts are copied."""

    def __init__(self, rows: int, row_bytes: int) -> None:
        self.rows, self.row_bytes = rows, row_bytes
        self._ends = _leaf_ends(rows, row_bytes)  # where each leaf's bytes end
        self._leaves: list[bytes] = []
        self._partial = bytearray()
        self._fed = 0  # bytes fed so far

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorHasher":
        """A hasher of a tensor shaped like `tensor` (fed its bytes)."""
        return cls.of_shape(tuple(tensor.shape), tensor.element_size())

    @classmethod
    def of_shape(cls, shape: tuple[int, ...], element_bytes: int) -> "TensorHasher":
        """A hasher of a tensor of `shape` (fed its bytes)."""
        return cls(*matrix_of(tuple(shape), element_bytes))

    def update(self, data: object) -> None:
        view = memoryview(data).cast("B")
        ends, leaves, partial = self._ends, self._leaves, self._partial
        start = self._fed
        stop = self._fed = start + len(view)
        if partial:  # the rest of the leaf an earlier part began
            leaf_end = ends[len(leaves)]
            if stop < leaf_end:
                partial += view
                return
            partial += view[: leaf_end - start]
            leaves.append(xxhash.xxh3_128_digest(partial))
            partial.clear()
        first = len(leaves)
        last = bisect.bisect_right(ends, stop, lo=first)  # the leaves this part ends
        if last > first:
            digest, low = xxhash.xxh3_128_digest, (ends[first - 1] if first else 0) - start
            cuts = [low, *(end - start for end in ends[first:last])]
            leaves += [digest(view[a:b]) for a, b in pairwise(cuts)]
        begun = ends[last - 1] if last else 0  # where the next leaf begins
        if begun < stop:
            partial += view[begun - start :]

    def hexdigest(self) -> str:
        leaves = list(self._leaves)
        if self._partial or len(leaves) < len(self._ends):
            leaves.append(xxhash.xxh3_128_digest(self._partial))
        return combine_leaves(self.rows, self.row_bytes, leaves)


@functools.lru_cache(maxsize=4096)
def _leaf_ends(rows: int, row_bytes: int) -> tuple[int, ...]:
    return tuple(stop * row_bytes for _, stop in leaf_rows(rows, row_bytes))


def bytes_digest(data: torch.Tensor | np.ndarray) -> str:
    """The digest of a contiguous CPU `uint8` tensor (or array), read in place: its bytes as
    rows of one byte."""
    raw = data.numpy() if isinstance(data, torch.Tensor) else data
    hasher = TensorHasher(raw.size, 1)
    hasher.update(raw)
    return hasher.hexdigest()


def tensor_digest(tensor: torch.Tensor) -> str:
    """The digest of a tensor (the tree over its rows, module docstring).

    A contiguous CPU tensor is hashed in place; others are made contiguous on the CPU first.
    """
    return checked_digest(tensor, check_nonfinite=False)[0]


# the digest of a slice a rank does not hold (an expert-parallel rank's share of another
# rank's expert): both ends use it for such a slice, with no bytes to read
EMPTY_SLICE_DIGEST = xxhash.xxh3_128_hexdigest(b"")


def checked_digest(tensor: torch.Tensor, *, check_nonfinite: bool) -> tuple[str, bool]:
    """`(digest, holds NaN/inf)` of a tensor in one pass over its bytes: with
    `check_nonfinite`, each `CHECK_BYTES` of leaves is checked right after it was hashed,
    while still in cache (else, and for non-floating tensors, the flag is False)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    view = memoryview(byte_view(tensor).numpy()).cast("B")
    rows, row_bytes = matrix_of(tuple(tensor.shape), tensor.element_size())
    ends = (0, *_leaf_ends(rows, row_bytes))
    digest = xxhash.xxh3_128_digest
    if not (check_nonfinite and tensor.is_floating_point()):
        leaves = [digest(view[a:b]) for a, b in pairwise(ends)]
        return combine_leaves(rows, row_bytes, leaves), False
    flat, element_bytes = tensor.reshape(-1), tensor.element_size()
    leaves, nonfinite, checked = [], False, 0
    for a, b in pairwise(ends):
        leaves.append(digest(view[a:b]))
        if b - checked >= CHECK_BYTES or b == ends[-1]:
            part = flat[checked // element_bytes : b // element_bytes]
            nonfinite = nonfinite or holds_nonfinite(part)
            checked = b
    return combine_leaves(rows, row_bytes, leaves), nonfinite


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


def fingerprint_of_metas(metas: Iterable[TensorMeta], digests: Mapping[str, str]) -> str:
    """The fingerprint of tensors of these metas with these digests (by name)."""
    return fingerprint_of_digests(
        (meta.name, dtype_name(meta.dtype), meta.shape, digests[meta.name]) for meta in metas
    )


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
