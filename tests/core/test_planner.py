import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import assert_bit_identical, random_tensor
from weightbus.core.meta import DTYPES_BY_NAME, TensorMeta, metas_of
from weightbus.core.plan import ALIGN_BYTES, Plan, plan_buckets
from weightbus.core.plan.assemble import ChunkAssembler, unpack_bucket
from weightbus.core.plan.bucket import pack_entries

KiB = 1024


def check_invariants(plan: Plan) -> None:
    """Every byte of every tensor is carried exactly once, in order, inside bucket bounds."""
    covered: dict[str, int] = {meta.name: 0 for meta in plan.metas}
    for index, bucket in enumerate(plan.buckets):
        assert bucket.index == index
        assert bucket.entries, "a planned bucket is never empty"
        previous_end = 0
        for entry in bucket.entries:
            assert entry.offset % ALIGN_BYTES == 0
            assert entry.offset >= previous_end
            assert entry.end <= plan.bucket_bytes
            assert entry.tensor_offset == covered[entry.name], "chunks arrive in order, no gap"
            covered[entry.name] += entry.nbytes
            previous_end = entry.end
    assert covered == {meta.name: meta.nbytes for meta in plan.metas}


def _metas(*specs: tuple[tuple[int, ...], torch.dtype]) -> list[TensorMeta]:
    return [TensorMeta(f"t{i}", dtype, shape) for i, (shape, dtype) in enumerate(specs)]


u8, f32, bf16 = torch.uint8, torch.float32, torch.bfloat16


@pytest.mark.parametrize(
    ("specs", "expected_layout"),
    [
        ([((1023,), u8)], [[(0, 1023)]]),
        ([((1024,), u8)], [[(0, 1024)]]),
        ([((1025,), u8)], [[(0, 1024)], [(0, 1)]]),
        ([((512,), u8), ((512,), u8)], [[(0, 512), (512, 512)]]),
        ([((512,), u8), ((513,), u8)], [[(0, 512)], [(0, 513)]]),
        ([((100,), u8), ((768,), u8)], [[(0, 100), (256, 768)]]),
        ([((100,), u8), ((769,), u8)], [[(0, 100)], [(0, 769)]]),
        ([((1,), u8), ((0,), f32), ((), f32)], [[(0, 1), (256, 0), (256, 4)]]),
        (
            [((900,), u8), ((3000,), u8), ((10,), u8)],
            [[(0, 900)], [(0, 1024)], [(0, 1024)], [(0, 952)], [(0, 10)]],
        ),
    ],
    ids=[
        "just under",
        "exactly one bucket",
        "one byte over",
        "two fill exactly",
        "second one byte over",
        "alignment fits",
        "alignment overflows",
        "empty and 0-d",
        "giant between small",  # 3000 = 1024 + 1024 + 952; 10 more do not fit after 952
    ],
)
def test_layout_around_bucket_boundaries(specs, expected_layout):
    plan = plan_buckets(_metas(*specs), bucket_bytes=1024)
    check_invariants(plan)
    assert [[(e.offset, e.nbytes) for e in b.entries] for b in plan.buckets] == expected_layout


def test_giant_2d_tensor_is_split_on_row_boundaries():
    meta = TensorMeta("embed", bf16, (1000, 96))  # rows of 192 bytes, 5 rows per 1 KiB bucket
    plan = plan_buckets([meta], bucket_bytes=KiB)
    check_invariants(plan)
    assert plan.num_buckets == 200
    assert all(e.nbytes == 960 and e.tensor_offset % 192 == 0 for e in plan.entries())


def test_rows_larger_than_a_bucket_are_split_on_element_boundaries():
    meta = TensorMeta("wide", f32, (3, 1000))  # rows of 4000 bytes > 1 KiB
    plan = plan_buckets([meta], bucket_bytes=KiB)
    check_invariants(plan)
    assert all(e.nbytes % 4 == 0 and e.tensor_offset % 4 == 0 for e in plan.entries())


def test_thousands_of_tiny_tensors_share_buckets():
    metas = [TensorMeta(f"bias.{i}", f32, (3,)) for i in range(5000)]
    plan = plan_buckets(metas, bucket_bytes=64 * KiB)
    check_invariants(plan)
    # Each 12-byte tensor occupies one 256-byte aligned slot: 256 per bucket.
    assert plan.num_buckets == -(-5000 // 256)


def test_empty_model_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot plan an empty model: no tensors given"):
        plan_buckets([], bucket_bytes=KiB)


@pytest.mark.parametrize("bucket_bytes", [0, 100, 1000, -256, 1.5, 2**20 + 1])
def test_invalid_bucket_bytes_are_named(bucket_bytes):
    with pytest.raises(
        ValueError, match=rf"bucket_bytes must be a positive multiple of 256, got {bucket_bytes}"
    ):
        plan_buckets(_metas(((4,), f32)), bucket_bytes=bucket_bytes)


def test_duplicate_names_are_rejected():
    with pytest.raises(ValueError, match=r"duplicate tensor names: \['w'\]"):
        plan_buckets([TensorMeta("w", f32, (1,)), TensorMeta("w", f32, (2,))], bucket_bytes=KiB)


def test_plan_is_deterministic():
    specs = [((37, 11), bf16), ((5000,), f32), ((3,), u8)]
    first, second = plan_buckets(_metas(*specs), 2 * KiB), plan_buckets(_metas(*specs), 2 * KiB)
    assert first == second
    assert first.plan_hash == second.plan_hash


@pytest.mark.parametrize(
    "change",
    [
        lambda m, b: ([*m[:-1], TensorMeta("renamed", m[-1].dtype, m[-1].shape)], b),
        lambda m, b: ([*m[:-1], TensorMeta(m[-1].name, torch.float16, m[-1].shape)], b),
        lambda m, b: ([*m[:-1], TensorMeta(m[-1].name, m[-1].dtype, (2, 6))], b),
        lambda m, b: (list(reversed(m)), b),
        lambda m, b: (m, b * 2),
    ],
    ids=["name", "dtype", "shape", "order", "bucket_bytes"],
)
def test_plan_hash_changes_iff_plan_changes(change):
    metas = _metas(((300,), f32), ((12, 1), bf16))
    plan = plan_buckets(metas, KiB)
    changed_metas, changed_bucket_bytes = change(metas, KiB)
    changed = plan_buckets(changed_metas, changed_bucket_bytes)
    assert changed != plan
    assert changed.plan_hash != plan.plan_hash


def _round_trip(
    named: list[tuple[str, torch.Tensor]], bucket_bytes: int
) -> dict[str, torch.Tensor]:
    """Pack every bucket into one reused buffer and reassemble on the other side."""
    plan = plan_buckets(metas_of(named), bucket_bytes)
    check_invariants(plan)
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8)
    assembler = ChunkAssembler()
    received = {}
    for bucket in plan.buckets:
        buffer.fill_(0xAB)  # stale bytes must never leak into a tensor
        pack_entries(buffer, bucket.entries, dict(named))
        received.update((name, t.clone()) for name, t in unpack_bucket(bucket, buffer, assembler))
    assert assembler.pending_names == []
    return received


def test_round_trip_with_chunks_is_bit_identical():
    named = [
        ("small", random_tensor((7,), torch.float16, 1)),
        ("giant_rows", random_tensor((300, 20), torch.float32, 2)),
        ("giant_flat", random_tensor((3000,), torch.bfloat16, 3)),
        ("giant_transposed", random_tensor((40, 90), torch.float32, 4).t()),
        ("wide_rows_strided", random_tensor((4, 1200), torch.float32, 5)[:, ::2]),
        ("scalar", random_tensor((), torch.float64, 6)),
    ]
    received = _round_trip(named, bucket_bytes=KiB)
    assert list(received) == [name for name, _ in named]
    for name, original in named:
        assert_bit_identical(received[name], original)


def test_assembler_rejects_overlapping_and_out_of_range_chunks():
    plan = plan_buckets([TensorMeta("w", f32, (600,))], bucket_bytes=KiB)
    first = plan.buckets[0].entries[0]
    assembler = ChunkAssembler()
    assert assembler.add(first, torch.zeros(first.nbytes, dtype=torch.uint8)) is None
    with pytest.raises(
        ValueError, match=r"chunk of 'w' at bytes \[0, 1024\) overlaps one already received"
    ):
        assembler.add(first, torch.zeros(first.nbytes, dtype=torch.uint8))
    beyond = type(first)("w", "float32", (600,), 0, 1024, 2048)
    with pytest.raises(
        ValueError,
        match=r"chunk of 'w' at byte 2048 \(\+1024\) lies outside the tensor's 2400 bytes",
    ):
        assembler.add(beyond, torch.zeros(1024, dtype=torch.uint8))
    assert assembler.pending_names == ["w"]


_dtypes = st.sampled_from(
    [DTYPES_BY_NAME[n] for n in ("float32", "bfloat16", "uint8", "float64", "int16")]
)
_shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(st.tuples(_shapes, _dtypes), min_size=1, max_size=12),
    bucket_slots=st.integers(1, 16),
)
def test_any_model_round_trips_bit_identical(specs, bucket_slots):
    named = [(f"p{i}", random_tensor(shape, dtype, i)) for i, (shape, dtype) in enumerate(specs)]
    received = _round_trip(named, bucket_bytes=bucket_slots * ALIGN_BYTES)
    for name, original in named:
        assert_bit_identical(received[name], original)
