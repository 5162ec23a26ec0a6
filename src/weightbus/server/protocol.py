"""Request and response schemas of the HTTP API (an OpenAI-style subset), with validation."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20


class CompletionRequest(BaseModel):
    """`POST /v1/completions` body; unknown fields are rejected (422 naming the field)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[int] | list[str | list[int]]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    n: Literal[1] = 1
    stream: Literal[False] = False

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: str | list) -> str | list:
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("prompt must not be an empty list")
            for item in prompt:
                if isinstance(item, list) and not item:
                    raise ValueError("a token-id prompt must not be empty")
                ids = item if isinstance(item, list) else [item]
                if any(isinstance(t, int) and t < 0 for t in ids):
                    raise ValueError("token ids must be non-negative")
        return prompt

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, one per choice."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(t, int) for t in prompt):
            return [prompt]  # one prompt as token ids
        return list(prompt)


class LogProbs(BaseModel):
    """Per-token logprobs under the model (before temperature and top-p).

    `top_logprobs` is OpenAI's text-keyed form (tokens that decode to the same text keep the
    best); `top_token_ids`/`top_token_logprobs` give the same alternatives by token id.
    """

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    top_token_ids: list[list[int]] | None = None
    top_token_logprobs: list[list[float]] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    logprobs: LogProbs | None = None
    finish_reason: str
    weight_version: str


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "weightbus"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
