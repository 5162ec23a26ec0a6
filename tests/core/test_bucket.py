from itertools import pairwise

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from helpers import all_dtype_tensors, assert_bit_identical, random_tensor
from weightbus.core.meta import metas_of
from weightbus.core.plan import ALIGN_BYTES, FlatBucket
from weightbus.core.plan.bucket import layout_entries


def _shares_memory(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= view.data_ptr() <= start + buffer.numel()


def test_mixed_dtypes_round_trip_bit_identical_as_zero_copy_views():
    tensors = all_dtype_tensors()
    bucket = FlatBucket.pack(tensors)
    unpacked = bucket.unpack()
    assert [name for name, _ in unpacked] == [name for name, _ in tensors]
    for (_, view), (_, original) in zip(unpacked, tensors, strict=True):
        assert_bit_identical(view, original)
        assert _shares_memory(view, bucket.buffer)


def test_entries_are_aligned_and_disjoint():
    bucket = FlatBucket.pack(all_dtype_tensors())
    spans = [(e.offset, e.end) for e in bucket.entries]
    assert all(offset % ALIGN_BYTES == 0 for offset, _ in spans)
    assert all(end <= next_start for (_, end), (next_start, _) in pairwise(spans))
    assert bucket.nbytes == spans[-1][1]


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(3.25, dtype=torch.float64),
        torch.tensor(True),
        torch.empty(0, dtype=torch.bfloat16),
        torch.empty(4, 0, 3, dtype=torch.float32),
        random_tensor((7, 9), torch.float32).t(),
        random_tensor((6, 8), torch.bfloat16)[::2, 1::3],
        random_tensor((2, 3, 4), torch.float16).permute(2, 0, 1),
    ],
    ids=["0-d", "0-d bool", "empty", "empty 3-d", "transposed", "strided", "permuted"],
)
def test_special_tensors_round_trip(tensor):
    named = [
        ("before", random_tensor((5,), torch.int8)),
        ("x", tensor),
        ("after", random_tensor((3,), torch.int64)),
    ]
    bucket = FlatBucket.pack(named)
    for (_, view), (_, original) in zip(bucket.unpack(), named, strict=True):
        assert_bit_identical(view, original)
        assert view.is_contiguous()


def test_pack_into_preallocated_buffer_writes_in_place_without_allocating():
    tensors = [(f"w{i}", random_tensor((64, 256), torch.bfloat16, i)) for i in range(8)]
    _, required = layout_entries(metas_of(tensors))
    buffer = torch.empty(required + 4096, dtype=torch.uint8)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        bucket = FlatBucket.pack(tensors, buffer=buffer)
    allocations = [e.name for e in profiler.events() if e.cpu_memory_usage > 0]
    assert allocations == []
    assert bucket.buffer is buffer
    for (_, view), (_, original) in zip(bucket.unpack(), tensors, strict=True):
        assert_bit_identical(view, original)
        assert _shares_memory(view, buffer)


def _required_bytes(tensors):
    return layout_entries(metas_of(tensors))[1]


@pytest.mark.parametrize(
    ("make_buffer", "message"),
    [
        (
            lambda n: torch.empty(2, n, dtype=torch.uint8),
            r"bucket buffer must be 1-D, got shape \(2, \d+\)",
        ),
        (
            lambda n: torch.empty(n, dtype=torch.float32),
            "bucket buffer must have dtype torch.uint8, got torch.float32",
        ),
        (lambda n: torch.empty(2 * n, dtype=torch.uint8)[::2], "bucket buffer must be contiguous"),
        (
            lambda n: torch.empty(n, dtype=torch.uint8, device="meta"),
            "bucket buffer is on meta but the tensors are on cpu",
        ),
    ],
    ids=["not 1-D", "not uint8", "not contiguous", "wrong device"],
)
def test_preallocated_buffer_is_validated(make_buffer, message):
    tensors = [("a", torch.ones(10)), ("b", torch.ones(3, dtype=torch.int64))]
    with pytest.raises(ValueError, match=message):
        FlatBucket.pack(tensors, buffer=make_buffer(_required_bytes(tensors)))


def test_too_small_buffer_message_states_required_and_given_bytes():
    tensors = [("a", torch.ones(100)), ("b", torch.ones(2, dtype=torch.float64))]
    # 400 bytes of "a", padding to 512, then 16 bytes of "b".
    with pytest.raises(
        ValueError, match="bucket buffer too small: the tensors need 528 bytes, the buffer has 527"
    ):
        FlatBucket.pack(tensors, buffer=torch.empty(527, dtype=torch.uint8))


def test_duplicate_names_and_mixed_devices_are_rejected():
    with pytest.raises(ValueError, match=r"duplicate tensor names: \['a'\]"):
        FlatBucket.pack([("a", torch.ones(1)), ("b", torch.ones(1)), ("a", torch.ones(1))])
    with pytest.raises(ValueError, match="tensors are on several devices"):
        FlatBucket.pack([("a", torch.ones(1)), ("b", torch.ones(1, device="meta"))])


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_unsupported_dtype_is_rejected():
    with pytest.raises(ValueError, match=r"unsupported dtype torch\.complex32"):
        FlatBucket.pack([("c", torch.zeros(2, dtype=torch.complex32))])
