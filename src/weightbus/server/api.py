"""The FastAPI app: `/v1/completions`, `/v1/models`, `/health`, and JSON errors."""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from weightbus.engine.tokenizer import load_tokenizer
from weightbus.server.completions import APIError, run_completion
from weightbus.server.engine_client import EngineClient
from weightbus.server.protocol import CompletionRequest, CompletionResponse, ModelCard, ModelList

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
    """

    model: str
    served_model_name: str
    ipc_dir: str
    bos_token_id: int | None
    ready_timeout_s: float
    request_timeout_s: float


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


def _error(status_code: int, message: str, param: str | None, **extra: object) -> JSONResponse:
    kind = "invalid_request_error" if status_code < 500 else "server_error"
    body = {
        "error": {"message": message, "type": kind, "param": param, "code": status_code},
        **extra,
    }
    return JSONResponse(status_code=status_code, content=body)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return _error(exc.status_code, exc.message, exc.param)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if loc:
        message = f"invalid field '{loc[0]}': {first.get('msg')}"
    else:
        message = f"invalid request body: {first.get('msg')}"
    return _error(422, message, loc[0] if loc else None, detail=jsonable_encoder(errors))


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
    """The HTTP app; its start-up waits for the engine's Ready (see `EngineClient`)."""

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
            watcher = asyncio.create_task(_watch_engine(client, hooks))
            hooks.on_ready()
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
            await client.close()

    app = FastAPI(title="weightbus engine", lifespan=lifespan)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        client: EngineClient = request.app.state.client
        if client.failure is not None:
            return _error(503, f"engine unavailable: {client.failure}", None)
        return JSONResponse({"status": "ok", "weight_version": client.ready.weight_version})

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        client: EngineClient = request.app.state.client
        card = ModelCard(
            id=config.served_model_name,
            created=request.app.state.created,
            max_model_len=client.ready.max_model_len,
        )
        return ModelList(data=[card])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> CompletionResponse:
        if body.model is not None and body.model != config.served_model_name:
            raise APIError(404, f"model {body.model!r} is not served here", param="model")
        return await run_completion(
            body,
            client=request.app.state.client,
            tokenizer=request.app.state.tokenizer,
            model_name=config.served_model_name,
            request_timeout_s=config.request_timeout_s,
        )

    return app
