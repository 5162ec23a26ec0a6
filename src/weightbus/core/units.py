"""Byte sizes as people write them: `64MiB`, `1GiB`, `512KB`, `4096`."""

import argparse
import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """Parse a byte size such as `256MiB` or `1.5GB`.

    Raises:
        ValueError: the text is not a non-negative number with an optional unit.
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r}; expected e.g. 4096, 64MiB, 1GiB or 1.5GB")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(nbytes: int) -> str:
    """Human-readable binary size, e.g. `1.00 GiB`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def byte_size_arg(text: str) -> int:
    """`argparse` type for byte sizes: a bad value becomes a usage error naming it."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
