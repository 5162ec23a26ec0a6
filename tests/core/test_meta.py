import pytest
import torch

from weightbus.core.meta import DTYPES_BY_NAME, TensorMeta, dtype_from_name, dtype_name, metas_of


@pytest.mark.parametrize("name", list(DTYPES_BY_NAME))
def test_dtype_names_round_trip(name):
    assert dtype_name(dtype_from_name(name)) == name


def test_float8_dtypes_that_torch_offers_are_supported():
    float8 = [
        n
        for n in dir(torch)
        if n.startswith("float8_") and isinstance(getattr(torch, n), torch.dtype)
    ]
    assert float8, "this torch build has no float8 dtypes"
    assert set(float8) <= set(DTYPES_BY_NAME)


def test_unsupported_dtype_is_named():
    with pytest.raises(ValueError, match=r"unsupported dtype torch.qint8"):
        dtype_name(torch.qint8)
    with pytest.raises(ValueError, match=r"unknown dtype name 'float7'"):
        dtype_from_name("float7")


def test_tensor_meta_sizes():
    meta = TensorMeta.of("w", torch.empty(3, 4, 5, dtype=torch.bfloat16))
    assert (meta.numel, meta.nbytes, meta.row_bytes) == (60, 120, 40)
    scalar = TensorMeta.of("s", torch.tensor(1.0, dtype=torch.float64))
    assert (scalar.shape, scalar.nbytes, scalar.row_bytes) == ((), 8, 8)


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [("", (1,), "non-empty string"), ("w", (2, -1), r"invalid shape \(2, -1\)")],
)
def test_tensor_meta_rejects_bad_fields(name, shape, message):
    with pytest.raises(ValueError, match=message):
        TensorMeta(name, torch.float32, shape)


def test_metas_of_rejects_duplicates():
    with pytest.raises(ValueError, match="duplicate tensor name 'a'"):
        metas_of([("a", torch.zeros(1)), ("b", torch.zeros(1)), ("a", torch.zeros(2))])
