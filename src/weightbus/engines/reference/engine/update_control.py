"""Rank 0's weights state machine: versions, status, pause modes, and the action of each step.

Rank 0 owns the status `NORMAL | UPDATING | CLEARING | CLEARED | FAILED | WAITING`. Each step
the worker asks `next_action()` what every rank must do at this step boundary; the action
travels in the step header that rank 0 broadcasts anyway (no extra collective while NORMAL).
The worker then
reports back what happened (`on_staged`, `on_loaded`, `on_committed`, `on_released`, ...), and
the controller answers the API server (`UpdateResult`, `ControlResult`, `WeightsState`).

Two-phase updates (`UpdateWeights.two_phase`) and rollbacks follow `pending_update`: staged,
answered "staged", swapped on the caller's `Decide` (or on the fleet's peers' word when the
caller went silent: `peer_outcome`). `rollback.RollbackSlot` tracks the version the staging
memory still holds after a swap. Expert re-placements of a mixture-of-experts model follow
`expert_requests`.
"""

import logging
import time
from collections import deque
from collections.abc import Callable

from weightbus.core.wire import RankVerdict, UpdateOrder
from weightbus.core.wire.adapter import AdapterSpec
from weightbus.core.wire.delta import DELTA_BASE_REFUSAL, DeltaSpec
from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.actions import Action, StepAction, tags_to_mask
from weightbus.engines.reference.engine.control_requests import ControlRequests
from weightbus.engines.reference.engine.expert_requests import ExpertRequests
from weightbus.engines.reference.engine.peer_outcome import PeerOutcome
from weightbus.engines.reference.engine.pending_update import (
    PEER_RESOLUTION_S,
    PendingUpdate,
    failure,
    rank_nbytes,
)
from weightbus.engines.reference.engine.rollback import RollbackSlot
from weightbus.engines.reference.engine.transport_setup import SetupOrder
from weightbus.engines.reference.models.config import LoraShape

logger = logging.getLogger(__name__)

HISTORY_LENGTH = 32


# Ranks time out on their own; this margin only catches a rank whose receive never returns.
STAGED_GRACE_S = 5.0
_DRAIN_TIMEOUT = "timed out waiting for running requests to drain (pause_mode drain)"
_WAITING = (
    "waiting for its initial weights (started with --wait-for-initial-weights): push a version"
)


class UpdateController(ControlRequests, ExpertRequests, PeerOutcome):
    """Rank 0's view of the weights and of pending update/control requests.

    Args:
        version: the version loaded at start-up.
        fingerprint: its fingerprint.
        send: sends a message to the API server.
        abort: ends requests with `finish_reason: "abort"` and a reason; returns their ids.
        wait_for_initial_weights: serve nothing (status WAITING) until a version is pushed.
        draft_fingerprint: the draft model's fingerprint at start-up (None: no draft).
        lora: the adapters the engine serves (`--lora-rank`, `--lora-targets`; None: none).
        experts: the live expert map of a mixture-of-experts model (None: a dense model).
        on_new_weights: called as other weights serve (a commit, an in-place load, a
            rollback; a failed load that touched the weights) with the order's
            `keep_prefix_cache` and whether running requests recompute their KV
            (`running_kv`); the prefix cache of the old weights is dropped unless kept.
    """

    def __init__(
        self,
        *,
        version: str,
        fingerprint: str | None,
        send: Callable[[object], None],
        abort: Callable[[str, bool], None],
        wait_for_initial_weights: bool = False,
        draft_fingerprint: str | None = None,
        lora: LoraShape | None = None,
        experts: messages.ExpertsInfo | None = None,
        on_new_weights: Callable[..., None] | None = None,
    ) -> None:
        self.version = version
        self.step: int | None = None
        self.fingerprint = fingerprint
        self.draft = (
            None
            if draft_fingerprint is None
            else messages.DraftInfo(version=version, fingerprint=draft_fingerprint)
        )
        self.lora = lora
        self.adapter: messages.AdapterInfo | None = None
        self.history: deque[messages.HistoryEntry] = deque(maxlen=HISTORY_LENGTH)
        self.released: set[str] = set()
        self.waiting = wait_for_initial_weights
        self.weights_valid = not wait_for_initial_weights
        self.status: messages.WeightsStatus = self._resting_status()
        self.paused = False
        self.rollback = RollbackSlot()
        self.two_phase_aborts = 0
        self.rollbacks = 0
        self._serving = self._entry(seconds=0.0, nbytes=0)
        self._send = send
        self._abort = abort
        self._on_new_weights = on_new_weights
        self._update: PendingUpdate | None = None
        self._discard_staging = False  # an aborted staged receive ended: discard it next step
        # request ids of drain pauses awaiting their reply (several clients may ask at once)
        self._pause_drains: list[str] = []
        self._release: messages.Control | None = None
        self._resume: messages.Control | None = None
        # the transport set-up from acceptance until every rank ran it
        self._setup: SetupOrder | None = None
        self._setup_started = False
        self.experts = experts
        # the expert re-placement accepted, until every rank ran it (`ExpertRequests`)
        self._placing: messages.PlaceExperts | None = None

    # --- what the scheduler may do this step ---

    @property
    def updating(self) -> bool:
        return self._update is not None

    @property
    def setting_up(self) -> bool:
        return self._setup is not None

    @property
    def receiving_staged(self) -> bool:
        update = self._update
        return update is not None and update.begun and update.atomic and not update.staged_ok

    def acts_next_step(self, num_running: int) -> bool:
        """The update's next action is due at the next step: its ranks staged it (or a
        rollback began), no decision is awaited and the pause mode allows the swap with
        `num_running` sequences running. Rank 0 then takes that step at once."""
        update = self._update
        if update is None or not update.begun or not update.staged_ok:
            return False
        pause_allows = update.pause_mode != "drain" or num_running == 0
        return pause_allows and not update.awaiting_decision

    def may_run(self) -> bool:
        """Whether running sequences may take a step."""
        if self.paused or self.released or not self.weights_valid or self.status == "FAILED":
            return False
        update = self._update
        # in-place loading pauses the running sequences until the load is done
        return not (update and not update.atomic and update.pause_mode == "in_place")

    def may_admit(self) -> bool:
        """Whether waiting sequences may start."""
        if not self.may_run() or self._pause_drains or self._release:
            return False
        update = self._update
        if update is None or update.pause_mode != "drain":
            return True
        # drain: atomic updates keep admitting while they receive, and stop once staged
        return update.atomic and not update.staged_ok

    def blocked_reason(self) -> str | None:
        """Why new requests cannot be served at all right now, or None."""
        if self.released or self.status in ("CLEARING", "CLEARED"):
            return "memory released: resume memory (and push weights if they were released)"
        if self.waiting:
            return _WAITING
        if not self.weights_valid or self.status == "FAILED":
            return "weights failed to update: push a good version"
        return None

    # --- requests from the API server ---

    def on_update(self, request: messages.UpdateWeights) -> None:
        """Accept an update or answer 409 at once."""
        conflict = self._conflict(request)
        if conflict is not None:
            self._reply(request.update_id, 409, request.version, conflict)
            return
        self._accept(PendingUpdate.of_push(request))

    def _accept(self, update: PendingUpdate) -> None:
        self._update = update
        self.status = "UPDATING"
        logger.info(
            "%s to %s accepted (atomic=%s, two_phase=%s, pause_mode=%s)",
            "rollback" if update.is_rollback else "update",
            update.version,
            update.atomic,
            update.two_phase,
            update.pause_mode,
        )
        self.publish_state()

    def _busy(self) -> str | None:
        if self._update is not None:
            return f"an update to {self._update.version!r} is already running"
        if self.status == "CLEARING" or self._release is not None:
            return "a memory release is in progress"
        if self._setup is not None:
            return self._setup.request.busy
        if self._placing is not None:
            return "an expert re-placement is in progress"
        return None

    def _conflict(self, order: UpdateOrder) -> str | None:
        busy = self._busy()
        if busy is not None:
            return busy
        if order.two_phase and order.atomic and "weights" in self.released:
            return "the weights memory is released: resume it before a two-phase update"
        if order.version == self.version and self.weights_valid and not order.force:
            return f"version {order.version!r} is already being served (set force to re-push)"
        if order.step is not None and self.step is not None and order.step <= self.step:
            return f"step {order.step} is not above the current step {self.step}"
        if order.adapter is not None:
            return self._adapter_conflict(order.adapter, delta=order.delta is not None)
        return None if order.delta is None else self._delta_conflict(order.delta)

    @property
    def base_fingerprint(self) -> str | None:
        """The base model's fingerprint, whether an adapter applies or not."""
        return self.fingerprint if self.adapter is None else self.adapter.spec.base_fingerprint

    def _adapter_conflict(self, spec: AdapterSpec, *, delta: bool) -> str | None:
        """An adapter applies only onto the base it was trained on, with the rank and targets
        the engine holds adapters of, and goes whole."""
        if delta:
            return "an adapter push goes whole: it cannot be a delta"
        if self.lora is None:
            return "this engine serves no LoRA adapters: start it with --lora-rank"
        if spec.r != self.lora.rank or tuple(spec.target_modules) != self.lora.targets:
            return (
                f"the adapter is {spec.describe()}; this engine serves adapters of "
                f"{self.lora.describe()} (--lora-rank, --lora-targets)"
            )
        if not self.weights_valid or self.status == "FAILED" or "weights" in self.released:
            return "an adapter cannot apply: this engine serves no valid base weights"
        if spec.base_fingerprint != self.base_fingerprint:
            return (
                f"adapter base {spec.base_fingerprint} is not served here: this engine serves "
                f"base {self.base_fingerprint} (version {self.version!r})"
            )
        return None

    def _delta_conflict(self, delta: DeltaSpec) -> str | None:
        """A delta applies only onto the exact version it was computed from."""
        base = f"{DELTA_BASE_REFUSAL} {delta.base_version!r} ({delta.base_fingerprint})"
        if not self.weights_valid or self.status == "FAILED" or "weights" in self.released:
            return f"{base} cannot apply: this engine serves no valid weights"
        if delta.base_fingerprint != self.fingerprint:
            served = f"{self.version!r} ({self.fingerprint})"
            return f"{base} is not served here: this engine serves {served}"
        live = None if self.experts is None else self.experts.hash
        if delta.expert_map is not None and delta.expert_map != live:
            return (
                f"{base} was encoded for expert map {delta.expert_map}: this engine's experts "
                f"are placed as {live} now"
            )
        return None

    # --- the action of this step ---

    def next_action(self, num_running: int) -> StepAction:
        """Decide what every rank does at this step boundary (rank 0 calls this once a step)."""
        if self._pause_drains and num_running == 0:
            self.paused = True
            self.publish_state()
            for request_id in self._pause_drains:
                self._reply_control(request_id, 200, "generation paused (drain)")
            self._pause_drains.clear()
        first = self._first_action()
        if first is not None:
            return first
        if self._setup is not None and self._update is None:
            return self._setup_action(self._setup)
        if self._resume is not None:
            mask = tags_to_mask(self._resume.tags)
            return StepAction(Action.RESUME, tags_mask=mask)
        if self._release is not None and num_running == 0:
            self._abort("memory released", False)
            return StepAction(Action.RELEASE, tags_mask=tags_to_mask(self._release.tags))
        if self._update is not None:
            return self._update_action(self._update, num_running)
        return StepAction()

    def _first_action(self) -> StepAction | None:
        """What runs before anything else: the discard of an aborted staged receive, then an
        expert re-placement (accepted only while nothing else moves the weights)."""
        if self._discard_staging:
            self._discard_staging = False
            return StepAction(Action.ABORT)
        if self._placing is not None:
            return self._placement_action(self._placing)
        return None

    def _setup_action(self, order: SetupOrder) -> StepAction:
        if self._setup_started:  # the ranks run it in the background; generation goes on
            return StepAction(Action.SETUP_POLL)
        self._setup_started = True
        return StepAction(Action.TRANSPORT_SETUP, payload=messages.encode(order.message))

    def _update_action(self, update: PendingUpdate, num_running: int) -> StepAction:
        if not update.begun:
            if update.abort_reason is not None:
                self._finish_update(409, f"aborted: {update.abort_reason}", [])
                return StepAction()
            update.begun = True
            if update.is_rollback:
                return self._staged_action(update, num_running)
            assert update.request is not None
            # staging protects the serving version; with nothing valid serving a one-phase
            # update loads in place (a two-phase one still stages: it must wait for the decision)
            valid = self.weights_valid or update.two_phase
            if update.atomic and valid and "weights" not in self.released:
                self.rollback.drop(f"a push of {update.version!r} began staging into its memory")
                return StepAction(Action.BEGIN_STAGED, payload=messages.encode(update.request))
            update.atomic = False
        if update.atomic:
            return self._staged_action(update, num_running)
        if self._pause_satisfied(update, num_running):
            self.rollback.drop(f"an in-place push of {update.version!r} replaced the live weights")
            assert update.request is not None
            update.swap_ordered_at = time.perf_counter()
            return StepAction(Action.LOAD, payload=messages.encode(update.request))
        if update.expired(time.perf_counter()):
            self._finish_update(504, _DRAIN_TIMEOUT, [])
        return StepAction()

    def _staged_action(self, update: PendingUpdate, num_running: int) -> StepAction:
        now = time.perf_counter()
        if not update.staged_ok:
            return self._receiving_action(update, now)
        if update.awaiting_decision:
            return self._awaiting_action(update, now)
        if self._pause_satisfied(update, num_running):
            if update.two_phase and update.prepared_at is None:
                self._answer_staged(update, now)
                return StepAction()
            update.swap_ordered_at = now
            return StepAction(Action.ROLLBACK if update.is_rollback else Action.COMMIT)
        if update.expired(now):
            self._finish_update(504, _DRAIN_TIMEOUT, [], reply_to=update.commit_id)
            return self._discard_action(update)
        return StepAction()

    def _awaiting_action(self, update: PendingUpdate, now: float) -> StepAction:
        if not update.expired(now):
            return StepAction()
        silent = f"no decision within {update.timeout_s} s"
        if update.settling_at is None:
            if not update.peers:
                return self._discard_two_phase(update, silent)
            self.settle_with_peers(update, now)
        elif now - update.settling_at > PEER_RESOLUTION_S:
            peers = f", nor from the fleet's peers within {PEER_RESOLUTION_S} s"
            return self._discard_two_phase(update, silent + peers)
        return StepAction()

    def _receiving_action(self, update: PendingUpdate, now: float) -> StepAction:
        elapsed_s = now - update.started_at
        if elapsed_s > update.timeout_s + STAGED_GRACE_S:
            self._finish_update(504, f"update timed out after {elapsed_s:.1f} s", [])
            return StepAction(Action.ABORT)
        return StepAction(Action.POLL)

    @staticmethod
    def _discard_action(update: PendingUpdate) -> StepAction:
        # a rollback's staging still holds the previous version: nothing to discard
        return StepAction() if update.is_rollback else StepAction(Action.ABORT)

    def _pause_satisfied(self, update: PendingUpdate, num_running: int) -> bool:
        mode = update.pause_mode
        if mode == "abort" and num_running:
            self._abort(f"weights update to {update.version!r} (pause_mode abort)", False)
            return True
        return mode != "drain" or num_running == 0

    # --- two-phase decisions and rollbacks ---

    def on_rollback(self, request: messages.Rollback) -> None:
        """Accept a rollback to the version the staging memory holds, or answer 409 at once."""
        refusal = self._busy() or self.rollback.refusal(request.version, request.fingerprint)
        if refusal is None and "weights" in self.released:
            refusal = "the weights memory is released"
        if refusal is not None:
            self._reply(request.update_id, 409, request.version or self.version, refusal)
            return
        assert self.rollback.previous is not None
        self._accept(PendingUpdate.of_rollback(request, self.rollback.previous))

    def on_decide(self, decision: messages.Decide) -> None:
        """Commit or abort the two-phase update of `decision.version`."""
        update = self._update
        if update is None or update.version != decision.version or not update.two_phase:
            pending = f"; pending: {update.version!r}" if update is not None else ""
            error = f"no two-phase update of version {decision.version!r} is pending{pending}"
            self._reply(decision.request_id, 409, decision.version, error)
            return
        if decision.decision == "abort":
            self._on_abort_decision(update, decision)
            return
        error = None
        if not update.awaiting_decision:
            error = (
                f"version {update.version!r} is not staged yet"
                if update.commit_id is None
                else (f"a commit of version {update.version!r} is already running")
            )
        elif update.fenced and not decision.by_peers:
            error = (
                f"version {update.version!r} is being resolved with the fleet's peers (no "
                f"decision came within {update.timeout_s} s): its outcome is theirs now"
            )
        elif decision.fingerprint not in (None, self._staged_fingerprint(update)):
            error = (
                f"staged fingerprint {self._staged_fingerprint(update)} != "
                f"{decision.fingerprint} named by the commit"
            )
        if error is not None:
            self._reply(decision.request_id, 409, decision.version, error)
            return
        update.commit_id, update.decided_at = decision.request_id, time.perf_counter()

    def _on_abort_decision(self, update: PendingUpdate, decision: messages.Decide) -> None:
        reason = decision.reason or "aborted by the caller"
        if update.commit_id is not None:
            error = f"version {update.version!r} is already being committed"
            self._reply(decision.request_id, 409, decision.version, error)
            return
        if update.awaiting_decision:
            if self._discard_two_phase(update, reason).action == Action.ABORT:
                self._discard_staging = True
            message = f"discarded staged version {update.version!r}"
        else:  # still receiving: discarded when the receive ends
            update.abort_reason = reason
            message = f"version {update.version!r} will be discarded when its receive ends"
        self._send(
            messages.UpdateResult(
                update_id=decision.request_id,
                status_code=200,
                version=update.version,
                error=message,
            )
        )

    def _discard_two_phase(self, update: PendingUpdate, reason: str) -> StepAction:
        """Drop a staged two-phase update that will not be committed."""
        self.two_phase_aborts += 1
        logger.warning("two-phase update to %s discarded: %s", update.version, reason)
        self._update = None
        self.status = self._resting_status()
        self.publish_state()
        return self._discard_action(update)

    def _answer_staged(self, update: PendingUpdate, now: float) -> None:
        update.prepared_at = now
        self.publish_state()
        self._send(
            messages.UpdateResult(
                update_id=update.update_id,
                status_code=200,
                version=update.version,
                fingerprint=self._staged_fingerprint(update),
                nbytes=update.nbytes,
                rank_nbytes=list(update.rank_nbytes),
                seconds=now - update.started_at,
                phases=dict(update.phases),
                engine_phases=update.engine_phases(now),
                staged=True,
            )
        )

    @staticmethod
    def _staged_fingerprint(update: PendingUpdate) -> str | None:
        if update.verdicts is not None:
            return update.served_fingerprint(update.verdicts[0].fingerprint)
        return update.fingerprint

    # --- outcomes reported by the worker ---

    def on_staged(
        self,
        verdicts: list[RankVerdict],
        nbytes: int,
        phases: dict,
        draft: messages.DraftInfo | None = None,
    ) -> None:
        """Every rank finished its staged receive (`draft`: the draft it carried, if any)."""
        update = self._received(verdicts, nbytes, phases, draft)
        ok = all(v.ok for v in verdicts)
        if ok and update.abort_reason is None:
            update.verdicts = verdicts
            return
        if ok:  # the caller aborted it while it was received
            self._discard_staging = True
            self.two_phase_aborts += 1
            self._finish_update(409, f"aborted: {update.abort_reason}", [])
            return
        status, error, names = failure(verdicts)
        self._finish_update(status, error, names)

    def _received(
        self,
        verdicts: list[RankVerdict],
        nbytes: int,
        phases: dict,
        draft: messages.DraftInfo | None,
    ) -> PendingUpdate:
        """Record what the ranks received: bytes, timings, and the draft served once the update
        commits (the one it carried, else the one served now)."""
        update = self._update
        assert update is not None
        update.nbytes, update.phases = nbytes, phases
        update.received_at = time.perf_counter()
        update.rank_nbytes = rank_nbytes(verdicts)
        update.draft = draft or self.draft
        update.adapter = update.adapter_after(verdicts[0].fingerprint)
        return update

    def on_committed(self) -> None:
        """Every rank swapped the staged version in (a push's or a rollback's)."""
        update = self._update
        assert update is not None
        update.committed_at = time.perf_counter()
        replaced = self._serving if self.weights_valid else None
        # the state `_commit` publishes says what the staging memory now holds
        if update.is_rollback:
            self.rollbacks += 1
            self.rollback.drop(
                f"version {update.version!r} was restored by a rollback from "
                f"{self.version!r}; a rollback does not undo another"
            )
        elif replaced is not None:
            self.rollback.hold(replaced)
        else:
            self.rollback.drop("the weights it replaced were not valid")
        self._commit(update, self._staged_fingerprint(update))

    def on_loaded(
        self,
        verdicts: list[RankVerdict],
        nbytes: int,
        phases: dict,
        draft: messages.DraftInfo | None = None,
    ) -> None:
        """Every rank finished loading in place (`draft`: as for `on_staged`)."""
        update = self._received(verdicts, nbytes, phases, draft)
        if all(v.ok for v in verdicts):
            update.committed_at = update.received_at
            self._commit(update, update.served_fingerprint(verdicts[0].fingerprint))
            return
        status, error, names = failure(verdicts)
        if any(v.touched for v in verdicts):
            # the live weights are half-written: fail closed until a good update lands
            self.weights_valid = False
            self._new_weights(None, kept=False)
            self._abort(f"weights update to {update.version!r} failed", True)
        # else the checks refused the stream before a byte was written: the old weights serve
        self._finish_update(status, error, names)

    def _entry(self, *, seconds: float, nbytes: int) -> messages.HistoryEntry:
        return messages.HistoryEntry(
            version=self.version,
            step=self.step,
            fingerprint=self.fingerprint,
            committed_at=time.time(),
            seconds=seconds,
            nbytes=nbytes,
            draft=self.draft,
            adapter=self.adapter,
        )

    def _new_weights(self, update: PendingUpdate | None, *, kept: bool) -> None:
        """Tell the worker that other weights serve (prefix cache, running requests' KV)."""
        if self._on_new_weights is None:
            return
        request = None if update is None else update.request
        recompute = (
            request is not None
            and request.pause_mode == "in_place"
            and request.running_kv == "recompute"
        )
        self._on_new_weights(keep_prefix_cache=kept, recompute_running=recompute)

    def _commit(self, update: PendingUpdate, fingerprint: str | None) -> None:
        seconds = time.perf_counter() - update.started_at
        keep = update.request is not None and update.request.keep_prefix_cache
        self._new_weights(update, kept=keep)
        self.version, self.step, self.fingerprint = update.version, update.step, fingerprint
        self.draft, self.adapter = update.draft, update.adapter
        self.weights_valid, self.waiting = True, False
        self._serving = self._entry(seconds=seconds, nbytes=update.nbytes)
        self.history.append(self._serving)
        logger.info("committed version %s in %.3f s", self.version, seconds)
        self._update = None
        self.status = self._resting_status()
        self.publish_state()
        self._send(
            messages.UpdateResult(
                update_id=update.commit_id or update.update_id,
                status_code=200,
                version=self.version,
                fingerprint=self.fingerprint,
                nbytes=update.nbytes,
                rank_nbytes=list(update.rank_nbytes),
                seconds=seconds,
                phases={**update.phases, "total_s": seconds},
                engine_phases=update.engine_phases(time.perf_counter()),
                draft=self.draft,
            )
        )

    def _finish_update(
        self, status_code: int, error: str, names: list[str], reply_to: str | None = None
    ) -> None:
        update = self._update
        assert update is not None
        self._update = None
        self.status = self._resting_status()
        logger.warning("update to %s failed (%d): %s", update.version, status_code, error)
        self.publish_state()
        self._reply(reply_to or update.update_id, status_code, update.version, error, names)

    def _resting_status(self) -> messages.WeightsStatus:
        if self.released:
            return "CLEARED"
        if self.waiting:
            return "WAITING"
        return "NORMAL" if self.weights_valid else "FAILED"

    # --- messages to the API server ---

    def state(self) -> messages.WeightsState:
        update = self._update
        staged = update.version if update is not None and update.awaiting_decision else None
        return messages.WeightsState(
            version=self.version,
            step=self.step,
            status=self.status,
            fingerprint=self.fingerprint,
            generation="paused" if self.paused else "running",
            released=sorted(self.released),
            history=list(self.history),
            rollback=self.rollback.previous,
            rollback_unavailable=self.rollback.unavailable,
            staged_version=staged,
            two_phase_aborts=self.two_phase_aborts,
            rollbacks=self.rollbacks,
            draft=self.draft,
            adapter=self.adapter,
            base_fingerprint=self.base_fingerprint,
        )

    def publish_state(self) -> None:
        self._send(self.state())

    def _reply(
        self,
        update_id: str,
        status_code: int,
        version: str,
        error: str,
        names: list[str] | None = None,
    ) -> None:
        self._send(
            messages.UpdateResult(
                update_id=update_id,
                status_code=status_code,
                version=version,
                error=error,
                names=names or [],
            )
        )

    def _reply_control(self, request_id: str, status_code: int, message: str) -> None:
        self._send(
            messages.ControlResult(request_id=request_id, status_code=status_code, message=message)
        )
