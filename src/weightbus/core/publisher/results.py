"""What a push (or a rollback) returns or raises, and the fleet's version."""

from collections.abc import Sequence
from dataclasses import dataclass, field

from weightbus.core.publisher.delta import DeltaReport
from weightbus.core.publisher.targets import EngineResult
from weightbus.core.wire.adapter import AdapterSpec


class PushError(RuntimeError):
    """One or more engines did not commit a push (or a rollback).

    Attributes:
        failures: engine URL -> reason.
        transport_error: why the publisher's side of the transport failed, if it did.
        aborted: engines told to discard the version because of another: those that had
            staged it (two-phase: no engine commits unless all can), and those whose ranks
            waited in the session for an engine that did not join or answered early.
    """

    def __init__(
        self,
        version: str,
        failures: dict[str, str],
        transport_error: str | None = None,
        *,
        aborted: Sequence[str] = (),
        action: str | None = None,
    ) -> None:
        self.version = version
        self.failures = failures
        self.transport_error = transport_error
        self.aborted = list(aborted)
        self.action = action
        details = "; ".join(f"{url}: {reason}" for url, reason in failures.items())
        if transport_error:
            details += f"; publisher: {transport_error}"
        if self.aborted:
            details += f"; aborted because of the others: {', '.join(self.aborted)}"
        action = action or f"push of version {version!r}"
        super().__init__(f"{action} failed on {len(failures)} engine(s): {details}")


@dataclass(frozen=True, slots=True)
class FleetVersion:
    """The version every member engine serves (as of the Publisher's last commit)."""

    version: str
    step: int | None
    fingerprint: str


@dataclass(frozen=True, slots=True)
class PushResult:
    """A committed push: every engine serves `version` with `fingerprint`. Every rank of the
    trainer group gets the same one.

    `nbytes` is the pushed tensors' size; `sent_bytes` the tensor bytes the transport's sink
    handed over (`PushSession.sent_bytes` says what each transport counts; a rollback moves
    none), `rank_sent_bytes` the same by trainer rank (what each rank's copies, writes or
    sends carried); each engine's `EngineResult.rank_nbytes` what reached its ranks.
    """

    version: str
    fingerprint: str
    nbytes: int
    seconds: float
    engines: list[EngineResult]
    phases: dict[str, float] = field(default_factory=dict)
    mode: str = ""  # how the bytes travelled: the transport, or "shm direct" / "shm slots"
    two_phase: bool = False
    # engines that failed past the commit point (removed from the Publisher): URL -> reason
    gone: dict[str, str] = field(default_factory=dict)
    sent_bytes: int = 0
    rank_sent_bytes: list[int] = field(default_factory=list)
    delta: DeltaReport | None = None  # whether the push went as a delta, and why
    # quantized in the push (`Publisher(quantize=...)`, e.g. "fp8-block 128x128"): `fingerprint`
    # and `nbytes` are of the quantized tensors the engines serve, not of the trainer's
    quantization: str | None = None
    # a LoRA adapter push (`push(..., adapter=...)`): the adapter's shape, scale and base;
    # `fingerprint` is what the engines serve (`weightbus.core.wire.adapter.served_fingerprint`)
    adapter: AdapterSpec | None = None
