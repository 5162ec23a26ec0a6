"""Delta encoding and application, bit-exact, for every wire dtype and shape.

A random base/new pair is encoded against the base; each rank of a TP split (a range along
one dimension, as `ShardCopy` describes it) applies the changes to its slice of the base. Every
slice must equal the new tensor's slice bit for bit, and its digest the one the publisher
computes for that rank (`rank_digests`).
"""

import math

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightbus.core.delta import (
    DeltaBase,
    apply_to_slice,
    check_payload,
    payload_names,
    payload_of,
    rank_digests,
    version_digests,
)
from weightbus.core.delta.bits import element_words
from weightbus.core.digest import tensor_digest
from weightbus.core.meta import DTYPES_BY_NAME
from weightbus.core.plan.shard import ShardCopy
from weightbus.core.wire.delta import DeltaSpec, DeltaTensor
from weightbus.core.wire.messages import SliceSpec

DTYPES = sorted(DTYPES_BY_NAME)
HEX = "0" * 32


def _random_bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of `dtype` with random bytes (NaNs, -0.0 and subnormals included)."""
    generator = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    raw = torch.randint(
        0,
        256,
        (numel * torch.empty((), dtype=dtype).element_size(),),
        dtype=torch.uint8,
        generator=generator,
    )
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _changed(base: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """A copy of `base` with `fraction` of its elements (at least one unless 0) changed: their
    lowest bit flipped."""
    new = base.clone()
    if fraction == 0:
        return new
    generator = torch.Generator().manual_seed(seed)
    count = max(1, round(fraction * new.numel()))
    indices = torch.randperm(new.numel(), generator=generator)[:count]
    element_words(new)[indices, 0] ^= 1
    return new


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(element_words(a.contiguous()), element_words(b.contiguous()))


def _splits(shape: tuple[int, ...], dim: int, tp: int) -> list[ShardCopy]:
    """Each rank's range of `dim` (ceil-sized like the vocabulary split: the last may be short)."""
    size = shape[dim]
    per_rank = -(-size // tp)
    copies = []
    for rank in range(tp):
        start = min(rank * per_rank, size)
        copies.append(ShardCopy(dim, start, dim, 0, min(size, start + per_rank) - start))
    return copies


shapes = st.one_of(st.just(()), st.lists(st.integers(4, 40), min_size=1, max_size=3).map(tuple))
fractions = st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.15, 1.0])


@settings(max_examples=150, deadline=None)
@given(
    dtype_name=st.sampled_from(DTYPES),
    shape=shapes,
    fraction=fractions,
    tp=st.integers(1, 3),
    dim_pick=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_each_rank_applies_its_slice_bit_exactly(dtype_name, shape, fraction, tp, dim_pick, seed):
    dtype = DTYPES_BY_NAME[dtype_name]
    base = _random_bits(dtype, shape, seed)
    new = _changed(base, fraction, seed + 7)
    digests, _ = version_digests({"w": new})
    encoding = DeltaBase("v0", HEX, {"w": base}, version_digests({"w": base})[0]).encode(
        {"w": new}, digests
    )
    kind = encoding.kinds["w"]
    assert (kind == "same") == _same_bits(base, new)
    if kind != "sparse":
        assert kind == "same" or encoding.stream == [("w", new)]
        return
    indices, values = encoding.sparse["w"]
    assert indices.numel() < new.numel()
    check_payload("w", indices, values, new.numel())
    dim = dim_pick % len(shape) if shape else 0
    copies = _splits(shape, dim, tp) if shape else [ShardCopy.whole(())]
    specs = [[SliceSpec("w", c.src_dim, c.src_start, c.length)] for c in copies]
    expected = rank_digests(specs, ["w"], {"w": new}, digests)
    for copy, (rank_digest,) in zip(copies, expected, strict=True):
        param = copy.source(base).clone()
        destination = param if not shape else param.narrow(dim, 0, copy.length)
        apply_to_slice(destination, shape, copy, indices, values)
        assert _same_bits(destination, copy.source(new))
        assert tensor_digest(destination) == rank_digest


def test_a_column_slice_inside_a_wider_parameter_is_written_in_place():
    """Row-parallel layers hold columns of every row; the destination is a strided view."""
    base = _random_bits(torch.bfloat16, (6, 8), 1)
    new = _changed(base, 0.3, 2)
    encoding = DeltaBase("v0", HEX, {"w": base}, version_digests({"w": base})[0]).encode(
        {"w": new}, version_digests({"w": new})[0]
    )
    param = torch.zeros(6, 10, dtype=torch.bfloat16)  # padded: the slice is columns 2..6
    copy = ShardCopy(1, 4, 1, 2, 4)
    copy.destination(param).copy_(copy.source(base))
    apply_to_slice(copy.destination(param), (6, 8), copy, *encoding.sparse["w"])
    assert _same_bits(copy.destination(param), copy.source(new))
    assert not param[:, :2].any()
    assert not param[:, 6:].any()


def test_bits_not_values_decide_what_changed():
    base = torch.tensor([0.0, 1.0, float("nan"), 2.0])
    new = torch.tensor([-0.0, 1.0, float("nan"), 2.0])
    new.view(torch.int32)[2] += 1  # another NaN payload
    digests = version_digests({"w": new})[0]
    encoding = DeltaBase("v0", HEX, {"w": base}, version_digests({"w": base})[0]).encode(
        {"w": new}, digests
    )
    assert encoding.changed_elements == 2


def test_a_tensor_goes_whole_when_its_changes_are_not_smaller():
    base = torch.zeros(100, dtype=torch.bfloat16)
    dense = torch.ones(100, dtype=torch.bfloat16)  # every element: 600 bytes sparse vs 200
    sparse = base.clone()
    sparse[7] = 1.0
    tensors = {"dense": dense, "sparse": sparse, "frozen": base.clone()}
    kept = {"dense": base, "sparse": base, "frozen": base}
    base_digests = version_digests(kept)[0]
    encoding = DeltaBase("v0", HEX, kept, base_digests).encode(tensors, version_digests(tensors)[0])
    assert encoding.kinds == {"dense": "full", "sparse": "sparse", "frozen": "same"}
    assert [name for name, _ in encoding.stream] == ["dense", *payload_names("sparse")]
    assert encoding.stream_bytes == 200 + 1 * (4 + 2)
    assert encoding.full_bytes == 600


def test_advance_makes_the_base_the_new_version():
    base = {"a": _random_bits(torch.float32, (5, 4), 3), "b": _random_bits(torch.int8, (9,), 4)}
    new = {"a": _changed(base["a"], 0.1, 5), "b": _changed(base["b"], 1.0, 6)}
    kept = DeltaBase("v0", HEX, base, version_digests(base)[0])
    digests, fingerprint = version_digests(new)
    kept.advance(kept.encode(new, digests), new, "v1", fingerprint, digests)
    assert all(_same_bits(kept.tensors[name], new[name]) for name in new)
    assert (kept.version, kept.fingerprint, kept.digests) == ("v1", fingerprint, digests)
    assert kept.nbytes == 5 * 4 * 4 + 9


def test_base_mismatch_names_what_differs():
    kept = DeltaBase("v0", HEX, {"a": torch.zeros(3)}, {"a": HEX})
    assert kept.mismatch({"b": torch.zeros(3)}) == "the tensors' names differ from the base's"
    assert kept.mismatch({"a": torch.zeros(4)}) == "tensor 'a' changed its dtype or shape"
    assert kept.mismatch({"a": torch.ones(3)}) is None


@pytest.mark.parametrize(
    ("indices", "values", "message"),
    [
        ([0, 5], [1.0], "delta of 'w': (2,) indices for (1,) values"),
        ([-1, 2], [1.0, 2.0], "delta of 'w': an index lies outside its 10 elements"),
        ([3, 10], [1.0, 2.0], "delta of 'w': an index lies outside its 10 elements"),
        ([4, 4], [1.0, 2.0], "delta of 'w': indices are not strictly increasing"),
        ([5, 2], [1.0, 2.0], "delta of 'w': indices are not strictly increasing"),
    ],
)
def test_malformed_payloads_are_refused(indices, values, message):
    with pytest.raises(ValueError, match=r"^delta of 'w': ") as raised:
        check_payload("w", torch.tensor(indices, dtype=torch.int32), torch.tensor(values), 10)
    assert str(raised.value) == message


def test_payload_names_round_trip():
    assert payload_of(payload_names("model.layers.0.mlp.up_proj.weight")[0]) == (
        "model.layers.0.mlp.up_proj.weight",
        "indices",
    )
    assert payload_of(payload_names("a/b")[1]) == ("a/b", "values")
    assert payload_of("model.norm.weight") is None
    assert payload_of("weightbus.core.delta/w/other") is None


def test_a_spec_needs_one_slice_digest_per_sparse_tensor_and_unique_names():
    tensors = [DeltaTensor("a", "sparse", HEX, HEX), DeltaTensor("b", "same", HEX, HEX)]
    fields = {"base_version": "v0", "base_fingerprint": HEX, "fingerprint": HEX}
    spec = DeltaSpec(**fields, tensors=tensors, rank_digests=[[HEX], [HEX]])
    assert msgspec.json.decode(msgspec.json.encode(spec), type=DeltaSpec) == spec
    with pytest.raises(msgspec.ValidationError, match="every rank needs 1 slice digests"):
        msgspec.convert(
            {**fields, "tensors": tensors, "rank_digests": [[]]}, DeltaSpec, from_attributes=True
        )
    with pytest.raises(msgspec.ValidationError, match="a tensor is listed twice"):
        msgspec.convert(
            {**fields, "tensors": [tensors[0], tensors[0]], "rank_digests": [[HEX, HEX]]},
            DeltaSpec,
            from_attributes=True,
        )
