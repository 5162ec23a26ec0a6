import itertools
import subprocess
import sys

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import all_dtype_tensors, random_tensor
from weightbus.core.digest import (
    LEAF_BYTES,
    MIN_DEPTH,
    MIN_LEAF_BYTES,
    TensorHasher,
    bytes_digest,
    fingerprint,
    fingerprint_of_digests,
    leaf_rows,
    tensor_digest,
)
from weightbus.core.meta import metas_of
from weightbus.core.plan import plan_buckets
from weightbus.core.plan.bucket import byte_view

_REMOTE = """
import sys
sys.path.insert(0, {tests_dir!r})
from helpers import all_dtype_tensors
from weightbus.core.digest import fingerprint
from weightbus.core.meta import metas_of
from weightbus.core.plan import plan_buckets
weights = all_dtype_tensors(seed=7)
print(fingerprint(weights), plan_buckets(metas_of(weights), 4096).plan_hash)
"""


@pytest.mark.e2e  # a Python child process (tiers: tests/conftest.py)
def test_same_weights_same_fingerprint_and_plan_hash_in_another_process(tmp_path):
    weights = all_dtype_tensors(seed=7)
    code = _REMOTE.format(tests_dir=str(__import__("pathlib").Path(__file__).parents[1]))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    remote_fingerprint, remote_plan_hash = out.stdout.split()
    assert remote_fingerprint == fingerprint(weights)
    assert remote_plan_hash == plan_buckets(metas_of(weights), 4096).plan_hash


def _tree(raw: bytes, rows: int, depth: int = 0) -> bytes:
    """The digest tree, written from its definition (module docstring of weightbus.core.digest)."""
    if rows <= 1 or len(raw) <= MIN_LEAF_BYTES or (len(raw) <= LEAF_BYTES and depth >= MIN_DEPTH):
        return xxhash.xxh3_128_digest(raw)
    first = (rows + 1) // 2
    cut = len(raw) // rows * first
    left, right = _tree(raw[:cut], first, depth + 1), _tree(raw[cut:], rows - first, depth + 1)
    return xxhash.xxh3_128_digest(left + right)


@pytest.mark.parametrize(
    "shape",
    [(1000, 3), (7, 5000), (3, 300, 7), (5000,), (37, 1), (1, 70000), (0, 4)],
    ids=lambda shape: "x".join(map(str, shape)),
)
def test_digest_is_the_halving_tree_over_rows(shape):
    tensor = random_tensor(shape, torch.bfloat16)
    raw = byte_view(tensor).numpy().tobytes()
    assert tensor_digest(tensor) == _tree(raw, shape[0]).hex()


def test_scalar_digest_is_one_leaf():
    expected = xxhash.xxh3_128_hexdigest(torch.tensor([1.0]).numpy().tobytes())
    assert tensor_digest(torch.tensor(1.0)) == expected


@pytest.mark.parametrize("ranks", [2, 4, 64, 256])
def test_even_fsdp_shards_are_whole_subtrees(ranks):
    rows = 2048  # an expert matrix of Kimi-K2 (7168 one-byte FP8 columns): 56 KiB per shard
    edges = {stop for _, stop in leaf_rows(rows, 7168)}
    assert {rows // ranks * rank for rank in range(1, ranks)} <= edges


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 300),
    row_bytes=st.sampled_from([1, 2, 12, 4096]),
    cuts=st.lists(st.floats(0, 1)),
)
def test_a_stream_fed_in_any_parts_digests_like_the_whole(rows, row_bytes, cuts):
    nbytes = rows * row_bytes
    data = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes)
    )
    bounds = sorted({0, nbytes, *(int(cut * nbytes) for cut in cuts)})
    hasher = TensorHasher(rows, row_bytes)
    for start, stop in itertools.pairwise(bounds):
        hasher.update(data[start:stop].numpy())
    assert hasher.hexdigest() == tensor_digest(data.view(rows, row_bytes))
    if row_bytes == 1:
        assert hasher.hexdigest() == bytes_digest(data)


def test_non_contiguous_tensor_digests_like_its_contiguous_copy():
    tensor = random_tensor((16, 12), torch.float32).t()
    assert not tensor.is_contiguous()
    assert tensor_digest(tensor) == tensor_digest(tensor.contiguous())


def test_fingerprint_ignores_order():
    weights = all_dtype_tensors()
    assert fingerprint(weights) == fingerprint(reversed(weights))


@pytest.mark.parametrize("tensor_index", range(len(all_dtype_tensors())))
def test_one_flipped_bit_changes_the_fingerprint(tensor_index):
    weights = all_dtype_tensors()
    reference = fingerprint(weights)
    name, tensor = weights[tensor_index]
    raw = byte_view(tensor)
    for byte_index in (0, raw.numel() // 2, raw.numel() - 1):
        for bit in (0, 7):
            flipped = tensor.clone()
            byte_view(flipped)[byte_index] ^= 1 << bit
            changed = [(n, flipped if n == name else t) for n, t in weights]
            assert fingerprint(changed) != reference, (name, byte_index, bit)


@pytest.mark.parametrize(
    "change",
    [
        lambda n, t: ("renamed", t),
        lambda n, t: (n, t.reshape(-1)),
        lambda n, t: (n, t.view(torch.int16)),
    ],
    ids=["name", "shape", "dtype with same bytes"],
)
def test_metadata_changes_change_the_fingerprint(change):
    weights = [("a", random_tensor((4, 6), torch.bfloat16)), ("b", torch.ones(2))]
    changed = [change(*weights[0]), weights[1]]
    assert fingerprint(changed) != fingerprint(weights)


def test_fingerprint_rejects_duplicate_names():
    with pytest.raises(ValueError, match=r"duplicate tensor names: \['a'\]"):
        fingerprint_of_digests([("a", "float32", (1,), "0" * 32), ("a", "float32", (1,), "1" * 32)])
