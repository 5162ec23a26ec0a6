"""Rank 0's side of an expert re-placement (`PlaceExperts`, `POST /v1/experts/place`).

`ExpertRequests` is mixed into `UpdateController`, whose state it reads (the pending update,
the transport set-up, the memory release) and whose replies it uses (`_reply_control`,
`publish_state`). A re-placement is refused at once while anything else moves or frees the
weights (409 naming the live map); otherwise every rank runs it at the next step boundary
(`Action.PLACE_EXPERTS`, decided first in `UpdateController.next_action`) and rank 0 answers
once the ranks' outcomes are gathered (`on_experts_placed`), after sending the new slice maps
(`LayoutChanged`) that `GET /v1/weights/layout` serves.
"""

import logging

from weightbus.core.wire import RankVerdict
from weightbus.core.wire.messages import SliceSpec
from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.actions import Action, StepAction
from weightbus.engines.reference.engine.expert_placement import PlacementError, requested_map
from weightbus.engines.reference.engine.pending_update import failure

logger = logging.getLogger(__name__)

NO_EXPERTS = "this engine serves a dense model: it has no experts to place"


class ExpertRequests:
    """Expert re-placements of `UpdateController`: `experts` is the live map (None: a dense
    model), `_placing` the re-placement accepted for the next step boundary."""

    def on_place_experts(self, message: messages.PlaceExperts) -> None:
        """Accept a re-placement for the next step boundary, or answer 400/409 at once."""
        refusal = self._placement_refusal(message)
        if refusal is not None:
            self._reply_control(message.request_id, *refusal)
            return
        self._placing = message

    def _placement_refusal(self, message: messages.PlaceExperts) -> tuple[int, str] | None:
        if self.experts is None:
            return 400, NO_EXPERTS
        busy = self._placement_busy()
        if busy is not None:
            return 409, f"{busy}: the expert map stays {self.experts.hash}"
        try:
            requested_map(self.experts, expert_map=message.expert_map)
        except PlacementError as exc:
            return 400, str(exc)
        return None

    def _placement_busy(self) -> str | None:
        """Why the weights cannot move now: something else moves or frees them."""
        update = self._update
        if update is not None:
            what = "a rollback to" if update.is_rollback else "a push of"
            return f"{what} {update.version!r} is in flight"
        if self._setup is not None:
            return self._setup.request.busy
        if self._release is not None or self.status == "CLEARING":
            return "a memory release is in flight"
        if "weights" in self.released:
            return "the weights memory is released"
        if self._placing is not None:
            return "another expert re-placement is in flight"
        return None

    def _placement_action(self, message: messages.PlaceExperts) -> StepAction:
        return StepAction(Action.PLACE_EXPERTS, payload=messages.encode(message))

    def on_experts_placed(
        self,
        message: messages.PlaceExperts,
        verdicts: list[RankVerdict],
        rank_slices: list[list[SliceSpec]],
        live: messages.ExpertsInfo,
    ) -> None:
        """Every rank ran the re-placement (`live`: rank 0's map now): send the slice maps,
        then answer. A rank that failed after experts moved leaves the weights unserved until
        a push lands (ranks may hold other maps)."""
        self._placing = None
        self.experts = live
        self._send(messages.LayoutChanged(rank_slices=rank_slices, experts=live))
        if all(v.ok for v in verdicts):
            logger.info("experts placed: expert map %s (%s)", live.hash, live.placement)
            done = f"experts placed: the expert map is {live.hash} ({live.placement})"
            self._reply_control(message.request_id, 200, done)
            return
        status, error, _ = failure(verdicts)
        if any(v.touched for v in verdicts):
            self.weights_valid = False
            self.rollback.drop("an expert re-placement failed midway")
            self._abort("an expert re-placement failed midway", True)
            self.status = self._resting_status()
            self.publish_state()
            error += "; the weights are not served until a push lands"
            status = 500
        logger.warning("expert re-placement failed: %s", error)
        self._reply_control(message.request_id, status, f"expert re-placement failed: {error}")
