"""The load of `weightbus bench serving`: concurrent completion streams in GRPO-like groups.

`streams` streams run at once; stream `i` belongs to group `i // group` and asks that group's
prompt (the same prompt `group` times, as a GRPO rollout does), request after request, until
the run ends. Each request is streamed (`stream: true`), so every token's arrival time and the
weights version that produced it are recorded (`RequestLog`).
"""

import asyncio
import functools
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

# one line per request would drown the report
logging.getLogger("httpx").setLevel(logging.WARNING)


@dataclass
class RequestLog:
    """One request: when it was sent, each token's arrival (`time.time()`) and version, how
    and when it ended (`finish_reason`, `ended_s`; `abort`: `abort_reason`), or the error that
    ended it."""

    stream: int
    sent_s: float
    token_times_s: list[float] = field(default_factory=list)
    token_versions: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    abort_reason: str | None = None
    error: str | None = None
    ended_s: float | None = None

    @property
    def versions(self) -> list[str]:
        """The versions of its tokens, in order, each once."""
        return list(dict.fromkeys(self.token_versions))


@dataclass(frozen=True)
class LoadShape:
    streams: int
    group: int
    prompt_tokens: int
    max_tokens: int
    vocab_size: int
    seed: int = 0

    def prompts(self) -> list[list[int]]:
        """One prompt per group."""
        rng = random.Random(self.seed)  # noqa: S311 - prompts, not secrets
        num_groups = -(-self.streams // self.group)
        return [
            [rng.randrange(self.vocab_size) for _ in range(self.prompt_tokens)]
            for _ in range(num_groups)
        ]


# the route each engine streams from (`serving_engines.ServingEngine.api`) and its body
_ROUTES = {"completions": "/v1/completions", "generate": "/inference/v1/generate"}


def _body(api: str, prompt: list[int], max_tokens: int) -> dict:
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if api == "completions":
        return {"prompt": prompt, **sampling, "stream": True}
    return {"token_ids": prompt, "sampling_params": sampling, "stream": True}


async def _one_request(
    http: httpx.AsyncClient, api: str, stream: int, prompt: list[int], max_tokens: int
) -> RequestLog:
    log = RequestLog(stream, time.time())
    read_event = read_completion_event if api == "completions" else read_generate_event
    try:
        async with http.stream("POST", _ROUTES[api], json=_body(api, prompt, max_tokens)) as r:
            if r.status_code != 200:
                log.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"
                return log
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    read_event(log, json.loads(line.removeprefix("data: ")))
    except httpx.HTTPError as exc:
        log.error = f"{type(exc).__name__}: {exc}"
    return log


def read_completion_event(log: RequestLog, event: dict) -> None:
    """The reference engine's chunk: one token and the version that produced it."""
    if "error" in event:
        log.error = event["error"]["message"]
        return
    choice = event["choices"][0]
    if choice["token_ids"]:
        log.token_times_s.append(time.time())
        log.token_versions.append(choice["weight_version"])
    if choice.get("finish_reason") is not None:
        log.finish_reason = choice["finish_reason"]
        log.abort_reason = choice.get("abort_reason")
        log.ended_s = time.time()


def read_generate_event(log: RequestLog, event: dict) -> None:
    """vLLM's chunk: token ids without a version; the last one's `weight_versions` spans name
    every token's (a token no span covers keeps the version `""`: a wrong one)."""
    if "error" in event:
        log.error = event["error"]["message"]
        return
    if not event.get("choices"):  # the usage chunk
        return
    choice = event["choices"][0]
    now_s = time.time()
    log.token_times_s += [now_s] * len(choice.get("token_ids") or [])
    log.token_versions += [""] * len(choice.get("token_ids") or [])
    for span in choice.get("weight_versions") or []:
        log.token_versions[span["start"] : span["end"]] = [str(span["version"])] * (
            span["end"] - span["start"]
        )
    if choice.get("finish_reason") is not None:
        log.finish_reason = choice["finish_reason"]
        log.ended_s = now_s


async def _stream_loop(
    one_request: Callable[[], Awaitable[RequestLog]], end_s: float, stop: Callable[[], bool]
) -> list[RequestLog]:
    logs = []
    while time.time() < end_s and not stop():
        logs.append(await one_request())
    return logs


async def run_load(
    url: str,
    shape: LoadShape,
    duration_s: float,
    api: str = "completions",
    stop: Callable[[], bool] = lambda: False,
) -> list[RequestLog]:
    """Run the load against `url` for `duration_s`, or until `stop()` is true (requests
    started by then finish).

    Args:
        api: `completions` (the reference engine's `/v1/completions`) or `generate` (vLLM's
            `/inference/v1/generate`).
    """
    prompts = shape.prompts()
    end_s = time.time() + duration_s
    limits = httpx.Limits(max_connections=shape.streams)
    async with httpx.AsyncClient(base_url=url, timeout=duration_s + 120, limits=limits) as http:
        per_stream = await asyncio.gather(
            *(
                _stream_loop(
                    functools.partial(
                        _one_request, http, api, i, prompts[i // shape.group], shape.max_tokens
                    ),
                    end_s,
                    stop,
                )
                for i in range(shape.streams)
            )
        )
    return [log for logs in per_stream for log in logs]
