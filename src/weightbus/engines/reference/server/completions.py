"""`/v1/completions`: prompts in, one engine request per prompt, choices out."""

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.tokenizer import Tokenizer
from weightbus.engines.reference.server.engine_client import EngineClient, EngineDeadError
from weightbus.engines.reference.server.errors import APIError
from weightbus.engines.reference.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    LogProbs,
    Usage,
    WeightSpan,
)


@dataclass(slots=True)
class _Generation:
    """Tokens of one choice as they arrive."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    top: list[tuple[list[int], list[float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    abort_reason: str | None = None
    weight_spans: list[WeightSpan] = field(default_factory=list)


def extend_spans(
    spans: list[WeightSpan], version: str, index: int, *, kv_recomputed: bool = False
) -> None:
    """Count completion token `index`, generated under weights `version`, into `spans`.

    Tokens come in order; a token under the same version as the previous one extends its span,
    any other version opens a new span (an update in place changed the weights mid-sequence).

    Args:
        spans: the spans so far (modified).
        version: weights version of the token.
        index: the token's position in the completion (the previous one + 1).
        kv_recomputed: the sequence's KV was computed again on `version` before this token
            (it opens a span that says so).
    """
    extends = spans and spans[-1].version == version and spans[-1].end == index
    if extends and not kv_recomputed:
        spans[-1].end = index + 1
    else:
        span = WeightSpan(version=version, start=index, end=index + 1, kv_recomputed=kv_recomputed)
        spans.append(span)


def check_serving(weights: messages.WeightsState) -> None:
    """Refuse new completions while the engine cannot generate with valid weights.

    Args:
        weights: the client's mirror of rank 0's weights state.

    Raises:
        APIError: 503 saying why (weights failed to update, waiting for the initial weights,
            or memory released).
    """
    if weights.status == "FAILED":
        raise APIError(
            503,
            f"weights failed to update (version {weights.version!r} is not valid): "
            "push a good version with POST /v1/update_weights",
        )
    if weights.status == "WAITING":
        raise APIError(
            503,
            "waiting for its initial weights (started with --wait-for-initial-weights): "
            "push a version with POST /v1/update_weights",
        )
    if weights.released or weights.status in ("CLEARING", "CLEARED"):
        released = ", ".join(weights.released) or "in progress"
        raise APIError(
            503, f"memory released ({released}): call POST /v1/resume_memory before generating"
        )


def tokenize_prompts(
    body: CompletionRequest, tokenizer: Tokenizer, *, vocab_size: int, max_model_len: int
) -> list[list[int]]:
    """Token ids of every prompt, checked against the vocabulary and the context length.

    Raises:
        APIError: 400 naming `prompt` or `max_tokens`.
    """
    prompts = [p if isinstance(p, list) else tokenizer.encode(p) for p in body.prompts()]
    for ids in prompts:
        if not ids:
            raise APIError(400, "prompt encodes to no tokens", param="prompt")
        if max(ids) >= vocab_size:
            raise APIError(400, f"token id {max(ids)} >= vocab_size {vocab_size}", param="prompt")
        if len(ids) + body.max_tokens > max_model_len:
            raise APIError(
                400,
                f"this model's maximum context length is {max_model_len} tokens; the request "
                f"needs {len(ids)} prompt + {body.max_tokens} completion tokens",
                param="max_tokens" if len(ids) < max_model_len else "prompt",
            )
    return prompts


def _find_stop(text: str, stops: list[str], search_from: int) -> int:
    positions = [text.find(s, search_from) for s in stops]
    found = [p for p in positions if p >= 0]
    return min(found) if found else -1


async def _generate(
    client: EngineClient,
    tokenizer: Tokenizer,
    request: messages.AddRequest,
    stops: list[str],
    tokens_out: asyncio.Queue | None = None,
) -> _Generation:
    """One choice's tokens; with `tokens_out`, each also put there as (version, token id)."""
    gen = _Generation()
    queue = await client.add(request)
    longest_stop = max((len(s) for s in stops), default=0)
    try:
        while gen.finish_reason is None:
            item = await queue.get()
            if isinstance(item, messages.RequestError):
                raise APIError(400, item.message, param="prompt")
            if isinstance(item, Exception):
                raise item
            if isinstance(item, messages.Aborted):  # the engine ended it: nothing to abort
                gen.finish_reason, gen.abort_reason = "abort", item.reason
                break
            version, out = item
            extend_spans(
                gen.weight_spans, version, len(gen.token_ids), kv_recomputed=out.kv_recomputed
            )
            gen.token_ids.append(out.token_id)
            gen.logprobs.append(out.logprob)
            gen.top.append((out.top_token_ids, out.top_logprobs))
            if out.prompt_logprobs is not None:
                gen.prompt_logprobs = out.prompt_logprobs
            gen.finish_reason = out.finish_reason
            if tokens_out is not None:
                tokens_out.put_nowait((version, out.token_id, out.kv_recomputed))
            if stops:
                previous_len = len(gen.text)
                gen.text = tokenizer.decode(gen.token_ids)
                cut = _find_stop(gen.text, stops, max(0, previous_len - longest_stop))
                if cut >= 0:
                    gen.text, gen.finish_reason = gen.text[:cut], "stop"
                    await client.abort(request.request_id)
    finally:
        if gen.finish_reason is None:  # cancelled, timed out or failed: free the engine slot
            await client.abort(request.request_id)
        client.release(request.request_id)
    if not stops:
        gen.text = tokenizer.decode(gen.token_ids)
    return gen


def _top_by_text(tokenizer: Tokenizer, ids: list[int], logprobs: list[float]) -> dict[str, float]:
    by_text: dict[str, float] = {}
    for token_id, logprob in zip(ids, logprobs, strict=True):
        by_text.setdefault(tokenizer.decode([token_id]), logprob)  # best first: keep it
    return by_text


def _logprobs(gen: _Generation, tokenizer: Tokenizer, num_logprobs: int) -> LogProbs:
    result = LogProbs(
        tokens=[tokenizer.decode([t]) for t in gen.token_ids],
        token_logprobs=gen.logprobs,
    )
    if num_logprobs > 0:
        result.top_logprobs = [_top_by_text(tokenizer, ids, lps) for ids, lps in gen.top]
        result.top_token_ids = [ids for ids, _ in gen.top]
        result.top_token_logprobs = [lps for _, lps in gen.top]
    return result


async def _all_or_none(coros: list) -> list[_Generation]:
    # Like gather, but when one choice fails (or the request is cancelled) the others are
    # cancelled too, so each frees its engine slot.
    tasks = [asyncio.create_task(coro) for coro in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _engine_requests(
    body: CompletionRequest, prompts: list[list[int]], completion_id: str
) -> list[messages.AddRequest]:
    # one engine request per prompt, `<completion id>-<choice index>`
    return [
        messages.AddRequest(
            request_id=f"{completion_id}-{i}",
            prompt_token_ids=ids,
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            num_logprobs=body.logprobs,
            ignore_eos=body.ignore_eos,
            prompt_logprobs=body.prompt_logprobs,
        )
        for i, ids in enumerate(prompts)
    ]


async def generate_all(
    client: EngineClient,
    tokenizer: Tokenizer,
    requests: list[messages.AddRequest],
    stops: list[str],
    request_timeout_s: float,
    *,
    tokens_out: asyncio.Queue | None = None,
) -> list[_Generation]:
    try:
        async with asyncio.timeout(request_timeout_s):
            return await _all_or_none(
                [_generate(client, tokenizer, r, stops, tokens_out) for r in requests]
            )
    except EngineDeadError as exc:
        raise APIError(503, f"engine unavailable: {exc}") from None
    except TimeoutError:
        raise APIError(504, f"generation took longer than {request_timeout_s:.0f} s") from None


def _choice(
    index: int,
    gen: _Generation,
    body: CompletionRequest,
    tokenizer: Tokenizer,
    serving_version: str,
) -> CompletionChoice:
    return CompletionChoice(
        index=index,
        text=gen.text,
        token_ids=gen.token_ids,
        logprobs=None if body.logprobs is None else _logprobs(gen, tokenizer, body.logprobs),
        prompt_logprobs=gen.prompt_logprobs,
        finish_reason=gen.finish_reason or "abort",
        weight_version=gen.weight_spans[-1].version if gen.weight_spans else serving_version,
        weight_versions=gen.weight_spans,
        abort_reason=gen.abort_reason,
    )


def _usage(prompts: list[list[int]], generations: list[_Generation]) -> Usage:
    num_prompt = sum(len(ids) for ids in prompts)
    num_completion = sum(len(gen.token_ids) for gen in generations)
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
    )


def accept(
    body: CompletionRequest, client: EngineClient, tokenizer: Tokenizer
) -> tuple[str, list[list[int]], list[messages.AddRequest]]:
    """A completion's id, prompts and engine requests, once its prompts fit the model and
    the weights can serve.

    Raises:
        APIError: 400 naming the field, 503 saying why the weights cannot serve.
    """
    ready = client.ready
    assert ready is not None
    assert client.weights is not None
    prompts = tokenize_prompts(
        body, tokenizer, vocab_size=ready.vocab_size, max_model_len=ready.max_model_len
    )
    check_serving(client.weights)
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    return completion_id, prompts, _engine_requests(body, prompts, completion_id)


async def run_completion(
    body: CompletionRequest,
    *,
    client: EngineClient,
    tokenizer: Tokenizer,
    model_name: str,
    request_timeout_s: float,
) -> CompletionResponse:
    """Generate every choice of a completion request concurrently.

    Raises:
        APIError: 400 for prompts the model cannot take, 503 when the engine is gone or its
            weights cannot serve (failed update, memory released), 504 when generation
            outlasts `request_timeout_s`.
    """
    completion_id, prompts, requests = accept(body, client, tokenizer)
    stops = list(body.stop or [])
    generations = await generate_all(client, tokenizer, requests, stops, request_timeout_s)
    # a choice ended before its first token reports the version serving now
    serving_version = client.weights.version
    choices = [
        _choice(i, gen, body, tokenizer, serving_version) for i, gen in enumerate(generations)
    ]
    return CompletionResponse(
        id=completion_id,
        created=int(time.time()),
        model=model_name,
        choices=choices,
        usage=_usage(prompts, generations),
    )
