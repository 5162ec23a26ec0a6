"""Rank 0's words to the other trainer ranks during a push, in order on the control store: write
straight into the engines' parameters (`WriteStep`, `NixlWriteStep`), join the weights group
(`DistJoinStep`) and send a session on it (`DistStep`), fill the shards (`DiskStep`), or open
the slots (`SlotsStep`) and pack each bucket (`PackStep`); then the push's outcome
(`OutcomeStep`), which may come at any step."""

import msgspec

from weightbus.core.sharded.dist_send import DistOrder, JoinOrder
from weightbus.core.sharded.nixl_write import NixlWriteOrder
from weightbus.core.sharded.slots import SlotsOrder
from weightbus.core.sharded.write import WriteOrder


class Step(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    pass


class WriteStep(Step, frozen=True, kw_only=True):
    order: WriteOrder


class NixlWriteStep(Step, frozen=True, kw_only=True):
    order: NixlWriteOrder


class DistJoinStep(Step, frozen=True, kw_only=True):
    order: JoinOrder


class DistStep(Step, frozen=True, kw_only=True):
    order: DistOrder


class DiskFile(msgspec.Struct, frozen=True, array_like=True):
    """One shard: its path, and where each tensor's bytes start in it."""

    path: str
    offsets: dict[str, int]


class DiskOrder(msgspec.Struct, frozen=True, kw_only=True):
    """Rank 0's order: the session's shards, laid out and sized, to fill."""

    files: list[DiskFile]


class DiskStep(Step, frozen=True, kw_only=True):
    order: DiskOrder


class SlotsStep(Step, frozen=True, kw_only=True):
    order: SlotsOrder


class PackStep(Step, frozen=True, kw_only=True):
    bucket: int
    slot: int


class OutcomeStep(Step, frozen=True, kw_only=True):
    ok: bool
    fingerprint: str = ""
    sent_bytes: list[int] = []
    message: str = ""
    failures: dict[str, str] = {}
    transport_error: str | None = None
    aborted: list[str] = []


AnyStep = (
    WriteStep
    | NixlWriteStep
    | DistJoinStep
    | DistStep
    | DiskStep
    | SlotsStep
    | PackStep
    | OutcomeStep
)
