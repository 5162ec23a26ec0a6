"""An accepted update (or rollback) on rank 0, from acceptance until it commits or fails.

A push and a rollback follow one life: accepted, staged (a push receives into the staging
memory; a rollback finds it there already), then swapped in at a step boundary the pause mode
allows. A two-phase one stops after staging: rank 0 answers "staged" and swaps only on the
caller's commit (`Decide`), or discards on its abort or when the decision does not come within
the update's `timeout_s`. A push that names the fleet's `peers` then asks the API server to learn
the outcome from them (`server/peers.py`) and waits `PEER_RESOLUTION_S` more for its word
before it discards alone.
"""

import time
from dataclasses import dataclass, field

from weightbus.core.wire import PauseMode, RankVerdict
from weightbus.core.wire.adapter import served_fingerprint
from weightbus.core.wire.phases import EnginePhases
from weightbus.engines.reference.engine import messages

# How long a staged update with peers waits, after its own `timeout_s`, for the API server to
# learn the outcome from the fleet's peers and decide (the server asks them for less:
# `server.peers.RESOLUTION_S`).
PEER_RESOLUTION_S = 20.0


@dataclass(slots=True, kw_only=True)
class PendingUpdate:
    """What rank 0 tracks of one update.

    Attributes:
        request: the push (None for a rollback: the staging memory already holds the version).
        atomic: stage then swap (False: load into the live weights).
        fingerprint: a rollback's target, known upfront (a push's comes from the verdicts).
        verdicts: every rank's verdict once all ranks staged (atomic, before the swap).
        prepared_at: when a two-phase update answered "staged".
        commit_id: the request id of the commit order, once it came.
        abort_reason: why the caller aborted it before it was staged.
        peers: the fleet's other engines (a two-phase push): asked before it discards.
        fenced: a peer (or this engine's server) asked for its outcome while it waited for
            the decision: only a decision of the peers commits it from then on.
        settling_at: when rank 0 asked its server to settle it with the peers.
        received_at: when every rank's receive had ended (their verdicts in).
        swap_ordered_at: when the pause mode let the swap (or the in-place load) go.
        committed_at: when every rank had swapped it in (or loaded it in place).
    """

    update_id: str
    version: str
    step: int | None
    pause_mode: PauseMode
    timeout_s: float
    atomic: bool
    two_phase: bool
    request: messages.UpdateWeights | None
    fingerprint: str | None = None
    draft: messages.DraftInfo | None = None  # a rollback's, known upfront; a push's once verified
    adapter: messages.AdapterInfo | None = None  # as `draft`: the adapter applied once committed
    started_at: float = field(default_factory=time.perf_counter)
    begun: bool = False  # BEGIN_STAGED or LOAD sent
    verdicts: list[RankVerdict] | None = None
    prepared_at: float | None = None
    commit_id: str | None = None
    decided_at: float = 0.0
    abort_reason: str | None = None
    peers: list[str] = field(default_factory=list)
    fenced: bool = False
    settling_at: float | None = None
    nbytes: int = 0
    rank_nbytes: list[int] = field(default_factory=list)  # by rank, from the verdicts
    phases: dict[str, float] = field(default_factory=dict)
    received_at: float | None = None
    swap_ordered_at: float | None = None
    committed_at: float | None = None

    @classmethod
    def of_push(cls, request: messages.UpdateWeights) -> "PendingUpdate":
        return cls(
            update_id=request.update_id,
            version=request.version,
            step=request.step,
            pause_mode=request.pause_mode,
            timeout_s=request.timeout_s,
            atomic=request.atomic,
            two_phase=request.two_phase and request.atomic,
            request=request,
            peers=list(request.peers) if request.two_phase and request.atomic else [],
        )

    @classmethod
    def of_rollback(
        cls, request: messages.Rollback, previous: messages.HistoryEntry
    ) -> "PendingUpdate":
        return cls(
            update_id=request.update_id,
            version=previous.version,
            step=previous.step,
            pause_mode=request.pause_mode,
            timeout_s=request.timeout_s,
            atomic=True,
            two_phase=request.two_phase,
            request=None,
            fingerprint=previous.fingerprint,
            draft=previous.draft,
            adapter=previous.adapter,
        )

    def served_fingerprint(self, received: str | None) -> str | None:
        """What the engine serves once this push commits, from the fingerprint of what the
        ranks `received`: the same, but for an adapter push (base and adapter as one)."""
        spec = None if self.request is None else self.request.adapter
        if spec is None or received is None:
            return received
        return served_fingerprint(spec, received)

    def adapter_after(self, received: str | None) -> messages.AdapterInfo | None:
        """The adapter applied once this push commits: the one it carried (None when it
        removes it, or a push of the base: the adapter belonged to the base it replaces)."""
        spec = None if self.request is None else self.request.adapter
        if spec is None or not spec.active or received is None:
            return None
        return messages.AdapterInfo(version=self.version, fingerprint=received, spec=spec)

    @property
    def is_rollback(self) -> bool:
        return self.request is None

    @property
    def staged_ok(self) -> bool:
        """Every rank staged and verified the version (a rollback: at once)."""
        return self.is_rollback or self.verdicts is not None

    @property
    def awaiting_decision(self) -> bool:
        """A two-phase update answered "staged" and waits for its commit or abort."""
        return self.prepared_at is not None and self.commit_id is None

    def engine_phases(self, answered_at: float) -> EnginePhases:
        """This update's phases (`EnginePhases`) for an answer leaving at `answered_at`: a
        staged answer has only verified; a commit paused, swapped and resumed."""
        verify_s = self.phases.get("tail_s", 0.0)
        if self.swap_ordered_at is None or self.committed_at is None:
            return EnginePhases(verify_s=verify_s)
        if not self.atomic:  # paused before the load, which was the receive
            pause_s = self.swap_ordered_at - self.started_at
            return EnginePhases(
                verify_s=verify_s,
                pause_s=max(0.0, pause_s),
                resume_s=max(0.0, answered_at - self.committed_at),
                paused_first=True,
            )
        # the pause starts once the version is staged, or at the commit order (two-phase)
        paused_from = self.decided_at or self.received_at or self.started_at
        return EnginePhases(
            verify_s=0.0 if self.two_phase else verify_s,  # answered with the staged one
            pause_s=max(0.0, self.swap_ordered_at - paused_from),
            commit_s=max(0.0, self.committed_at - self.swap_ordered_at),
            resume_s=max(0.0, answered_at - self.committed_at),
        )

    def expired(self, now: float) -> bool:
        """The update's `timeout_s` ran out: since it was accepted, since it answered "staged"
        (waiting for the decision), or since the commit order (waiting for the pause mode)."""
        since = self.decided_at or self.prepared_at or self.started_at
        return now - since > self.timeout_s


def failure(verdicts: list[RankVerdict]) -> tuple[int, str, list[str]]:
    """The status, error and offending tensors of failed verdicts."""
    errors = [f"rank {v.rank}: {e}" for v in verdicts for e in v.errors]
    names = sorted({n for v in verdicts for n in v.names})
    status = 504 if any(v.timed_out for v in verdicts) else 400
    return status, "; ".join(errors) or "update failed", names


def rank_nbytes(verdicts: list[RankVerdict]) -> list[int]:
    """The bytes that reached each rank through the transport, in rank order."""
    return [v.nbytes for v in sorted(verdicts, key=lambda v: v.rank)]
