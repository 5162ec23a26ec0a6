"""`/v1/completions` with `stream: true`: server-sent events, one chunk per token.

Each chunk carries its token, the text it adds and the weights version that produced it
(`ChunkChoice.weight_version`), so a client sees an in-place update land between two tokens;
a last chunk carries `finish_reason` (and `abort_reason`), then `data: [DONE]`. Errors found
before the first token (a prompt the engine refuses, weights that cannot serve) answer with
their HTTP status as without `stream`; an error after it ends the stream with an `error` event.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from weightbus.engines.reference.engine.tokenizer import Tokenizer
from weightbus.engines.reference.server.completions import accept, generate_all
from weightbus.engines.reference.server.engine_client import EngineClient
from weightbus.engines.reference.server.errors import APIError, error_response
from weightbus.engines.reference.server.protocol import (
    ChunkChoice,
    CompletionChunk,
    CompletionRequest,
)

DONE_EVENT = b"data: [DONE]\n\n"
Token = tuple[str, int, bool]  # (weights version, token id, KV recomputed before it)


async def _next_token(task: asyncio.Task, tokens: asyncio.Queue) -> Token | None:
    """The next token, or None once the generation ended (its error raised)."""
    getter = asyncio.ensure_future(tokens.get())
    try:
        await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not getter.done():
            getter.cancel()
    if getter.done() and not getter.cancelled():
        return getter.result()
    if not tokens.empty():  # the task ended with tokens still queued
        return tokens.get_nowait()
    task.result()
    return None


class _Stream:
    """One streamed choice: the generation task and the chunks made of its tokens."""

    def __init__(self, completion_id: str, model_name: str, tokenizer: Tokenizer) -> None:
        self.completion_id = completion_id
        self.model_name = model_name
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""

    def event(self, choice: ChunkChoice) -> bytes:
        chunk = CompletionChunk(
            id=self.completion_id, created=self.created, model=self.model_name, choices=[choice]
        )
        return b"data: " + chunk.model_dump_json(exclude_none=True).encode() + b"\n\n"

    def token_event(self, token: Token) -> bytes:
        version, token_id, kv_recomputed = token
        self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids)
        delta, self.text = text[len(self.text) :], text
        choice = ChunkChoice(
            index=0,
            text=delta,
            token_ids=[token_id],
            weight_version=version,
            kv_recomputed=kv_recomputed or None,  # shown only when it happened
        )
        return self.event(choice)


async def start_stream(
    body: CompletionRequest,
    *,
    client: EngineClient,
    tokenizer: Tokenizer,
    model_name: str,
    request_timeout_s: float,
    on_done: Callable[[int], None],
) -> AsyncIterator[bytes]:
    """Start generating `body`'s one prompt; return its events once the first token came.

    Args:
        on_done: called with the number of tokens sent once the stream ended in full.

    Raises:
        APIError: what `run_completion` raises, found before the first token.
    """
    completion_id, _, requests = accept(body, client, tokenizer)
    tokens: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(
        generate_all(client, tokenizer, requests, [], request_timeout_s, tokens_out=tokens)
    )
    try:
        first = await _next_token(task, tokens)
    except BaseException:
        task.cancel()
        raise
    stream = _Stream(completion_id, model_name, tokenizer)
    return _events(stream, first, (task, tokens), client, on_done)


async def _events(
    stream: _Stream,
    token: Token | None,
    generation: tuple[asyncio.Task, asyncio.Queue],
    client: EngineClient,
    on_done: Callable[[int], None],
) -> AsyncIterator[bytes]:
    task, tokens = generation
    try:
        while token is not None:
            yield stream.token_event(token)
            token = await _next_token(task, tokens)
    except APIError as exc:
        yield b"data: " + bytes(error_response(exc.status_code, exc.message, exc.param).body)
        yield b"\n\n"
        return
    finally:
        task.cancel()  # the client went away: the engine request is aborted
    gen = task.result()[0]
    version = gen.weight_spans[-1].version if gen.weight_spans else client.weights.version
    last = ChunkChoice(
        index=0,
        text="",
        token_ids=[],
        finish_reason=gen.finish_reason or "abort",
        weight_version=version,
        abort_reason=gen.abort_reason,
    )
    yield stream.event(last)
    yield DONE_EVENT
    on_done(len(stream.token_ids))
