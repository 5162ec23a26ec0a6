"""Sampling completions from the engines a Publisher feeds: the reference engine's and vLLM's
OpenAI-style `/v1/completions`, by token ids, with the engine's logprob of every sampled token
and the weight version that generated it."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx

from weightbus.core.publisher.targets import EngineTarget
from weightbus.core.transport.base import EngineRequestError
from weightbus.engines.vllm.target import VllmEngineTarget

T = TypeVar("T")


class EngineCompletionError(RuntimeError):
    """An engine did not answer a completion request, or refused it (the engine named)."""


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled completion: its tokens, the engine's logprob of each, the versions that
    generated them (one, unless a push landed while it ran) and the engine's URL."""

    token_ids: list[int]
    logprobs: list[float]
    versions: tuple[str, ...]
    engine: str


@dataclass(frozen=True, slots=True)
class Sampling:
    """What TRL's config asks of every completion (`GRPOConfig`: temperature, top_p, top_k,
    min_p, repetition_penalty, max_completion_length)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def reference_body(self) -> dict:
        """The reference engine's request fields; it samples with temperature and top-p only.

        Raises:
            ValueError: top-k, min-p or a repetition penalty asked of it (naming the setting).
        """
        unsupported = {
            "top_k": (self.top_k, (0, -1)),
            "min_p": (self.min_p, (0.0,)),
            "repetition_penalty": (self.repetition_penalty, (1.0,)),
        }
        for name, (value, neutral) in unsupported.items():
            if value not in neutral:
                raise ValueError(
                    f"GRPOConfig.{name}={value}: the reference engine samples with temperature "
                    f"and top_p only; leave {name} at {neutral[0]} or generate with vLLM"
                )
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }

    def vllm_body(self) -> dict:
        """vLLM's request fields (all of TRL's sampling settings)."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }


class EngineCompletions:
    """Samples from one engine (a Publisher's target): `n` completions of a token-id prompt.

    Args:
        target: the engine: a URL or `HttpEngineTarget` (weightbus's reference engine), or a
            `VllmEngineTarget` (a vLLM server must be given as one: its completions carry no
            version, and its requests need the served model's name).
        timeout_s: bound of one request.
    """

    def __init__(self, target: str | EngineTarget, timeout_s: float) -> None:
        self.url = target.rstrip("/") if isinstance(target, str) else target.url
        self.timeout_s = timeout_s
        self._vllm = target if isinstance(target, VllmEngineTarget) else None
        # vLLM samples the n of a group in one request; the reference engine one per request
        self.batches_groups = self._vllm is not None
        headers = self._vllm.headers if self._vllm is not None else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers)

    def close(self) -> None:
        """Close the connections to the engine."""
        self._http.close()

    def sample(
        self, prompt_ids: list[int], n: int, sampling: Sampling, seed: int
    ) -> list[Completion]:
        """`n` completions of `prompt_ids` (seeds `seed` .. `seed + n - 1` on the reference
        engine, one request each; one request with `n` on vLLM).

        Raises:
            EngineCompletionError: the engine timed out, was unreachable, refused, aborted a
                completion or answered in another API than expected (its URL named).
        """
        if self._vllm is None:
            return [self._reference(prompt_ids, sampling, seed + k) for k in range(n)]
        return self._vllm_batch(prompt_ids, n, sampling, seed)

    def _post(self, body: dict) -> list[dict]:
        where = f"{self.url}/v1/completions"
        try:
            response = self._http.post("/v1/completions", json=body)
        except httpx.TimeoutException as exc:
            raise EngineCompletionError(
                f"{where}: no answer within {self.timeout_s:g} s ({type(exc).__name__})"
            ) from None
        except httpx.HTTPError as exc:
            raise EngineCompletionError(
                f"{where}: unreachable ({type(exc).__name__}: {exc})"
            ) from None
        if response.status_code != 200:
            raise EngineCompletionError(
                f"{where}: HTTP {response.status_code}: {response.text[:500]}"
            )
        choices = response.json()["choices"]
        for choice in choices:
            if choice.get("finish_reason") == "abort":
                reason = choice.get("abort_reason") or "no reason given"
                raise EngineCompletionError(f"{where}: a completion was aborted ({reason})")
        return choices

    def _reference(self, prompt_ids: list[int], sampling: Sampling, seed: int) -> Completion:
        body = {"prompt": prompt_ids, "seed": seed, "logprobs": 0, **sampling.reference_body()}
        (choice,) = self._post(body)
        if "weight_versions" not in choice:
            raise EngineCompletionError(
                f"{self.url}: not a weightbus reference engine (its completions carry no "
                "weight_versions); give a vLLM server as a VllmEngineTarget"
            )
        spans = choice["weight_versions"] or [{"version": choice["weight_version"]}]
        return Completion(
            token_ids=choice["token_ids"],
            logprobs=choice["logprobs"]["token_logprobs"],
            versions=tuple(dict.fromkeys(span["version"] for span in spans)),
            engine=self.url,
        )

    def _ask_vllm(self, question: Callable[[], T]) -> T:
        """One control read of the vLLM target, its failure naming the engine."""
        try:
            return question()
        except EngineRequestError as exc:
            raise EngineCompletionError(f"{self.url}: {exc}") from None

    def _served_version(self) -> str:
        assert self._vllm is not None
        return self._ask_vllm(lambda: self._vllm.weights(self.timeout_s).version)

    def _vllm_batch(
        self, prompt_ids: list[int], n: int, sampling: Sampling, seed: int
    ) -> list[Completion]:
        # vLLM does not stamp completions: the version it reports before and after the batch
        assert self._vllm is not None
        before = self._served_version()
        # a PEFT policy's adapter is served under its own name (`lora_name`)
        model = self._ask_vllm(lambda: self._vllm.completion_model(self.timeout_s))
        body = {
            "model": model,
            "prompt": prompt_ids,
            "n": n,
            "seed": seed,
            "logprobs": 0,
            "return_token_ids": True,
            **sampling.vllm_body(),
        }
        choices = self._post(body)
        after = self._served_version()
        versions = (before,) if before == after else (before, after)
        return [
            Completion(
                token_ids=choice["token_ids"],
                logprobs=choice["logprobs"]["token_logprobs"],
                versions=versions,
                engine=self.url,
            )
            for choice in choices
        ]
