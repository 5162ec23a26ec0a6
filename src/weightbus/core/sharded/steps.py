"""Rank 0's words to the other trainer ranks during a push, in order on the control store: write
straight into the engines' parameters (`WriteStep`), or open the slots (`SlotsStep`) and pack
each bucket (`PackStep`); then the push's outcome (`OutcomeStep`), which may come at any step."""

import msgspec

from weightbus.core.sharded.nixl_write import NixlWriteOrder
from weightbus.core.sharded.slots import SlotsOrder
from weightbus.core.sharded.write import WriteOrder


class Step(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    pass


class WriteStep(Step, frozen=True, kw_only=True):
    order: WriteOrder


class NixlWriteStep(Step, frozen=True, kw_only=True):
    order: NixlWriteOrder


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


AnyStep = WriteStep | NixlWriteStep | SlotsStep | PackStep | OutcomeStep
