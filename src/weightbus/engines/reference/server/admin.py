"""Admin routes: weight updates (one- or two-phase, rollback), the weights' state, any
transport's rank set-up (and `dist`'s under SGLang's names), pausing generation, releasing
memory.

Each action becomes one message to rank 0 with an id drawn here (`UpdateWeights.update_id`,
`Control.request_id`, 32 hex digits); the route awaits rank 0's result with that id through
`EngineClient` and answers with the status code rank 0 chose. Rank 0 sends the new
`WeightsState` before the result on the same ordered socket, so a `GET /v1/weights` that follows
an answer sees its change.
"""

import logging
import secrets
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Body, Request
from fastapi.responses import Response

from weightbus.core.transport import decode_setup_request
from weightbus.core.wire import PauseMode
from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.server.engine_client import EngineClient, EngineDeadError
from weightbus.engines.reference.server.errors import APIError
from weightbus.engines.reference.server.metrics import Metrics
from weightbus.engines.reference.server.peers import add_outcome_route
from weightbus.engines.reference.server.protocol import (
    AbortWeightsRequest,
    AdapterItem,
    CommitWeightsRequest,
    ContinueRequest,
    ControlAction,
    ControlResponse,
    DestroyWeightsGroupRequest,
    DraftItem,
    HistoryItem,
    InitWeightsGroupRequest,
    MemoryRequest,
    PauseRequest,
    RollbackWeightsRequest,
    ServerInfo,
    SetupTransportRequest,
    TeardownTransportRequest,
    TransportSetupResponse,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    WeightsInfo,
    error_responses,
)

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class AdminConfig:
    """Bounds of the admin routes.

    Attributes:
        update_margin_s: the wait for an update's result is its `timeout_s` plus this (rank 0
            answers 504 itself a few seconds after `timeout_s`; the Publisher waits 10 s more).
        control_timeout_s: bound of the wait for a control result (a drain pause waits for the
            running sequences, which `request_timeout_s` bounds).
    """

    update_margin_s: float
    control_timeout_s: float


# what an admin action may answer besides 200: rank 0's refusals and the server's own errors
_ACTION_ERRORS = error_responses(400, 409, 413, 422, 503, 504)


def _client(request: Request) -> EngineClient:
    return request.app.state.client


def _metrics(request: Request) -> Metrics:
    return request.app.state.metrics


def weights_info(state: messages.WeightsState) -> WeightsInfo:
    """The JSON form of a `WeightsState`.

    Args:
        state: rank 0's last report (the client's mirror).

    Returns:
        The `GET /v1/weights` answer (`nbytes` becomes `bytes`, as in update answers).
    """
    return WeightsInfo(
        version=state.version,
        step=state.step,
        status=state.status,
        fingerprint=state.fingerprint,
        generation=state.generation,
        released=list(state.released),
        history=[_history_item(entry) for entry in state.history],
        rollback=_history_item(state.rollback) if state.rollback is not None else None,
        rollback_unavailable=state.rollback_unavailable,
        staged_version=state.staged_version,
        waiting_for_initial_weights=state.status == "WAITING",
        two_phase_aborts=state.two_phase_aborts,
        rollbacks=state.rollbacks,
        draft=_draft_item(state.draft),
        adapter=_adapter_item(state.adapter),
        base_fingerprint=state.base_fingerprint,
    )


def _adapter_item(adapter: messages.AdapterInfo | None) -> AdapterItem | None:
    if adapter is None:
        return None
    spec = adapter.spec
    return AdapterItem(
        version=adapter.version,
        fingerprint=adapter.fingerprint,
        base_fingerprint=spec.base_fingerprint,
        r=spec.r,
        lora_alpha=spec.lora_alpha,
        use_rslora=spec.use_rslora,
        scaling=spec.scaling,
        target_modules=list(spec.target_modules),
    )


def _draft_item(draft: messages.DraftInfo | None) -> DraftItem | None:
    if draft is None:
        return None
    return DraftItem(
        version=draft.version,
        fingerprint=draft.fingerprint,
        bytes=draft.nbytes,
        max_chunk_bytes=draft.max_chunk_bytes,
        load_s=draft.load_s,
    )


def _history_item(entry: messages.HistoryEntry) -> HistoryItem:
    return HistoryItem(
        version=entry.version,
        step=entry.step,
        fingerprint=entry.fingerprint,
        committed_at=entry.committed_at,
        seconds=entry.seconds,
        bytes=entry.nbytes,
        draft=_draft_item(entry.draft),
        adapter=_adapter_item(entry.adapter),
    )


def _checked_status(status_code: int) -> int:
    # rank 0 chooses the status; anything but a success or an error would break the answer
    if status_code == 200 or 400 <= status_code <= 599:
        return status_code
    logger.error("rank 0 answered with status %d; reporting 500", status_code)
    return 500


async def _update(
    client: EngineClient,
    message: messages.UpdateWeights | messages.Rollback | messages.Decide,
    wait_s: float,
) -> messages.UpdateResult:
    try:
        return await client.update(message, timeout_s=wait_s)
    except EngineDeadError as exc:
        raise APIError(503, f"engine unavailable: {exc}", extra={"names": []}) from None
    except TimeoutError:
        raise APIError(
            504,
            f"no answer from the engine within {wait_s:.1f} s ({type(message).__name__})",
            extra={"names": []},
        ) from None


async def _answered(
    request: Request,
    message: messages.UpdateWeights | messages.Rollback | messages.Decide,
    wait_s: float,
) -> messages.UpdateResult:
    """Send `message` to rank 0; its 200 result, counted in the metrics when it committed.

    Raises:
        APIError: rank 0's error status with its message and `names`, or 503/504.
    """
    metrics = _metrics(request)
    try:
        result = await _update(_client(request), message, wait_s)
    except APIError as exc:
        metrics.observe_update(exc.status_code)
        raise
    status_code = _checked_status(result.status_code)
    if status_code != 200:
        metrics.observe_update(status_code)
        error = result.error or f"update to {result.version!r} failed"
        raise APIError(status_code, error, extra={"names": list(result.names)})
    aborted = isinstance(message, messages.Decide) and message.decision == "abort"
    if not (result.staged or aborted):  # a version was committed
        metrics.observe_update(200, nbytes=result.nbytes, seconds=result.seconds)
    return result


def _response(result: messages.UpdateResult) -> UpdateWeightsResponse:
    return UpdateWeightsResponse(
        version=result.version,
        fingerprint=result.fingerprint,
        bytes=result.nbytes,
        rank_bytes=list(result.rank_nbytes),
        seconds=result.seconds,
        phases=dict(result.phases),
        engine_phases=msgspec.to_builtins(result.engine_phases),
        staged=result.staged,
        draft=_draft_item(result.draft),
    )


async def update_weights(
    body: UpdateWeightsRequest, request: Request, config: AdminConfig
) -> UpdateWeightsResponse:
    """`POST /v1/update_weights`: send the update to rank 0 and answer with its result.

    Args:
        body: the validated request.
        request: the HTTP request (its app holds the client and the metrics).
        config: bounds of the wait.

    Returns:
        The committed version (or with `two_phase`, the staged one), its fingerprint, bytes,
        seconds and per-phase timings.

    Raises:
        APIError: rank 0's error status (400 with `names`, 409, 503, 504), or 503/504 when the
            engine died or did not answer in time.
    """
    fields = {**body.model_dump(), "update_id": secrets.token_hex(16)}
    message = msgspec.convert(fields, messages.UpdateWeights)  # the order as rank 0 holds it
    logger.info("update %s to %r via %s", message.update_id, body.version, body.transport)
    result = await _answered(request, message, body.timeout_s + config.update_margin_s)
    return _response(result)


async def commit_weights(
    body: CommitWeightsRequest, request: Request, config: AdminConfig
) -> UpdateWeightsResponse:
    """`POST /v1/commit_weights`: swap in the staged two-phase update (or rollback).

    Raises:
        APIError: 409 when no two-phase update of that version is staged (or its fingerprint
            differs), 504 when the pause mode did not allow the swap in time, 503/504 when the
            engine died or did not answer.
    """
    message = messages.Decide(
        request_id=secrets.token_hex(16),
        version=body.version,
        decision="commit",
        fingerprint=body.fingerprint,
        timeout_s=body.timeout_s,
    )
    result = await _answered(request, message, body.timeout_s + config.update_margin_s)
    return _response(result)


async def abort_weights(
    body: AbortWeightsRequest, request: Request, config: AdminConfig
) -> ControlResponse:
    """`POST /v1/abort_weights`: discard the two-phase update of a version (the engine keeps
    serving what it served).

    Raises:
        APIError: 409 when no two-phase update of that version is pending (or it is being
            committed), 503/504 when the engine died or did not answer.
    """
    message = messages.Decide(
        request_id=secrets.token_hex(16),
        version=body.version,
        decision="abort",
        reason=body.reason,
    )
    result = await _answered(request, message, config.control_timeout_s)
    return ControlResponse(action="abort_weights", message=result.error or "aborted")


async def rollback_weights(
    body: RollbackWeightsRequest, request: Request, config: AdminConfig
) -> UpdateWeightsResponse:
    """`POST /v1/rollback_weights`: swap back to the previous version (no bytes move).

    Raises:
        APIError: 409 naming why no rollback is possible (no previous version held, another
            one than expected, an update running), 504, or 503/504 when the engine died.
    """
    message = messages.Rollback(update_id=secrets.token_hex(16), **body.model_dump())
    result = await _answered(request, message, body.timeout_s + config.update_margin_s)
    return _response(result)


async def control(
    request: Request,
    config: AdminConfig,
    action: ControlAction,
    *,
    mode: PauseMode = "drain",
    tags: list[messages.MemoryTag] | None = None,
) -> ControlResponse:
    """Send one `Control` to rank 0 and answer with its `ControlResult`.

    Args:
        request: the HTTP request (its app holds the client).
        config: bounds of the wait.
        action: what rank 0 should do.
        mode: how to pause (`pause` only).
        tags: which memory (`release` / `resume` only).

    Returns:
        The action and rank 0's message.

    Raises:
        APIError: rank 0's error status and message, or 503/504 when the engine died or did
            not answer within `control_timeout_s`.
    """
    message = messages.Control(
        request_id=secrets.token_hex(16), action=action, mode=mode, tags=tags or []
    )
    failed = f"{message.action} failed"
    answer = await control_answer(request, message, config.control_timeout_s, failed)
    return ControlResponse(action=message.action, message=answer)


async def control_answer(
    request: Request,
    message: messages.Control | messages.TransportSetup | messages.PlaceExperts,
    wait_s: float,
    failed: str,
) -> str:
    """Send a message that rank 0 answers with a `ControlResult`; its message on a 200.

    Args:
        request: the HTTP request (its app holds the client).
        message: the message, with a fresh `request_id`.
        wait_s: bound of the wait for the answer.
        failed: the error message when rank 0 refuses without one.

    Raises:
        APIError: rank 0's error status and message, or 503/504 when the engine died or did
            not answer within `wait_s`.
    """
    try:
        result = await _client(request).control(message, timeout_s=wait_s)
    except EngineDeadError as exc:
        raise APIError(503, f"engine unavailable: {exc}") from None
    except TimeoutError:
        raise APIError(504, f"no answer from the engine within {wait_s:.1f} s") from None
    status_code = _checked_status(result.status_code)
    if status_code != 200:
        raise APIError(status_code, result.message or failed)
    return result.message


async def transport_setup(
    request: Request, config: AdminConfig, transport: str, setup_request: dict[str, Any]
) -> str:
    """Send one `TransportSetup` to rank 0 and answer with its `ControlResult`'s message.

    Args:
        request: the HTTP request (its app holds the client).
        config: bounds of the wait (the set-up request's own `wait_s()` plus `update_margin_s`).
        transport: a transport with rank set-up.
        setup_request: its set-up or tear-down request, validated (`decode_setup_request`).

    Returns:
        Rank 0's message.

    Raises:
        APIError: rank 0's status (400: the set-up failed or cannot run on this engine, 409: an
            update or another set-up is running, 504: a rank did not finish within the
            request's bound), or 503/504 when the engine died or did not answer.
    """
    typed = decode_setup_request(transport, setup_request)
    message = messages.TransportSetup(
        request_id=secrets.token_hex(16), transport=transport, request=setup_request
    )
    wait_s = typed.wait_s() + config.update_margin_s
    return await control_answer(request, message, wait_s, f"the {typed.change} failed")


def admin_router(config: AdminConfig) -> APIRouter:
    """The admin routes (all behind `TokenAuth` when a token is set).

    Args:
        config: bounds of the waits for rank 0's answers.

    Returns:
        The router to include in the app.
    """
    router = APIRouter(responses=error_responses(401, 403))  # with a token set
    _add_update_route(router, config)
    add_outcome_route(router)
    _add_state_routes(router)
    _add_transport_setup_routes(router, config)
    _add_weights_group_routes(router, config)
    _add_generation_routes(router, config)
    _add_memory_routes(router, config)
    return router


def _add_update_route(router: APIRouter, config: AdminConfig) -> None:
    @router.post("/v1/update_weights", responses=_ACTION_ERRORS)
    async def update_weights_route(
        body: UpdateWeightsRequest, request: Request
    ) -> UpdateWeightsResponse:
        return await update_weights(body, request, config)

    @router.post("/v1/commit_weights", responses=_ACTION_ERRORS)
    async def commit_weights_route(
        body: CommitWeightsRequest, request: Request
    ) -> UpdateWeightsResponse:
        return await commit_weights(body, request, config)

    @router.post("/v1/abort_weights", responses=_ACTION_ERRORS)
    async def abort_weights_route(body: AbortWeightsRequest, request: Request) -> ControlResponse:
        return await abort_weights(body, request, config)

    @router.post("/v1/rollback_weights", responses=_ACTION_ERRORS)
    async def rollback_weights_route(
        body: RollbackWeightsRequest, request: Request
    ) -> UpdateWeightsResponse:
        return await rollback_weights(body, request, config)


def _add_state_routes(router: APIRouter) -> None:
    # answered from the client's mirror of rank 0's reports: no message to rank 0
    @router.get("/v1/weights")
    async def weights_route(request: Request) -> WeightsInfo:
        state = _client(request).weights
        assert state is not None  # set at Ready, before the server accepts
        return weights_info(state)

    @router.get("/v1/weights/layout")
    async def weights_layout_route(request: Request) -> Response:
        """Each rank's slice of every tensor now: `{"tp_size": N, "ranks": [[[name, dim,
        start, length], ...], ...], "expert_map": ...}` (a delta's publisher digests each
        rank's slice); `expert_map`: the live expert map they follow, as `GET /v1/experts`
        answers it (null: a dense model)."""
        client = _client(request)
        assert client.ready is not None  # set at Ready, before the server accepts
        layout = {
            "tp_size": client.ready.tp_size,
            "ranks": client.rank_slices,
            "expert_map": client.experts,
        }
        return Response(msgspec.json.encode(layout), media_type="application/json")

    @router.get("/v1/server_info")
    async def server_info_route(request: Request) -> ServerInfo:
        ready = _client(request).ready
        assert ready is not None  # set at Ready, before the server accepts
        return ServerInfo(
            tp_size=ready.tp_size,
            max_model_len=ready.max_model_len,
            served_model_name=request.app.state.served_model_name,
        )


async def _transport_setup_answer(
    body: SetupTransportRequest, request: Request, config: AdminConfig
) -> TransportSetupResponse:
    message = await transport_setup(request, config, body.transport, body.request)
    action = "teardown_transport" if body.teardown else "setup_transport"
    return TransportSetupResponse(transport=body.transport, action=action, message=message)


def _add_transport_setup_routes(router: APIRouter, config: AdminConfig) -> None:
    @router.post("/v1/setup_transport", responses=_ACTION_ERRORS)
    async def setup_transport_route(
        body: SetupTransportRequest, request: Request
    ) -> TransportSetupResponse:
        return await _transport_setup_answer(body, request, config)

    @router.post("/v1/teardown_transport", responses=_ACTION_ERRORS)
    async def teardown_transport_route(
        body: TeardownTransportRequest, request: Request
    ) -> TransportSetupResponse:
        return await _transport_setup_answer(body, request, config)


def _add_weights_group_routes(router: APIRouter, config: AdminConfig) -> None:
    # SGLang's names for `dist`'s set-up and tear-down: the generic path with its requests
    @router.post("/v1/init_weights_group", responses=_ACTION_ERRORS)
    async def init_weights_group_route(
        body: InitWeightsGroupRequest, request: Request
    ) -> ControlResponse:
        setup_request = {"action": "init", **body.model_dump()}
        message = await transport_setup(request, config, "dist", setup_request)
        return ControlResponse(action="init_weights_group", message=message)

    @router.post("/v1/destroy_weights_group", responses=_ACTION_ERRORS)
    async def destroy_weights_group_route(
        body: DestroyWeightsGroupRequest, request: Request
    ) -> ControlResponse:
        setup_request = {"action": "destroy", "group_name": body.group_name}
        message = await transport_setup(request, config, "dist", setup_request)
        return ControlResponse(action="destroy_weights_group", message=message)


def _add_generation_routes(router: APIRouter, config: AdminConfig) -> None:
    @router.post("/v1/pause_generation", responses=_ACTION_ERRORS)
    async def pause_route(body: PauseRequest, request: Request) -> ControlResponse:
        return await control(request, config, "pause", mode=body.mode)

    @router.post("/v1/continue_generation", responses=_ACTION_ERRORS)
    async def continue_route(
        request: Request, body: Annotated[ContinueRequest | None, Body()] = None
    ) -> ControlResponse:
        del body  # no fields (the body may be left out); validated to refuse unknown ones
        return await control(request, config, "continue")


def _add_memory_routes(router: APIRouter, config: AdminConfig) -> None:
    @router.post("/v1/release_memory", responses=_ACTION_ERRORS)
    async def release_route(body: MemoryRequest, request: Request) -> ControlResponse:
        return await control(request, config, "release", tags=list(body.tags))

    @router.post("/v1/resume_memory", responses=_ACTION_ERRORS)
    async def resume_route(body: MemoryRequest, request: Request) -> ControlResponse:
        return await control(request, config, "resume", tags=list(body.tags))
