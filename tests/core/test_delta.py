"""Delta encoding and application, bit-exact, for every wire dtype and shape.

A random base/new pair is encoded against the base; each rank of a TP split (a range along
one dimension, as `ShardCopy` describes it) applies the changes to its slice of the base. Every
slice must equal the new tensor's slice bit for bit, and its digest the one the publisher
computes for that rank (`rank_digests`).
"""

import math
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightbus.core.delta import (
    RankBase,
    apply_to_slice,
    check_payload,
    encode_cells,
    payload_names,
    payload_of,
)
from weightbus.core.delta.bits import element_words
from weightbus.core.digest import tensor_digest
from weightbus.core.meta import DTYPES_BY_NAME
from weightbus.core.plan.shard import ShardCopy
from weightbus.core.publisher.delta import StreamStep, delta_kinds, delta_stream
from weightbus.core.trainer.holdings import whole_holding
from weightbus.core.trainer.layout import TrainerLayout, held_metas
from weightbus.core.wire.delta import DeltaSpec, DeltaTensor

DTYPES = sorted(DTYPES_BY_NAME)
HEX = "0" * 32


class _Encoded:
    """A new version encoded against a base by one process (a group of one), as a push does."""

    def __init__(self, base: dict, new: dict, *, sparse: bool = True) -> None:
        self.holdings = {name: whole_holding(name, tensor) for name, tensor in new.items()}
        self.layout = TrainerLayout((tuple(held_metas(list(self.holdings.values()))),))
        held = {name: whole_holding(name, tensor) for name, tensor in base.items()}
        self.base = RankBase(held, self.layout.layout_hash, version="v0")
        self.changed = [n for n in new if tensor_digest(new[n]) != tensor_digest(base[n])]
        with ThreadPoolExecutor(2) as pool:
            self.changes = self.base.encode(
                self.changed, encode_cells(self.layout), self.holdings, 0, pool
            )
        counts = {
            n: {c.cell: c.indices.numel() for c in found} for n, found in self.changes.items()
        }
        self.kinds, self.figures = delta_kinds(self.layout, self.changed, counts, sparse)
        totals = {n: [counts[n].get(0, 0)] for n, kind in self.kinds.items() if kind == "sparse"}
        self.stream = StreamStep(kinds=self.kinds, counts=totals)

    def kind(self, name: str) -> str:
        return self.kinds.get(name, "same")

    def sparse(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        (found,) = self.changes[name]
        return found.indices, found.values


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
    encoded = _Encoded({"w": base}, {"w": new})
    kind = encoded.kind("w")
    assert (kind == "same") == _same_bits(base, new)
    if kind != "sparse":
        assert kind == "same" or encoded.kinds == {"w": "full"}
        return
    indices, values = encoded.sparse("w")
    assert indices.numel() < new.numel()
    check_payload("w", indices, values, new.numel())
    dim = dim_pick % len(shape) if shape else 0
    copies = _splits(shape, dim, tp) if shape else [ShardCopy.whole(())]
    for copy in copies:
        param = copy.source(base).clone()
        destination = param if not shape else param.narrow(dim, 0, copy.length)
        apply_to_slice(destination, shape, copy, indices, values)
        assert _same_bits(destination, copy.source(new))


def test_a_column_slice_inside_a_wider_parameter_is_written_in_place():
    """Row-parallel layers hold columns of every row; the destination is a strided view."""
    base = _random_bits(torch.bfloat16, (6, 8), 1)
    new = _changed(base, 0.3, 2)
    encoded = _Encoded({"w": base}, {"w": new})
    param = torch.zeros(6, 10, dtype=torch.bfloat16)  # padded: the slice is columns 2..6
    copy = ShardCopy(1, 4, 1, 2, 4)
    copy.destination(param).copy_(copy.source(base))
    apply_to_slice(copy.destination(param), (6, 8), copy, *encoded.sparse("w"))
    assert _same_bits(copy.destination(param), copy.source(new))
    assert not param[:, :2].any()
    assert not param[:, 6:].any()


def test_bits_not_values_decide_what_changed():
    base = torch.tensor([0.0, 1.0, float("nan"), 2.0])
    new = torch.tensor([-0.0, 1.0, float("nan"), 2.0])
    new.view(torch.int32)[2] += 1  # another NaN payload
    encoded = _Encoded({"w": base}, {"w": new})
    assert encoded.figures["changed_fraction"] == 2 / 4


def test_a_tensor_goes_whole_when_its_changes_are_not_smaller():
    base = torch.zeros(100, dtype=torch.bfloat16)
    dense = torch.ones(100, dtype=torch.bfloat16)  # every element: 600 bytes sparse vs 200
    sparse = base.clone()
    sparse[7] = 1.0
    tensors = {"dense": dense, "sparse": sparse, "frozen": base.clone()}
    kept = {"dense": base, "sparse": base, "frozen": base}
    encoded = _Encoded(kept, tensors)
    assert encoded.kinds == {"dense": "full", "sparse": "sparse"}
    assert encoded.figures["tensors"] == {"same": 1, "sparse": 1, "full": 1}
    layout, mine = delta_stream(
        encoded.layout, encoded.holdings, encoded.stream, encoded.changes, 0
    )
    assert [meta.name for meta in layout.metas] == ["dense", *payload_names("sparse")]
    assert list(mine) == ["dense", *payload_names("sparse")]
    assert encoded.figures["stream_bytes"] == 200 + 1 * (4 + 2)
    assert encoded.figures["full_bytes"] == 600


def test_advance_makes_the_base_the_new_version():
    base = {"a": _random_bits(torch.float32, (5, 4), 3), "b": _random_bits(torch.int8, (9,), 4)}
    new = {"a": _changed(base["a"], 0.1, 5), "b": _changed(base["b"], 1.0, 6)}
    encoded = _Encoded(base, new)
    kept = encoded.base
    sparse = {n: c for n, c in encoded.changes.items() if encoded.kind(n) == "sparse"}
    full = [n for n in encoded.changed if encoded.kind(n) == "full"]
    kept.advance(sparse, full, encoded.holdings)
    assert all(_same_bits(kept.tensors[name], new[name]) for name in new)
    assert kept.nbytes == 5 * 4 * 4 + 9


def test_base_mismatch_names_what_differs():
    def layout(**tensors: torch.Tensor) -> TrainerLayout:
        return TrainerLayout(
            (tuple(held_metas([whole_holding(n, t) for n, t in tensors.items()])),)
        )

    kept = RankBase({"a": whole_holding("a", torch.zeros(3))}, layout(a=torch.zeros(3)).layout_hash,
                    version="v0")  # fmt: skip
    changed = "the tensors (their names, dtypes, shapes or who holds them) changed"
    assert kept.mismatch(layout(b=torch.zeros(3))) == changed
    assert kept.mismatch(layout(a=torch.zeros(4))) == changed
    assert kept.mismatch(layout(a=torch.ones(3))) is None


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
