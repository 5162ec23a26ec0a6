"""What a push (or a rollback) returns or raises, and the fleet's version."""

from collections.abc import Sequence
from dataclasses import dataclass, field

from weightbus.core.fixes import split_fixes
from weightbus.core.publisher.delta import DeltaReport
from weightbus.core.publisher.targets import EngineResult
from weightbus.core.wire.adapter import AdapterSpec


class PushError(RuntimeError):
    """One or more engines did not commit a push (or a rollback).

    The message counts and names the engines that failed on their own, then the publisher's
    failure, then the engines aborted only because of them, then one `fix: ...` line per fix
    the reasons name.

    Attributes:
        failures: engine URL -> reason (the aborted engines that failed too included).
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
        # an aborted engine's reason only repeats the others' (a whole fleet aborted: all)
        failed = {url: why for url, why in failures.items() if url not in self.aborted}
        failed = failed or failures
        fixes: list[str] = []
        parts, reasons = [], []
        for url, why in failed.items():
            reason, named = split_fixes(why)
            parts.append(f"{url}: {reason}")
            reasons.append(reason)
            fixes += named
        if transport_error:
            reason, named = split_fixes(transport_error)
            # a stream stopped by an engine's early answer repeats that answer: said once
            if not any(said in reason for said in reasons):
                parts.append(f"publisher: {reason}")
            fixes += named
        others = [url for url in self.aborted if url not in failed]
        if others:
            parts.append(f"aborted because of the others: {', '.join(others)}")
        action = action or f"push of version {version!r}"
        counted = f"{len(failed)} engine(s)"
        if others:
            counted += f" ({len(others)} more aborted because of it)"
        lines = [f"{action} failed on {counted}: {'; '.join(parts)}"]
        lines += [f"fix: {fix}" for fix in dict.fromkeys(fixes)]
        super().__init__("\n".join(lines))


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
