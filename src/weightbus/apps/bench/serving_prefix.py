"""The prefix-cache row of `weightbus bench serving`: a GRPO group (the same prompt `group`
times, sent together) served by an engine with the prefix cache against one without it.

Each round sends a new prompt (nothing cached from an earlier round) as `group` concurrent
requests and times the group from the first send to the last answer; the engines take turns,
round after round, and the median of each is kept.
"""

import asyncio
import random
import statistics
import time

import httpx


async def _group_s(url: str, prompt: list[int], group: int, max_tokens: int) -> float:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        start = time.perf_counter()
        answers = await asyncio.gather(
            *(http.post("/v1/completions", json=body) for _ in range(group))
        )
        elapsed_s = time.perf_counter() - start
    for answer in answers:
        if answer.status_code != 200:
            raise RuntimeError(f"{url} answered HTTP {answer.status_code}: {answer.text[:300]}")
    return elapsed_s


def group_seconds(
    urls: dict[str, str], *, group: int, prompt_tokens: int, max_tokens: int, vocab_size: int,
    rounds: int,
) -> dict[str, float]:  # fmt: skip
    """The median seconds of a group on each engine of `urls` (name -> URL)."""
    rng = random.Random(0)  # noqa: S311 - prompts, not secrets
    times: dict[str, list[float]] = {name: [] for name in urls}
    for _ in range(rounds):
        for name, url in urls.items():
            prompt = [rng.randrange(vocab_size) for _ in range(prompt_tokens)]
            times[name].append(asyncio.run(_group_s(url, prompt, group, max_tokens)))
    return {name: statistics.median(seconds) for name, seconds in times.items()}
