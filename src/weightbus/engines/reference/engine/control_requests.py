"""Rank 0's control requests besides updates: pausing generation, memory, transport set-up.

`ControlRequests` is mixed into `UpdateController`, whose state it reads and changes (the
pending update, the status, `released`, `paused`) and whose replies it uses (`_reply_control`,
`publish_state`); what each request does at a step boundary is decided in
`UpdateController.next_action`.
"""

from weightbus.core.wire import RankVerdict
from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.actions import mask_to_tags
from weightbus.engines.reference.engine.pending_update import failure
from weightbus.engines.reference.engine.transport_setup import SetupOrder


class ControlRequests:
    """Pause/continue, release/resume and transport set-up requests of `UpdateController`."""

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
        if self._placing is not None:
            self._reply_control(control.request_id, 409, "an expert re-placement is in progress")
            return
        self._release = control
        self.status = "CLEARING"
        self.publish_state()

    def _on_resume(self, control: messages.Control) -> None:
        if self._release is not None or self._resume is not None:
            self._reply_control(control.request_id, 409, "a memory release is in progress")
            return
        self._resume = control

    def on_transport_setup(self, message: messages.TransportSetup, tp_size: int) -> None:
        """Accept a transport set-up for the next step boundary, or answer 409/400 at once."""
        if self._update is not None:
            self._reply_control(message.request_id, 409, "an update is in progress")
            return
        if self._setup is not None:
            busy = f"another {self._setup.request.change} is in progress"
            self._reply_control(message.request_id, 409, busy)
            return
        if self._placing is not None:
            busy = "an expert re-placement is in progress"
            self._reply_control(message.request_id, 409, busy)
            return
        try:
            order = SetupOrder.decode(message)
        except ValueError as exc:
            self._reply_control(message.request_id, 400, str(exc))
            return
        refusal = order.request.refusal(tp_size)
        if refusal is not None:
            self._reply_control(message.request_id, 400, refusal)
            return
        self._setup = order

    def on_transport_setup_done(self, order: SetupOrder, verdicts: list[RankVerdict]) -> None:
        """Every rank ran the transport set-up; answer with the combined outcome."""
        self._setup, self._setup_started = None, False
        if not all(v.ok for v in verdicts):
            status, error, _ = failure(verdicts)
            self._reply_control(order.message.request_id, status, error)
            return
        message = order.request.done_message(len(verdicts))
        self._reply_control(order.message.request_id, 200, message)

    def on_released(self, mask: int) -> None:
        assert self._release is not None
        tags = mask_to_tags(mask)
        self.released.update(tags)
        if "weights" in tags:
            self.weights_valid = False
            self.rollback.drop("the weights memory was released")
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
