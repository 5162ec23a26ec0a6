"""Expert routes of a mixture-of-experts engine: `GET /v1/experts` (the live expert map) and
`POST /v1/experts/place` (move the experts to another map, as vLLM's EPLB re-places them).

The map asked for is checked here against the live one (`expert_placement.requested_map`: 400
naming the field and what is wrong), then sent to rank 0 as a `PlaceExperts`. Rank 0 refuses it
(409 naming the live map) while a push, a transport set-up, a rollback or a memory release is
in flight; otherwise every rank moves its experts at the next step boundary. Rank 0 sends the
new slice maps (`LayoutChanged`) before its answer, so the answer, `GET /v1/experts` and
`GET /v1/weights/layout` after it show the new map.
"""

import logging
import secrets

from fastapi import APIRouter, Request

from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.expert_placement import PlacementError, requested_map
from weightbus.engines.reference.engine.expert_requests import NO_EXPERTS
from weightbus.engines.reference.server.admin import AdminConfig, control_answer
from weightbus.engines.reference.server.engine_client import EngineClient
from weightbus.engines.reference.server.errors import APIError
from weightbus.engines.reference.server.protocol import (
    ExpertsResponse,
    PlaceExpertsRequest,
    error_responses,
)

logger = logging.getLogger(__name__)


def experts_response(info: messages.ExpertsInfo) -> ExpertsResponse:
    """The JSON form of rank 0's `ExpertsInfo`."""
    return ExpertsResponse(
        expert_map=info.expert_map,
        hash=info.hash,
        placement=info.placement,
        redundant_experts=info.redundant_experts,
        num_experts=info.num_experts,
    )


def _live_experts(request: Request, status_code: int) -> messages.ExpertsInfo:
    """The client's mirror of the live expert map.

    Raises:
        APIError: `status_code` on a dense model.
    """
    client: EngineClient = request.app.state.client
    if client.experts is None:
        raise APIError(status_code, NO_EXPERTS)
    return client.experts


async def place_experts(
    body: PlaceExpertsRequest, request: Request, config: AdminConfig
) -> ExpertsResponse:
    """`POST /v1/experts/place`: move the experts to the map asked for.

    Returns:
        The live expert map once every rank moved its experts.

    Raises:
        APIError: 400 on a dense model or a map that does not fit (its field named), rank 0's
            409 while the weights are busy (naming the live map), or 503/504 when the engine
            died or did not answer.
    """
    live = _live_experts(request, 400)
    try:
        wanted = requested_map(live, expert_map=body.expert_map, placement=body.placement)
    except PlacementError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    message = messages.PlaceExperts(
        request_id=secrets.token_hex(16), expert_map=[list(row) for row in wanted.slots]
    )
    logger.info("expert re-placement %s to %s", message.request_id, wanted.describe())
    await control_answer(request, message, config.control_timeout_s, "the re-placement failed")
    return experts_response(_live_experts(request, 500))


def add_expert_routes(router: APIRouter, config: AdminConfig) -> None:
    """`GET /v1/experts` and `POST /v1/experts/place` on `router` (behind the admin token)."""

    @router.get("/v1/experts", responses=error_responses(404))
    async def experts_route(request: Request) -> ExpertsResponse:
        return experts_response(_live_experts(request, 404))

    @router.post("/v1/experts/place", responses=error_responses(400, 409, 413, 422, 503, 504))
    async def place_experts_route(body: PlaceExpertsRequest, request: Request) -> ExpertsResponse:
        return await place_experts(body, request, config)
