"""The chunk check the copy loops run (`holds_nonfinite`): exact for every floating dtype, on
every bit pattern of the 8- and 16-bit ones, and when a finite chunk's sum overflows."""

import pytest
import torch

from weightbus.core.finite import (
    NonFiniteWeightsError,
    has_nonfinite_bits,
    holds_nonfinite,
    refuse_nonfinite_chunk,
)
from weightbus.core.meta import TensorMeta
from weightbus.core.plan.bucket import layout_entries, nonfinite_row_check, pack_entry

_SMALL_FLOATS = [
    torch.bfloat16,
    torch.float16,
    torch.float8_e5m2,
    torch.float8_e4m3fn,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
]
_INT_OF_BITS = {8: torch.uint8, 16: torch.int16}


@pytest.mark.parametrize("dtype", _SMALL_FLOATS, ids=str)
def test_the_bit_test_agrees_with_torch_on_every_bit_pattern(dtype):
    bits = torch.finfo(dtype).bits
    every = torch.arange(1 << bits, dtype=torch.int32).to(_INT_OF_BITS[bits]).view(dtype)
    nonfinite = ~torch.isfinite(every.float())
    assert int(nonfinite.sum()) > 0
    for value, bad in zip(every, nonfinite.tolist(), strict=True):
        assert has_nonfinite_bits(value.reshape(1)) == bad
    assert holds_nonfinite(every)
    assert not holds_nonfinite(every[~nonfinite])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, *_SMALL_FLOATS], ids=str)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=str)
def test_one_bad_value_is_found_in_a_chunk_and_in_a_strided_view(dtype, value):
    chunk = torch.randn(64, 32).to(dtype)
    assert not holds_nonfinite(chunk)
    widened = chunk.float()  # float8 takes no item assignment of a float: set it in float32
    widened[5, 17] = value
    chunk = widened.to(dtype)
    if torch.isfinite(chunk.float()).all():  # the dtype has no inf: it saturated
        pytest.skip(f"{dtype} has no {value}")
    assert holds_nonfinite(chunk)
    assert holds_nonfinite(chunk[:, 16:])
    assert not holds_nonfinite(chunk[:, :16])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_a_finite_chunk_whose_sum_overflows_passes(dtype):
    big = torch.full((4096,), torch.finfo(dtype).max / 2, dtype=dtype)
    assert not torch.isfinite(big.sum())
    assert not holds_nonfinite(big)


def test_the_chunk_refusal_names_the_tensor_and_skips_integers():
    refuse_nonfinite_chunk("ids", torch.arange(5))
    refuse_nonfinite_chunk("empty", torch.empty(0))
    with pytest.raises(NonFiniteWeightsError, match="tensor 'w' holds NaN or infinite values"):
        refuse_nonfinite_chunk("w", torch.tensor([1.0, float("nan")]))
    assert nonfinite_row_check("ids", torch.arange(5)) is None


def test_the_row_check_reads_only_the_rows_it_is_given():
    rows = torch.zeros(10, 4)
    rows[7, 2] = float("inf")
    check = nonfinite_row_check("w", rows)
    check(0, 7)
    with pytest.raises(NonFiniteWeightsError):
        check(7, 10)
    scalar = nonfinite_row_check("s", torch.tensor(float("nan")))
    with pytest.raises(NonFiniteWeightsError):
        scalar(0, 1)


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "one_copy"])
def test_pack_entry_refuses_a_bad_chunk_only_when_asked(pooled):
    tensor = torch.randn(3000, 1000, dtype=torch.bfloat16)  # ~6 MiB: two 4 MiB chunks
    tensor[-1, -1] = float("-inf")
    (entry,), nbytes = layout_entries([TensorMeta.of("w", tensor)])
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    pack_entry(buffer, entry, tensor, pooled=pooled)
    with pytest.raises(NonFiniteWeightsError, match="tensor 'w' holds NaN or infinite values"):
        pack_entry(buffer, entry, tensor, pooled=pooled, refuse_nonfinite=True)
