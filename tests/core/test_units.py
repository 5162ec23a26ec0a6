import pytest

from weightbus.core.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("4096", 4096),
        ("64MiB", 64 * 2**20),
        ("1GiB", 2**30),
        ("1.5GB", 1_500_000_000),
        ("8 kib", 8192),
    ],
)
def test_parse_bytes(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["", "1XB", "-1MiB", "MiB", "1e9"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="invalid size"):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(3 * 2**30 // 2) == "1.50 GiB"
    assert format_bytes(100) == "100 B"
