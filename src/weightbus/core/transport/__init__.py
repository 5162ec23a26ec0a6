"""Transports: a registry of sinks (publisher side), sources (engine side) and the typed
description that travels between them, by name.

A transport is one module plus one `_REGISTRY` line naming its parts `"module:attribute"`,
imported only when used (heavy dependencies load only for the transports picked). Another
package registers one through the `weightbus.transports` entry point group (name -> a
`TransportEntry`) so every process finds it; `register_transport` adds one in this process.
"""

import importlib
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import msgspec

from weightbus.core.trainer.group import TrainerGroup
from weightbus.core.transport.base import (
    BucketSink,
    BucketSource,
    PushSession,
    RankSetupRequest,
    ReceivedBatch,
    SourceDescription,
)

# the built-in `dist` transport's set-up names the publisher's API and the engines' SGLang-style
# routes use (a light module: torch.distributed loads only with the transport's parts)
from weightbus.core.transport.distributed.messages import (
    DEFAULT_GROUP_NAME,
    GROUP_NAME_PATTERN,
    WeightsGroupError,
    WeightsGroupInfo,
)
from weightbus.core.transport.parts.arena import DirectPlacement, ParamArena, direct_placement
from weightbus.core.transport.parts.shared_memory import remove_stale_slots
from weightbus.core.transport.sending import RankSender, Sending
from weightbus.core.wire import ProtocolError
from weightbus.core.wire.messages import SliceSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TransportEntry:
    """Where the parts of one transport live, each as `"module:attribute"`.

    Attributes:
        sink: the `BucketSink` class (the trainer group's leader).
        source: the `BucketSource` class (engine rank side).
        sender: the `RankSender` class (every trainer rank: writes what the rank sends).
        description: the `SourceDescription` struct the sink returns and sources open.
        direct: sources accept a `DirectPlacement` (ranks' parameters in shared memory).
        rank_setup: a function `(request, *, tp_rank, tp_size, slices) -> None` every engine
            rank runs when the publisher sets the transport up or tears it down, or None.
        setup_request: the type of that function's `request`: a `RankSetupRequest` subclass,
            or a tagged union of them.
        checks_slices: sources accept `slices`, the rank's slice map now, to refuse a push
            planned against the one its set-up registered (an engine's experts moved since).
    """

    sink: str
    source: str
    description: str
    sender: str
    direct: bool = False
    rank_setup: str | None = None
    setup_request: str | None = None
    checks_slices: bool = False


_REGISTRY: dict[str, TransportEntry] = {
    "disk": TransportEntry(
        sink="weightbus.core.transport.disk:DiskSink",
        source="weightbus.core.transport.disk:DiskSource",
        sender="weightbus.core.transport.parts.files:FileRankSender",
        description="weightbus.core.transport.disk:DiskDescription",
    ),
    "dist": TransportEntry(
        sink="weightbus.core.transport.distributed.sink:DistSink",
        source="weightbus.core.transport.distributed.source:DistSource",
        sender="weightbus.core.transport.distributed.sender:DistRankSender",
        description="weightbus.core.transport.distributed.messages:DistDescription",
        rank_setup="weightbus.core.transport.distributed.setup:apply_rank_setup",
        setup_request="weightbus.core.transport.distributed.messages:WeightsGroupRequest",
        checks_slices=True,
    ),
    "hf_dir": TransportEntry(
        sink="weightbus.core.transport.hf_dir:HfDirSink",
        source="weightbus.core.transport.hf_dir:HfDirSource",
        sender="weightbus.core.transport.parts.files:FileRankSender",
        description="weightbus.core.transport.hf_dir:HfDirDescription",
    ),
    "nixl": TransportEntry(
        sink="weightbus.core.transport.nixl.sink:NixlSink",
        source="weightbus.core.transport.nixl.source:NixlSource",
        sender="weightbus.core.transport.nixl.sender:NixlRankSender",
        description="weightbus.core.transport.nixl.messages:NixlDescription",
        direct=True,
    ),
    "shm": TransportEntry(
        sink="weightbus.core.transport.shm.sink:ShmSink",
        source="weightbus.core.transport.shm.source:ShmSource",
        sender="weightbus.core.transport.shm.sender:ShmRankSender",
        description="weightbus.core.transport.shm.description:ShmDescription",
        direct=True,
    ),
}

ENTRY_POINT_GROUP = "weightbus.transports"
_NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_plugins_lock = threading.Lock()
_plugins_loaded = False


def register_transport(name: str, entry: TransportEntry) -> None:
    """Add transport `name` to this process's registry.

    Raises:
        ValueError: the name is taken, or not 1-32 of `[a-z0-9_]` starting with a letter.
    """
    if not _NAME_PATTERN.match(name):
        raise ValueError(f"transport name {name!r}: use 1-32 of [a-z0-9_], starting with a letter")
    if name in _REGISTRY:
        raise ValueError(f"transport {name!r} is already registered")
    _REGISTRY[name] = entry


def _load_plugins() -> None:
    """Register the `weightbus.transports` entry points once (each names a `TransportEntry`)."""
    global _plugins_loaded  # noqa: PLW0603 - a process-wide, load-once registry
    if _plugins_loaded:  # the common case: no lock once loaded
        return
    with _plugins_lock:
        if _plugins_loaded:
            return
        _plugins_loaded = True
        for point in entry_points(group=ENTRY_POINT_GROUP):
            # a broken plugin must not take the built-in transports down with it
            try:
                entry = point.load()
                if not isinstance(entry, TransportEntry):
                    raise TypeError(f"{point.value} is a {type(entry).__name__}")  # noqa: TRY301
                register_transport(point.name, entry)
            except (ImportError, AttributeError, TypeError, ValueError) as exc:
                logger.warning("transport plugin %r not registered: %s", point.name, exc)


def transport_names() -> list[str]:
    """Names of the registered transports (CLI and API choices come from here)."""
    _load_plugins()
    return sorted(_REGISTRY)


def _entry(name: str) -> TransportEntry:
    _load_plugins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown transport {name!r}; available: {', '.join(transport_names())}"
        ) from None


def _load(path: str) -> Any:
    module, attribute = path.split(":")
    return getattr(importlib.import_module(module), attribute)


def make_sink(name: str, **options: Any) -> BucketSink:
    """A publisher-side sink of transport `name`, built with the sink's keyword `options`.

    Raises:
        ValueError: unknown transport, or options the sink refuses.
    """
    return _load(_entry(name).sink)(**options)


def make_rank_sender(name: str, group: TrainerGroup) -> RankSender:
    """A trainer rank's sender of transport `name` (every rank of the group makes its own).

    Raises:
        ValueError: unknown transport.
    """
    return _load(_entry(name).sender)(group)


def has_setup(name: str) -> bool:
    """Whether transport `name` is set up across engines before pushing (`dist`).

    Raises:
        ValueError: unknown transport.
    """
    return _entry(name).rank_setup is not None


def description_type(name: str) -> type[SourceDescription]:
    """The description struct of transport `name`."""
    return _load(_entry(name).description)


def decode_description(name: str, raw: Mapping[str, Any]) -> SourceDescription:
    """The typed description of transport `name` from its JSON/msgpack form (the one parser:
    the engine's HTTP edge and every rank call it).

    Raises:
        ValueError: unknown transport.
        ProtocolError: a field is missing, unknown, of another type or out of range (the
            message names it as `source.<field>`).
    """
    return _convert(raw, description_type(name), f"{name} source", "source")


def _convert(raw: Mapping[str, Any], struct: Any, what: str, root: str) -> Any:
    try:
        return msgspec.convert(raw, type=struct)
    except msgspec.ValidationError as exc:
        message = str(exc).replace("`$", f"`{root}")
        raise ProtocolError(f"{what}: {message}") from None


def encode_description(description: SourceDescription) -> dict[str, Any]:
    """The JSON/msgpack form of a description (what `decode_description` reads back)."""
    return msgspec.to_builtins(description)


def open_source(
    name: str,
    description: SourceDescription | Mapping[str, Any],
    *,
    rank: int = 0,
    tp_size: int = 1,
    direct: DirectPlacement | None = None,
    slices: Sequence[SliceSpec] | None = None,
) -> BucketSource:
    """An engine-side source of transport `name` for the session `description` names.

    Args:
        description: the typed description, or its JSON/msgpack form (decoded here).
        direct: this rank's `DirectPlacement` (parameters in shared memory) to offer;
            ignored by transports that cannot use it.
        slices: this rank's slice map now, for transports that check it against the one
            their set-up registered (`TransportEntry.checks_slices`); ignored by the others.

    Raises:
        ValueError: unknown transport or invalid description (`ProtocolError`), or a slice
            map that changed since the transport's set-up.
    """
    entry = _entry(name)
    if not isinstance(description, SourceDescription):
        description = decode_description(name, description)
    source_class = _load(entry.source)
    options: dict[str, Any] = {"rank": rank, "tp_size": tp_size}
    if direct is not None and entry.direct:
        options["direct"] = direct
    if slices is not None and entry.checks_slices:
        options["slices"] = list(slices)
    return source_class(description, **options)


def _setup_entry(name: str) -> TransportEntry:
    entry = _entry(name)
    if entry.rank_setup is None or entry.setup_request is None:
        raise ValueError(f"transport {name!r} needs no set-up on engine ranks")
    return entry


def rank_setup(name: str) -> Any:
    """The engine-rank set-up function of transport `name`.

    Raises:
        ValueError: unknown transport, or one that needs no set-up on the ranks.
    """
    return _load(_setup_entry(name).rank_setup)


def setup_transport_names() -> list[str]:
    """Names of the registered transports whose engine ranks run a set-up."""
    return [name for name in transport_names() if has_setup(name)]


def decode_setup_request(name: str, raw: Mapping[str, Any]) -> RankSetupRequest:
    """The typed set-up (or tear-down) request of transport `name` from its JSON/msgpack form.

    Raises:
        ValueError: unknown transport, or one that needs no set-up on the ranks.
        ProtocolError: a field is missing, unknown, of another type or out of range.
    """
    request_type = _load(_setup_entry(name).setup_request)
    return _convert(raw, request_type, f"{name} set-up", "request")


__all__ = [
    "DEFAULT_GROUP_NAME",
    "ENTRY_POINT_GROUP",
    "GROUP_NAME_PATTERN",
    "BucketSink",
    "BucketSource",
    "DirectPlacement",
    "ParamArena",
    "PushSession",
    "RankSender",
    "RankSetupRequest",
    "ReceivedBatch",
    "Sending",
    "SourceDescription",
    "TransportEntry",
    "WeightsGroupError",
    "WeightsGroupInfo",
    "decode_description",
    "decode_setup_request",
    "description_type",
    "direct_placement",
    "encode_description",
    "has_setup",
    "make_rank_sender",
    "make_sink",
    "open_source",
    "rank_setup",
    "register_transport",
    "remove_stale_slots",
    "setup_transport_names",
    "transport_names",
]
