"""What travels for `dist`: a session's description, the weights group's set-up requests, the
outcome of a set-up, and the frames of a push's hand-shake (`handshake.py`)."""

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import msgspec

from weightbus.core.transport.base import RankSetupRequest, SourceDescription
from weightbus.core.wire.codec import Message, register
from weightbus.core.wire.messages import Hex128, Text

DEFAULT_GROUP_NAME = "weightbus"
GROUP_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
GroupName = Annotated[str, msgspec.Meta(pattern=GROUP_NAME_PATTERN)]
EngineGroupRank = Annotated[int, msgspec.Meta(ge=1)]
Backend = Literal["gloo"]
MAX_PREFETCH_DEPTH = 64


class DistDescription(SourceDescription, frozen=True):
    """One `dist` session on the live weights group `group_name`.

    Attributes:
        mode: `broadcast` or `parts` (`sink.py` tells them).
        prefetch_depth: buckets a rank receives ahead of the one it loads.
    """

    group_name: GroupName
    session_id: Hex128
    mode: Literal["broadcast", "parts"]
    prefetch_depth: Annotated[int, msgspec.Meta(ge=1, le=MAX_PREFETCH_DEPTH)] = 1


class _SetupRequest(RankSetupRequest, frozen=True, kw_only=True, tag_field="action"):
    """Base of the set-up requests of weights group `group_name` (`action` tells which)."""

    change: ClassVar[str] = "weights-group change"
    busy: ClassVar[str] = "a weights group is being initialised or destroyed"

    group_name: GroupName = DEFAULT_GROUP_NAME

    def stalled_message(self, waited_s: float) -> str:
        return (
            f"weights group {self.group_name!r}: the {self.__struct_config__.tag} did not "
            f"return within {waited_s:g} s (a store that never answers?)"
        )


class WeightsGroupInit(_SetupRequest, frozen=True, tag="init"):
    """Join the weights group: rank r of the engine is group rank `rank_offset + r` of
    `world_size`; the publisher (rank 0) serves the store at `master_addr:master_port`."""

    master_addr: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    master_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    rank_offset: Annotated[int, msgspec.Meta(ge=1)]
    world_size: Annotated[int, msgspec.Meta(ge=2, le=65536)]
    backend: Backend = "gloo"
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0

    def wait_s(self) -> float:
        return self.timeout_s

    def refusal(self, tp_size: int) -> str | None:
        if self.rank_offset + tp_size <= self.world_size:
            return None
        return (
            f"rank_offset {self.rank_offset} + tp_size {tp_size} exceeds "
            f"world_size {self.world_size}"
        )

    def done_message(self, tp_size: int) -> str:
        last = self.rank_offset + tp_size - 1
        return (
            f"joined weights group {self.group_name!r} as ranks "
            f"{self.rank_offset}..{last} of {self.world_size}"
        )


class WeightsGroupDestroy(_SetupRequest, frozen=True, tag="destroy"):
    """Leave the weights group `group_name`."""

    teardown: ClassVar[bool] = True

    def done_message(self, tp_size: int) -> str:
        del tp_size
        return f"left weights group {self.group_name!r}"


# what an engine rank's `dist` set-up takes
WeightsGroupRequest = WeightsGroupInit | WeightsGroupDestroy


@dataclass(frozen=True, slots=True)
class WeightsGroupInfo:
    """A formed weights group: its size and each engine's first group rank."""

    name: str
    world_size: int
    rank_offsets: dict[str, int]


class WeightsGroupError(RuntimeError):
    """A `dist` weights group could not be initialised or destroyed on every member.

    Attributes:
        failures: engine URL (or "publisher") -> reason.
    """

    def __init__(self, name: str, action: str, failures: dict[str, str]) -> None:
        self.failures = failures
        details = "; ".join(f"{member}: {reason}" for member, reason in failures.items())
        super().__init__(f"{action} of weights group {name!r} failed: {details}")


# --- a push's hand-shake (`handshake.py`): wire frames, never pickle ---


@register
class RankReady(Message, kw_only=True):
    """An engine rank opened session `session_id` and waits for the publisher's word
    (`StreamStart`, or `UpdateAbort` with the reason) before anything of it moves."""

    session_id: Hex128
    group_rank: EngineGroupRank


@register
class RankRefusal(Message, kw_only=True):
    """An engine rank cannot take part in session `session_id`: the publisher cancels the push
    before anything of it moves."""

    session_id: Hex128
    group_rank: EngineGroupRank
    reason: Text


@register
class StreamStart(Message, kw_only=True):
    """Every engine rank is ready: the session's messages and data follow on the group."""

    session_id: Hex128
