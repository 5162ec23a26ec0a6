"""Rollouts through the engine's OpenAI-style `/v1/completions`, several samples per prompt."""

from concurrent.futures import ThreadPoolExecutor

import httpx

from weightbus.apps.demo.task import Rollout

# `/metrics` counters of speculative decoding: draft tokens proposed, and accepted
SPEC_COUNTERS = ("weightbus_spec_draft_tokens_total", "weightbus_spec_accepted_tokens_total")


class RolloutClient:
    """Samples completions from one engine, one request per sample (each with its own seed).

    Args:
        url: the engine's base URL.
        max_tokens: completion length (EOS ignored, so every completion has this length).
        temperature: sampling temperature.
        timeout_s: bound of one request.
        token: bearer token of the engine's admin routes (`weights` reads one), if it has one.
    """

    def __init__(
        self,
        url: str,
        *,
        max_tokens: int,
        temperature: float,
        timeout_s: float = 120.0,
        token: str | None = None,
    ) -> None:
        self.max_tokens = max_tokens
        self.temperature = temperature
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url, timeout=timeout_s, headers=headers)
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="rollout")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()

    def sample(self, prompts: list[list[int]], group_size: int, seed: int) -> list[Rollout]:
        """`group_size` completions of every prompt, the samples of a prompt adjacent.

        Raises:
            httpx.HTTPStatusError: the engine refused a request.
        """
        jobs = [
            (prompt, seed + index * group_size + k)
            for index, prompt in enumerate(prompts)
            for k in range(group_size)
        ]
        return list(self._pool.map(lambda job: self._complete(*job), jobs))

    def _complete(self, prompt: list[int], seed: int) -> Rollout:
        response = self._http.post("/v1/completions", json=self._request_body(prompt, seed))
        response.raise_for_status()
        choice = response.json()["choices"][0]
        return Rollout(
            prompt_ids=prompt,
            token_ids=choice["token_ids"],
            engine_logprobs=choice["logprobs"]["token_logprobs"],
            weight_version=self._version_of(choice),
        )

    def _request_body(self, prompt: list[int], seed: int) -> dict:
        return {
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": seed,
            "logprobs": 0,
            "ignore_eos": True,
        }

    def _version_of(self, choice: dict) -> str:
        """The version that generated a completion (the engine stamps every choice)."""
        return choice["weight_version"]

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """One greedy completion of `max_tokens` tokens (EOS ignored): its token ids."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        response = self._http.post("/v1/completions", json=body)
        response.raise_for_status()
        return response.json()["choices"][0]["token_ids"]

    def draft_tokens(self) -> tuple[int, int]:
        """Draft tokens the engine proposed and accepted so far (`GET /metrics`)."""
        response = self._http.get("/metrics")
        response.raise_for_status()
        counts = dict.fromkeys(SPEC_COUNTERS, 0)
        for line in response.text.splitlines():
            name, _, value = line.partition(" ")
            if name in counts:
                counts[name] = int(float(value))
        return counts[SPEC_COUNTERS[0]], counts[SPEC_COUNTERS[1]]

    def acceptance_since(self, before: tuple[int, int]) -> float | None:
        """The share of draft tokens accepted since `before` (None: none proposed)."""
        drafted, accepted = self.draft_tokens()
        proposed = drafted - before[0]
        return (accepted - before[1]) / proposed if proposed else None

    def weights(self) -> dict:
        """The engine's `GET /v1/weights` answer."""
        response = self._http.get("/v1/weights")
        response.raise_for_status()
        return response.json()
