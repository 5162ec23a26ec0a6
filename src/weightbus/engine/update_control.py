"""Rank 0's weights state machine: versions, status, pause modes, and the action of each step.

Rank 0 owns the status `NORMAL | UPDATING | CLEARING | CLEARED | FAILED`. Each step the worker
asks `next_action()` what every rank must do at this step boundary; the action travels in the
step header that rank 0 broadcasts anyway (no extra collective while NORMAL). The worker then
reports back what happened (`on_staged`, `on_loaded`, `on_committed`, `on_released`, ...), and
the controller answers the API server (`UpdateResult`, `ControlResult`, `WeightsState`).
"""

import enum
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from weightbus.engine import messages
from weightbus.wire import RankVerdict

logger = logging.getLogger(__name__)

HISTORY_LENGTH = 32


class Action(enum.IntEnum):
    """What every rank does at a step boundary (sent in the step header)."""

    NONE = 0
    BEGIN_STAGED = 1  # start receiving into staging in the background (payload: the request)
    POLL = 2  # all-reduce "staged receive done / ok"; gather verdicts when all done
    COMMIT = 3  # swap staged weights in
    LOAD = 4  # receive into the live weights now (payload: the request)
    RELEASE = 5  # free memory (tags mask)
    RESUME = 6  # re-allocate memory (tags mask)
    ABORT = 7  # discard a staged receive that outlived its timeout
    WEIGHTS_GROUP = 8  # join or leave a `dist` weights group (payload: the request)


# Ranks time out on their own; this margin only catches a rank whose receive never returns.
STAGED_GRACE_S = 5.0
_DRAIN_TIMEOUT = "timed out waiting for running requests to drain (pause_mode drain)"


TAG_BITS = {"kv_cache": 1, "weights": 2}


def tags_to_mask(tags: list[str]) -> int:
    return sum(TAG_BITS[tag] for tag in set(tags))


def mask_to_tags(mask: int) -> list[str]:
    return [tag for tag, bit in TAG_BITS.items() if mask & bit]


@dataclass(slots=True)
class StepAction:
    action: Action = Action.NONE
    payload: bytes = b""
    tags_mask: int = 0


@dataclass(slots=True)
class _PendingUpdate:
    request: messages.UpdateWeights
    started_at: float = field(default_factory=time.perf_counter)
    begun: bool = False  # BEGIN_STAGED or LOAD sent
    verdicts: list[RankVerdict] | None = None  # all ranks done (atomic, before commit)
    nbytes: int = 0
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def staged(self) -> bool:
        return self.request.atomic


def _failure(verdicts: list[RankVerdict]) -> tuple[int, str, list[str]]:
    errors = [f"rank {v.rank}: {e}" for v in verdicts for e in v.errors]
    names = sorted({n for v in verdicts for n in v.names})
    status = 504 if any(v.timed_out for v in verdicts) else 400
    return status, "; ".join(errors) or "update failed", names


class UpdateController:
    """Rank 0's view of the weights and of pending update/control requests.

    Args:
        version: the version loaded at start-up.
        fingerprint: its fingerprint.
        send: sends a message to the API server.
        abort: ends requests with `finish_reason: "abort"` and a reason; returns their ids.
    """

    def __init__(
        self,
        *,
        version: str,
        fingerprint: str | None,
        send: Callable[[object], None],
        abort: Callable[[str, bool], None],
    ) -> None:
        self.version = version
        self.step: int | None = None
        self.fingerprint = fingerprint
        self.status: messages.WeightsStatus = "NORMAL"
        self.history: deque[messages.HistoryEntry] = deque(maxlen=HISTORY_LENGTH)
        self.released: set[str] = set()
        self.weights_valid = True
        self.paused = False
        self._send = send
        self._abort = abort
        self._update: _PendingUpdate | None = None
        # request ids of drain pauses awaiting their reply (several clients may ask at once)
        self._pause_drains: list[str] = []
        self._release: messages.Control | None = None
        self._resume: messages.Control | None = None
        self._group_request: messages.WeightsGroupRequest | None = None

    # --- what the scheduler may do this step ---

    @property
    def updating(self) -> bool:
        return self._update is not None

    @property
    def receiving_staged(self) -> bool:
        return self._update is not None and self._update.begun and self._update.staged

    def may_run(self) -> bool:
        """Whether running sequences may take a step."""
        if self.paused or self.released or not self.weights_valid or self.status == "FAILED":
            return False
        update = self._update
        # in-place loading pauses the running sequences until the load is done
        return not (update and not update.staged and update.request.pause_mode == "in_place")

    def may_admit(self) -> bool:
        """Whether waiting sequences may start."""
        if not self.may_run() or self._pause_drains or self._release:
            return False
        update = self._update
        if update is None or update.request.pause_mode != "drain":
            return True
        # drain: atomic updates keep admitting while they receive, and stop once staged
        return update.staged and update.verdicts is None

    def blocked_reason(self) -> str | None:
        """Why new requests cannot be served at all right now, or None."""
        if self.released or self.status in ("CLEARING", "CLEARED"):
            return "memory released: resume memory (and push weights if they were released)"
        if not self.weights_valid or self.status == "FAILED":
            return "weights failed to update: push a good version"
        return None

    # --- requests from the API server ---

    def on_update(self, request: messages.UpdateWeights) -> None:
        """Accept an update or answer 409 at once."""
        conflict = self._conflict(request)
        if conflict is not None:
            self._reply_update(request, 409, conflict)
            return
        self._update = _PendingUpdate(request)
        self.status = "UPDATING"
        logger.info(
            "update to %s accepted (atomic=%s, pause_mode=%s)",
            request.version,
            request.atomic,
            request.pause_mode,
        )
        self.publish_state()

    def _conflict(self, request: messages.UpdateWeights) -> str | None:
        if self._update is not None:
            return f"an update to {self._update.request.version!r} is already running"
        if self.status == "CLEARING" or self._release is not None:
            return "a memory release is in progress"
        if self._group_request is not None:
            return "a weights group is being initialised or destroyed"
        if request.version == self.version and self.weights_valid and not request.force:
            return f"version {request.version!r} is already being served (set force to re-push)"
        if request.step is not None and self.step is not None and request.step <= self.step:
            return f"step {request.step} is not above the current step {self.step}"
        return None

    def on_control(self, control: messages.Control) -> None:
        handler = {
            "pause": self._on_pause,
            "continue": self._on_continue,
            "release": self._on_release,
            "resume": self._on_resume,
        }[control.action]
        handler(control)

    def _on_pause(self, control: messages.Control) -> None:
        if control.mode == "abort":
            self._abort("generation paused (mode abort)", True)
        if control.mode == "drain":
            self._pause_drains.append(control.request_id)
            return
        if control.mode == "in_place":
            # frozen sequences never finish: a waiting drain would wait for ever
            self._cancel_drains("pause cancelled by pause_generation (in_place)")
        self.paused = True
        self.publish_state()
        self._reply_control(control.request_id, 200, f"generation paused ({control.mode})")

    def _on_continue(self, control: messages.Control) -> None:
        self.paused = False
        self.publish_state()
        self._cancel_drains("pause cancelled by continue_generation")
        self._reply_control(control.request_id, 200, "generation continues")

    def _cancel_drains(self, reason: str) -> None:
        for request_id in self._pause_drains:
            self._reply_control(request_id, 409, reason)
        self._pause_drains.clear()

    def _on_release(self, control: messages.Control) -> None:
        if self._update is not None or self._release is not None:
            self._reply_control(control.request_id, 409, "an update or release is in progress")
            return
        self._release = control
        self.status = "CLEARING"
        self.publish_state()

    def _on_resume(self, control: messages.Control) -> None:
        if self._release is not None or self._resume is not None:
            self._reply_control(control.request_id, 409, "a memory release is in progress")
            return
        self._resume = control

    def on_weights_group(self, request: messages.WeightsGroupRequest, tp_size: int) -> None:
        """Accept a weights-group change for the next step boundary, or answer 409/400 at once."""
        if self._update is not None or self._group_request is not None:
            busy = "an update" if self._update is not None else "another weights-group change"
            self._reply_control(request.request_id, 409, f"{busy} is in progress")
            return
        if request.action == "init" and request.rank_offset + tp_size > request.world_size:
            self._reply_control(
                request.request_id,
                400,
                f"rank_offset {request.rank_offset} + tp_size {tp_size} exceeds "
                f"world_size {request.world_size}",
            )
            return
        self._group_request = request

    def on_weights_group_done(
        self, request: messages.WeightsGroupRequest, verdicts: list[RankVerdict]
    ) -> None:
        """Every rank applied the weights-group change; answer with the combined outcome."""
        if not all(v.ok for v in verdicts):
            status, error, _ = _failure(verdicts)
            self._reply_control(request.request_id, status, error)
            return
        if request.action == "destroy":
            message = f"left weights group {request.group_name!r}"
        else:
            last = request.rank_offset + len(verdicts) - 1
            message = (
                f"joined weights group {request.group_name!r} as ranks "
                f"{request.rank_offset}..{last} of {request.world_size}"
            )
        self._reply_control(request.request_id, 200, message)

    # --- the action of this step ---

    def next_action(self, num_running: int) -> StepAction:
        """Decide what every rank does at this step boundary (rank 0 calls this once a step)."""
        if self._pause_drains and num_running == 0:
            self.paused = True
            self.publish_state()
            for request_id in self._pause_drains:
                self._reply_control(request_id, 200, "generation paused (drain)")
            self._pause_drains.clear()
        if self._group_request is not None and self._update is None:
            request, self._group_request = self._group_request, None
            return StepAction(Action.WEIGHTS_GROUP, payload=messages.encode(request))
        if self._resume is not None:
            mask = tags_to_mask(self._resume.tags)
            return StepAction(Action.RESUME, tags_mask=mask)
        if self._release is not None and num_running == 0:
            self._abort("memory released", False)
            return StepAction(Action.RELEASE, tags_mask=tags_to_mask(self._release.tags))
        if self._update is not None:
            return self._update_action(self._update, num_running)
        return StepAction()

    def _update_action(self, update: _PendingUpdate, num_running: int) -> StepAction:
        if not update.begun:
            if update.staged and self.weights_valid and "weights" not in self.released:
                update.begun = True
                return StepAction(Action.BEGIN_STAGED, payload=messages.encode(update.request))
            # nothing valid is serving: staging would protect nothing, load in place
            update.request = msgspec.structs.replace(update.request, atomic=False)
        if update.staged:
            return self._staged_action(update, num_running)
        if self._pause_satisfied(update, num_running):
            update.begun = True
            return StepAction(Action.LOAD, payload=messages.encode(update.request))
        if self._drain_expired(update):
            self._finish_update(504, _DRAIN_TIMEOUT, [])
        return StepAction()

    def _staged_action(self, update: _PendingUpdate, num_running: int) -> StepAction:
        if update.verdicts is None:
            elapsed_s = time.perf_counter() - update.started_at
            if elapsed_s > update.request.timeout_s + STAGED_GRACE_S:
                self._finish_update(504, f"update timed out after {elapsed_s:.1f} s", [])
                return StepAction(Action.ABORT)
            return StepAction(Action.POLL)
        if self._pause_satisfied(update, num_running):
            return StepAction(Action.COMMIT)
        if self._drain_expired(update):
            self._finish_update(504, _DRAIN_TIMEOUT, [])
            return StepAction(Action.ABORT)
        return StepAction()

    @staticmethod
    def _drain_expired(update: _PendingUpdate) -> bool:
        """The update's `timeout_s` covers waiting for running requests to drain."""
        return time.perf_counter() - update.started_at > update.request.timeout_s

    def _pause_satisfied(self, update: _PendingUpdate, num_running: int) -> bool:
        mode = update.request.pause_mode
        if mode == "abort" and num_running:
            self._abort(f"weights update to {update.request.version!r} (pause_mode abort)", False)
            return True
        return mode != "drain" or num_running == 0

    # --- outcomes reported by the worker ---

    def on_staged(self, verdicts: list[RankVerdict], nbytes: int, phases: dict) -> None:
        """Every rank finished its staged receive."""
        update = self._update
        assert update is not None
        update.nbytes, update.phases = nbytes, phases
        if all(v.ok for v in verdicts):
            update.verdicts = verdicts
            return
        status, error, names = _failure(verdicts)
        self._finish_update(status, error, names)

    def on_committed(self) -> None:
        update = self._update
        assert update is not None
        assert update.verdicts is not None
        self._commit(update, update.verdicts)

    def on_loaded(self, verdicts: list[RankVerdict], nbytes: int, phases: dict) -> None:
        """Every rank finished loading in place."""
        update = self._update
        assert update is not None
        update.nbytes, update.phases = nbytes, phases
        if all(v.ok for v in verdicts):
            self._commit(update, verdicts)
            return
        status, error, names = _failure(verdicts)
        if any(v.touched for v in verdicts):
            # the live weights are half-written: fail closed until a good update lands
            self.weights_valid = False
            self._abort(f"weights update to {update.request.version!r} failed", True)
        # else the checks refused the stream before a byte was written: the old weights serve
        self._finish_update(status, error, names)

    def _commit(self, update: _PendingUpdate, verdicts: list[RankVerdict]) -> None:
        request = update.request
        seconds = time.perf_counter() - update.started_at
        self.version, self.step = request.version, request.step
        self.fingerprint = verdicts[0].fingerprint
        self.weights_valid = True
        self.history.append(
            messages.HistoryEntry(
                version=self.version,
                step=self.step,
                fingerprint=self.fingerprint,
                committed_at=time.time(),
                seconds=seconds,
                nbytes=update.nbytes,
            )
        )
        logger.info("committed version %s in %.3f s", self.version, seconds)
        self._update = None
        self.status = self._resting_status()
        self.publish_state()
        self._send(
            messages.UpdateResult(
                update_id=request.update_id,
                status_code=200,
                version=self.version,
                fingerprint=self.fingerprint,
                nbytes=update.nbytes,
                seconds=seconds,
                phases={**update.phases, "total_s": seconds},
            )
        )

    def _finish_update(self, status_code: int, error: str, names: list[str]) -> None:
        update = self._update
        assert update is not None
        self._update = None
        self.status = self._resting_status()
        logger.warning("update to %s failed (%d): %s", update.request.version, status_code, error)
        self.publish_state()
        self._reply_update(update.request, status_code, error, names)

    def on_released(self, mask: int) -> None:
        assert self._release is not None
        tags = mask_to_tags(mask)
        self.released.update(tags)
        if "weights" in tags:
            self.weights_valid = False
        self.status = self._resting_status()
        self.publish_state()
        self._reply_control(self._release.request_id, 200, f"released {sorted(tags)}")
        self._release = None

    def on_resumed(self, mask: int) -> None:
        assert self._resume is not None
        self.released.difference_update(mask_to_tags(mask))
        self.status = self._resting_status()
        message = "resumed" if self.weights_valid else "resumed; push weights before generating"
        self.publish_state()
        self._reply_control(self._resume.request_id, 200, message)
        self._resume = None

    def _resting_status(self) -> messages.WeightsStatus:
        if self.released:
            return "CLEARED"
        return "NORMAL" if self.weights_valid else "FAILED"

    # --- messages to the API server ---

    def state(self) -> messages.WeightsState:
        return messages.WeightsState(
            version=self.version,
            step=self.step,
            status=self.status,
            fingerprint=self.fingerprint,
            generation="paused" if self.paused else "running",
            released=sorted(self.released),
            history=list(self.history),
        )

    def publish_state(self) -> None:
        self._send(self.state())

    def _reply_update(
        self,
        request: messages.UpdateWeights,
        status_code: int,
        error: str,
        names: list[str] | None = None,
    ) -> None:
        self._send(
            messages.UpdateResult(
                update_id=request.update_id,
                status_code=status_code,
                version=request.version,
                error=error,
                names=names or [],
            )
        )

    def _reply_control(self, request_id: str, status_code: int, message: str) -> None:
        self._send(
            messages.ControlResult(request_id=request_id, status_code=status_code, message=message)
        )
