"""Transports: a registry of sinks (publisher side) and sources (engine side) by name.

Implementations are imported only when used, so heavy dependencies (torch.distributed, NIXL)
load only for the transports a user picks.
"""

import importlib
from typing import Any

from weightbus.transport.base import BucketSink, BucketSource, PushSession, ReceivedBatch

# name -> (module, sink class, source class)
_REGISTRY: dict[str, tuple[str, str, str]] = {
    "disk": ("weightbus.transport.disk", "DiskSink", "DiskSource"),
    "dist": ("weightbus.transport.dist", "DistSink", "DistSource"),
    "hf_dir": ("weightbus.transport.hf_dir", "HfDirSink", "HfDirSource"),
    "shm": ("weightbus.transport.shm", "ShmSink", "ShmSource"),
}
# transports whose sources take a `direct` placement (see `transport/shm_arena.py`)
_DIRECT = {"shm"}


def transport_names() -> list[str]:
    """Names of the registered transports (CLI choices come from here)."""
    return sorted(_REGISTRY)


def _lookup(name: str, index: int) -> Any:
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown transport {name!r}; available: {', '.join(transport_names())}"
        ) from None
    return getattr(importlib.import_module(entry[0]), entry[index])


def make_sink(name: str, **options: Any) -> BucketSink:
    """A publisher-side sink of transport `name`."""
    return _lookup(name, 1)(**options)


def accepts_direct(name: str) -> bool:
    """Whether transport `name` can write straight into parameters in shared memory."""
    return name in _DIRECT


def open_source(
    name: str, description: dict, *, rank: int = 0, tp_size: int = 1, direct: Any = None
) -> BucketSource:
    """An engine-side source of transport `name` for the session `description` names.

    Args:
        direct: this rank's `DirectPlacement` (parameters in shared memory) to offer;
            ignored by transports that cannot use it.

    Raises:
        ValueError: unknown transport or invalid description.
    """
    source_class = _lookup(name, 2)
    if direct is not None and accepts_direct(name):
        return source_class(description, rank=rank, tp_size=tp_size, direct=direct)
    return source_class(description, rank=rank, tp_size=tp_size)


__all__ = [
    "BucketSink",
    "BucketSource",
    "PushSession",
    "ReceivedBatch",
    "accepts_direct",
    "make_sink",
    "open_source",
    "transport_names",
]
