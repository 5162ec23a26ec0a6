"""The FastAPI app: completions, models, health, metrics, the admin routes, JSON errors.

Middleware, outermost first: `TokenAuth` (admin routes need the bearer token when one is set),
then `BodyLimit` (413 above `max_body_bytes`), then FastAPI's validation (422 naming the field).
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.tokenizer import load_tokenizer
from weightbus.engines.reference.server.admin import AdminConfig, admin_router
from weightbus.engines.reference.server.auth import TokenAuth
from weightbus.engines.reference.server.body_limit import (
    DEFAULT_MAX_BODY_BYTES,
    NULL_BODY_KEY,
    BodyLimit,
)
from weightbus.engines.reference.server.completion_stream import start_stream
from weightbus.engines.reference.server.completions import run_completion
from weightbus.engines.reference.server.engine_client import EngineClient
from weightbus.engines.reference.server.errors import APIError, error_response, validation_detail
from weightbus.engines.reference.server.experts import add_expert_routes
from weightbus.engines.reference.server.metrics import CONTENT_TYPE, Metrics
from weightbus.engines.reference.server.peers import PeerResolver
from weightbus.engines.reference.server.protocol import (
    STREAMED_COMPLETION,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    error_responses,
)

logger = logging.getLogger(__name__)

# How often the server checks that the engine processes are alive (they have no event to
# await: a dead process is only seen by polling).
LIVENESS_POLL_S = 0.5


@dataclass(kw_only=True, slots=True)
class AppConfig:
    """Settings of the API server.

    Attributes:
        model: `tiny` or a Hugging Face directory (for the tokenizer).
        served_model_name: the name `/v1/models` lists and requests may give.
        ipc_dir: private directory of the rank-0 sockets.
        bos_token_id: prefix of byte-level-tokenized prompts.
        ready_timeout_s: bound of the engine's start-up.
        request_timeout_s: bound of one completion request.
        api_token: bearer token of the admin routes; None leaves them open.
        admin: bounds of the admin routes' waits for rank 0.
        max_body_bytes: largest request body (413 above).
    """

    model: str
    served_model_name: str
    ipc_dir: str
    bos_token_id: int | None
    ready_timeout_s: float
    request_timeout_s: float
    api_token: str | None = field(default=None, repr=False)
    admin: AdminConfig
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


class EngineHooks(Protocol):
    """What the launcher tells the app about the engine processes, and hears back."""

    def failure(self) -> str | None:
        """Why the engine processes can no longer serve (e.g. a worker exited), or None."""
        ...

    def stop_requested(self) -> bool:
        """Whether the server was asked to stop (SIGINT/SIGTERM)."""
        ...

    def on_ready(self) -> None:
        """Called once every rank has loaded the model and the server is about to accept."""
        ...

    def on_failure(self, reason: str) -> None:
        """Called when the engine died while serving; the launcher stops the server."""
        ...


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status_code, exc.message, exc.param, **exc.extra)


def _parse_failure(cause: BaseException) -> str:
    # what Python's JSON reader raised besides a syntax error, said for the client
    if isinstance(cause, RecursionError):
        return "JSON nested too deeply"
    if isinstance(cause, UnicodeDecodeError):
        return f"body is not UTF-8 ({cause.reason} at byte {cause.start})"
    return str(cause).split(";")[0]  # drop the interpreter's advice to its own user


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    # routing (404, 405) and body parsing (400) errors, in the same shape as ours
    message = str(exc.detail)
    if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not parse the body
        message = f"{message}: {_parse_failure(exc.__cause__)}"
    return error_response(exc.status_code, message, headers=exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # the errors echo the input (up to the body limit): answer with a bounded copy
    detail, num_omitted = validation_detail(exc.errors())
    first = detail[0] if detail else {}
    if first.get("type") == "json_invalid":  # loc is ("body", character offset)
        position = first["loc"][-1]
        reason = first.get("ctx", {}).get("error", "")
        return error_response(422, f"invalid JSON at character {position}: {reason}", None)
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if loc:
        message = f"invalid field '{loc[0]}': {first.get('msg')}"
    elif tuple(first.get("loc", ())) == ("body",) and isinstance(exc.body, bytes) and exc.body:
        # FastAPI parses only JSON content types: any other body arrives as raw bytes
        content_type = request.headers.get("content-type", "none")
        message = f"invalid request body: Content-Type must be application/json, got {content_type}"
    elif request.scope.get(NULL_BODY_KEY):
        # FastAPI < 0.137 calls a `null` body missing, later ones not a dictionary
        message = "invalid request body: expected a JSON object, got null"
    else:
        message = f"invalid request body: {first.get('msg')}"
    omitted = {"detail_omitted": num_omitted} if num_omitted else {}
    return error_response(422, message, loc[0] if loc else None, detail=detail, **omitted)


def _stop_reason(hooks: EngineHooks) -> str | None:
    return "server is stopping" if hooks.stop_requested() else hooks.failure()


async def _watch_engine(client: EngineClient, hooks: EngineHooks) -> None:
    # Requests still waiting when the engine goes away are answered 503 at once.
    while (reason := _stop_reason(hooks)) is None:
        await asyncio.sleep(LIVENESS_POLL_S)
    client.fail(reason)
    if not hooks.stop_requested():
        logger.error("engine failed: %s", reason)
        hooks.on_failure(reason)


def create_app(config: AppConfig, hooks: EngineHooks) -> FastAPI:
    """The HTTP app; its start-up waits for the engine's Ready (see `EngineClient`).

    Args:
        config: settings of the server (token, bounds, sockets).
        hooks: the launcher's view of the engine processes.

    Returns:
        The app, with its own metrics registry.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = EngineClient(config.ipc_dir)
        watcher = None
        try:
            await client.wait_ready(
                timeout_s=config.ready_timeout_s, check=lambda: _stop_reason(hooks)
            )
            app.state.client = client
            app.state.tokenizer = load_tokenizer(config.model, config.bos_token_id)
            app.state.created = int(time.time())
            app.state.served_model_name = config.served_model_name
            app.state.peers = PeerResolver(client, config.api_token)
            watcher = asyncio.create_task(_watch_engine(client, hooks))
            hooks.on_ready()
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
            if hasattr(app.state, "peers"):
                await app.state.peers.close()
            await client.close()

    app = FastAPI(title="weightbus engine", lifespan=lifespan)
    app.state.metrics = Metrics(
        lambda: _weights_mirror(app), lambda: _draft_tokens(app), lambda: _prefix_cache(app)
    )
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    # added last = outermost: the token is checked before the body is read
    app.add_middleware(BodyLimit, max_body_bytes=config.max_body_bytes)
    app.add_middleware(TokenAuth, token=config.api_token)
    admin = admin_router(config.admin)
    add_expert_routes(admin, config.admin)
    app.include_router(admin)
    _add_public_routes(app, config)
    return app


def _weights_mirror(app: FastAPI) -> messages.WeightsState | None:
    client: EngineClient | None = getattr(app.state, "client", None)
    return None if client is None else client.weights


def _draft_tokens(app: FastAPI) -> tuple[int, int] | None:
    client: EngineClient | None = getattr(app.state, "client", None)
    return None if client is None else (client.num_draft_tokens, client.num_accepted_tokens)


def _prefix_cache(app: FastAPI) -> tuple[int, int] | None:
    client: EngineClient | None = getattr(app.state, "client", None)
    return None if client is None else (client.num_prefix_queries, client.num_prefix_hits)


def _check_model(body: CompletionRequest, served_model_name: str) -> None:
    if body.model is not None and body.model != served_model_name:
        raise APIError(404, f"model {body.model!r} is not served here", param="model")


def _add_public_routes(app: FastAPI, config: AppConfig) -> None:
    @app.get("/health", responses=error_responses(503))
    async def health(request: Request) -> JSONResponse:
        client: EngineClient = request.app.state.client
        if client.failure is not None:
            return error_response(503, f"engine unavailable: {client.failure}")
        weights = client.weights
        return JSONResponse(
            {
                "status": "ok",
                "weight_version": weights.version,
                "weights_status": weights.status,
                "generation": weights.generation,
                "waiting_for_initial_weights": weights.status == "WAITING",
                "rollback_version": weights.rollback.version if weights.rollback else None,
            }
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        client: EngineClient = request.app.state.client
        card = ModelCard(
            id=config.served_model_name,
            created=request.app.state.created,
            max_model_len=client.ready.max_model_len,
        )
        return ModelList(data=[card])

    @app.post(
        "/v1/completions",
        responses=STREAMED_COMPLETION | error_responses(400, 404, 413, 422, 503, 504),
    )
    async def completions(body: CompletionRequest, request: Request) -> CompletionResponse:
        metrics: Metrics = request.app.state.metrics
        try:
            _check_model(body, config.served_model_name)
            if body.stream:
                return await _streamed(body, request, metrics)
            response = await run_completion(body, **_generation(request))
        except APIError as exc:
            metrics.observe_completion(exc.status_code)
            raise
        metrics.observe_completion(200, response.usage.completion_tokens)
        return response

    def _generation(request: Request) -> dict:
        """What a completion generates with, streamed or not."""
        return {
            "client": request.app.state.client,
            "tokenizer": request.app.state.tokenizer,
            "model_name": config.served_model_name,
            "request_timeout_s": config.request_timeout_s,
        }

    async def _streamed(
        body: CompletionRequest, request: Request, metrics: Metrics
    ) -> StreamingResponse:
        events = await start_stream(
            body,
            **_generation(request),
            on_done=lambda num_tokens: metrics.observe_completion(200, num_tokens),
        )
        return StreamingResponse(events, media_type="text/event-stream")
