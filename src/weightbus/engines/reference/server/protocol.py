"""Request and response schemas of the HTTP API (an OpenAI-style subset), with validation."""

import json
from typing import Any, ClassVar, Literal

import msgspec
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from weightbus.core.transport import (
    DEFAULT_GROUP_NAME,
    GROUP_NAME_PATTERN,
    decode_description,
    decode_setup_request,
    setup_transport_names,
    transport_names,
)
from weightbus.core.wire import PauseMode
from weightbus.core.wire.order import (
    MAX_UPDATE_TIMEOUT_S,
    MAX_VERSION_CHARS,
    VERSION_PATTERN,
    UpdateOrder,
)
from weightbus.engines.reference.engine.expert_placement import PLACEMENTS
from weightbus.engines.reference.engine.messages import MemoryTag, WeightsStatus
from weightbus.engines.reference.server.order_body import order_body_model

MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20
ControlAction = Literal["pause", "continue", "release", "resume"]


def _check_unicode(text: str) -> None:
    # JSON's "\\ud800" escape reads as a lone surrogate, which no tokenizer can encode
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text has a lone surrogate at character {exc.start}") from None


class CompletionRequest(BaseModel):
    """`POST /v1/completions` body; unknown fields are rejected (422 naming the field), and so
    are values of another JSON type: `true` is not a token id, a seed or a temperature, `"yes"`
    not a boolean (integers are accepted where a number is)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | list[int] | list[str | list[int]]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's extra parameter, as a flag: each prompt token's logprob in the choice
    prompt_logprobs: bool = False
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    n: Literal[1] = 1
    # server-sent events, one chunk per token (`CompletionChunk`), then `data: [DONE]`
    stream: bool = False

    @field_validator("n", mode="before")
    @classmethod
    def _check_constant(cls, value: object, info: ValidationInfo) -> object:
        # a Literal compares with ==: True would pass for 1
        if type(value) is not int:
            raise ValueError(f"{info.field_name} must be {json.dumps(1)}")
        return value

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: str | list) -> str | list:
        for text in [prompt] if isinstance(prompt, str) else prompt:
            if isinstance(text, str):
                _check_unicode(text)
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
        for text in stops:
            _check_unicode(text)
        return stops

    @model_validator(mode="after")
    def _check_stream(self) -> "CompletionRequest":
        if self.stream and len(self.prompts()) > 1:
            raise ValueError("stream takes one prompt (send one request per prompt)")
        if self.stream and self.stop:
            raise ValueError("stream does not take stop strings")
        if self.stream and (self.logprobs is not None or self.prompt_logprobs):
            raise ValueError("stream does not report logprobs (ask without stream)")
        return self

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


class WeightSpan(BaseModel):
    """Completion tokens `[start, end)` were generated under weights `version`.

    `kv_recomputed`: the sequence's whole KV (prompt and earlier tokens) was computed again on
    `version` before the span's first token (an in-place push with `running_kv="recompute"`),
    so the span's tokens attend to this version's KV only; False on a later span means its
    tokens attend to the KV earlier versions computed (`running_kv="keep"`).
    """

    version: str
    start: int
    end: int
    kv_recomputed: bool = False


class CompletionChoice(BaseModel):
    """One choice; `weight_version` is the version of its last token (the engine's current
    version when it has none), `weight_versions` the spans of every version it saw."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: LogProbs | None = None
    # with `prompt_logprobs`: log p(prompt[i] | prompt[:i]) per prompt token (None for the first)
    prompt_logprobs: list[float | None] | None = None
    finish_reason: str
    weight_version: str
    weight_versions: list[WeightSpan]
    abort_reason: str | None = None


class ChunkChoice(BaseModel):
    """One token of a streamed choice (`finish_reason` set on its last chunk), and the
    weights version that produced it."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    weight_version: str
    abort_reason: str | None = None
    # true on the first token after the sequence's KV was computed again on `weight_version`
    # (an in-place push with running_kv "recompute"; `WeightSpan.kv_recomputed`)
    kv_recomputed: bool | None = None


class CompletionChunk(BaseModel):
    """A server-sent event of a streamed completion (OpenAI's `text_completion` chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[ChunkChoice]


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
    """Every error answer; some carry more keys (`names`: the offending tensors of an update)."""

    error: ErrorInfo


class ValidationErrorResponse(ErrorResponse):
    """A 422 answer: `detail` lists every invalid field (absent when the JSON did not parse)."""

    detail: list[dict[str, Any]] | None = None


_ERROR_DESCRIPTIONS = {
    400: "The body cannot be parsed, or the engine refused the request (the message says why)",
    401: "An admin route without 'Authorization: Bearer <token>' (a token is set)",
    403: "An admin route with a wrong token",
    404: "The model named is not served here",
    409: "Another update or state change is running, or the version is not new",
    413: "The body exceeds the server's limit",
    422: "Malformed JSON, or a missing, unknown or mistyped field",
    503: "The engine is gone, its memory is released or its weights failed",
    504: "The engine did not answer in time",
}


STREAMED_COMPLETION = {
    200: {
        "description": (
            "The completion; with `stream: true`, server-sent events: one `data:` chunk per token "
            "(each with its `weight_version`), a last chunk with `finish_reason`, then "
            "`data: [DONE]`"
        ),
        "content": {
            "text/event-stream": {
                "schema": {  # one event (OpenAPI 3.1: the schema of a stream describes an event)
                    "type": "object",
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                    "required": ["data"],
                }
            }
        },
    }
}


def error_responses(*status_codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` documenting the error answers a route may give.

    Args:
        *status_codes: HTTP statuses among 400, 401, 403, 404, 409, 413, 422, 503, 504.

    Returns:
        The `responses` argument of a route or router.
    """
    return {
        code: {
            "model": ValidationErrorResponse if code == 422 else ErrorResponse,
            "description": _ERROR_DESCRIPTIONS[code],
        }
        for code in status_codes
    }


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "weightbus"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- admin routes ---


class AdminRequest(BaseModel):
    """Base of admin bodies: unknown fields are rejected and types are not coerced ("yes" is
    not a boolean, "5" not an integer): a control plane should fail loudly."""

    model_config = ConfigDict(extra="forbid", strict=True)


_FINGERPRINT_PATTERN = r"^[0-9a-f]{32}$"


def _version(*default: None) -> Any:
    # a version name as every admin body takes it (required unless a default is given)
    return Field(*default, min_length=1, max_length=MAX_VERSION_CHARS, pattern=VERSION_PATTERN)


def _timeout() -> Any:
    return Field(60.0, gt=0, le=MAX_UPDATE_TIMEOUT_S, allow_inf_nan=False)


class UpdateWeightsRequest(
    order_body_model(
        UpdateOrder,
        name="UpdateOrderBody",
        base=AdminRequest,
    )
):
    """`POST /v1/update_weights` body."""

    # the registry's names, in the schema; the fields are `UpdateOrder`'s
    transport: str = Field(json_schema_extra={"enum": transport_names()})

    @field_validator("transport")
    @classmethod
    def _check_transport(cls, transport: str) -> str:
        names = transport_names()
        if transport not in names:
            raise ValueError(f"unknown transport {transport!r}; available: {', '.join(names)}")
        return transport

    @field_validator("source")
    @classmethod
    def _check_source(cls, source: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        # the transport's own description type says what `source` may hold (422 naming the
        # field); ranks decode it again with the same registry function
        transport = info.data.get("transport")  # absent when the transport was refused
        if transport is not None:
            decode_description(transport, source)
        _check_sendable("source", source)
        return source


class CommitWeightsRequest(AdminRequest):
    """`POST /v1/commit_weights` body: swap in the two-phase update of `version` (staged and
    verified), if its fingerprint is `fingerprint` (when given)."""

    version: str = _version()
    fingerprint: str | None = Field(None, pattern=_FINGERPRINT_PATTERN)
    timeout_s: float = _timeout()


class AbortWeightsRequest(AdminRequest):
    """`POST /v1/abort_weights` body: discard the two-phase update of `version`."""

    version: str = _version()
    reason: str = Field("", max_length=1000)


class RollbackWeightsRequest(AdminRequest):
    """`POST /v1/rollback_weights` body: swap back to the previous version (held in the
    staging memory), expected to be `version` / `fingerprint` when given; with `two_phase` the
    engine answers `staged` and swaps on `/v1/commit_weights`."""

    version: str | None = _version(None)
    fingerprint: str | None = Field(None, pattern=_FINGERPRINT_PATTERN)
    pause_mode: PauseMode = "drain"
    two_phase: bool = False
    timeout_s: float = _timeout()


class OutcomeRequest(AdminRequest):
    """`POST /v1/weights/outcome` body: what became here of the two-phase `version`."""

    version: str = _version()
    fingerprint: str | None = Field(None, pattern=_FINGERPRINT_PATTERN)


class OutcomeResponse(BaseModel):
    """`committed` (served or being committed), `staged` (waiting for its decision: now only
    the fleet's peers decide it), `receiving`, or `absent` (nothing of it here)."""

    version: str
    outcome: Literal["committed", "staged", "receiving", "absent"] = Field(
        description="what became of the version on this engine"
    )


class PauseRequest(AdminRequest):
    """`POST /v1/pause_generation` body."""

    mode: PauseMode


class ContinueRequest(AdminRequest):
    """`POST /v1/continue_generation` body (empty)."""


class MemoryRequest(AdminRequest):
    """`POST /v1/release_memory` and `/v1/resume_memory` body."""

    tags: list[MemoryTag] = Field(min_length=1)

    @field_validator("tags")
    @classmethod
    def _check_unique(cls, tags: list[str]) -> list[str]:
        if len(set(tags)) != len(tags):
            raise ValueError("tags must be unique")
        return tags


def _check_sendable(field: str, value: dict[str, Any]) -> None:
    """Refuse what cannot travel to rank 0 as msgpack (integers must fit in 64 bits)."""
    try:
        msgspec.msgpack.encode(value)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"{field} cannot be sent to the engine: {exc}") from None


class SetupTransportRequest(AdminRequest):
    """`POST /v1/setup_transport` body: every rank of this engine runs the rank set-up of
    `transport` with `request` (the transport's set-up request, as its `setup_request` type
    reads it, e.g. `dist`'s `{"action": "init", ...}`)."""

    teardown: ClassVar[bool] = False

    transport: str = Field(json_schema_extra={"enum": setup_transport_names()})
    request: dict[str, Any]

    @field_validator("transport")
    @classmethod
    def _check_transport(cls, transport: str) -> str:
        names = setup_transport_names()
        if transport not in names:
            raise ValueError(
                f"transport {transport!r} needs no set-up on engine ranks; "
                f"those that do: {', '.join(names)}"
            )
        return transport

    @field_validator("request")
    @classmethod
    def _check_request(cls, request: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        # the transport's own request type says what `request` may hold (422 naming the
        # field); ranks decode it again with the same registry function
        transport = info.data.get("transport")  # absent when the transport was refused
        if transport is None:
            return request
        typed = decode_setup_request(transport, request)
        if typed.teardown != cls.teardown:
            route = "/v1/teardown_transport" if typed.teardown else "/v1/setup_transport"
            kind = "tear-down" if typed.teardown else "set-up"
            raise ValueError(f"request: a {kind} request; post it to {route}")
        if not typed.wait_s() <= MAX_UPDATE_TIMEOUT_S:
            raise ValueError(f"request: its bound exceeds {MAX_UPDATE_TIMEOUT_S:g} s")
        _check_sendable("request", request)
        return request


class TeardownTransportRequest(SetupTransportRequest):
    """`POST /v1/teardown_transport` body: every rank of this engine undoes the set-up of
    `transport` (`request`: the transport's tear-down request, e.g. `dist`'s
    `{"action": "destroy"}`)."""

    teardown: ClassVar[bool] = True


class TransportSetupResponse(BaseModel):
    """A transport set-up or tear-down every rank of the engine ran."""

    transport: str
    action: Literal["setup_transport", "teardown_transport"]
    message: str


class InitWeightsGroupRequest(AdminRequest):
    """`POST /v1/init_weights_group` body (SGLang's name for `/v1/setup_transport` with
    `dist`): this engine's ranks join a `dist` weights group as group ranks `rank_offset ..` of
    `world_size` (the publisher, serving the store at `master_addr:master_port`, is rank 0)."""

    master_addr: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2, le=65536)
    backend: Literal["gloo"] = "gloo"
    group_name: str = Field(DEFAULT_GROUP_NAME, pattern=GROUP_NAME_PATTERN)
    timeout_s: float = Field(60.0, gt=0, le=MAX_UPDATE_TIMEOUT_S, allow_inf_nan=False)


class DestroyWeightsGroupRequest(AdminRequest):
    """`POST /v1/destroy_weights_group` body (SGLang's name for `/v1/teardown_transport` with
    `dist`)."""

    group_name: str = Field(DEFAULT_GROUP_NAME, pattern=GROUP_NAME_PATTERN)


class PlaceExpertsRequest(AdminRequest):
    """`POST /v1/experts/place` body: move the experts to `expert_map` (`expert_map[r][s]`: the
    expert that slot `s` of expert-parallel rank `r` holds), or to the map `placement` gives
    over the live map's experts, ranks and redundant slots. Exactly one of the two."""

    expert_map: list[list[int]] | None = None
    placement: str | None = Field(None, json_schema_extra={"enum": list(PLACEMENTS)})

    @field_validator("placement")
    @classmethod
    def _check_placement(cls, placement: str | None) -> str | None:
        if placement is not None and placement not in PLACEMENTS:
            known = ", ".join(PLACEMENTS)
            raise ValueError(f"unknown placement {placement!r}; known: {known}")
        return placement

    @model_validator(mode="after")
    def _check_one(self) -> "PlaceExpertsRequest":
        if (self.expert_map is None) == (self.placement is None):
            raise ValueError("give exactly one of expert_map and placement")
        return self


class ExpertsResponse(BaseModel):
    """`GET /v1/experts` (and the answer of `POST /v1/experts/place`): the live expert map of a
    mixture-of-experts engine."""

    expert_map: list[list[int]] = Field(
        description="expert_map[r][s]: the expert that slot s of expert-parallel rank r holds"
    )
    hash: str = Field(description="xxh3-128 of the map")
    placement: str = Field(description="the placement that gives this map, or custom")
    redundant_experts: int = Field(description="slots beyond one per expert")
    num_experts: int


class ServerInfo(BaseModel):
    """`GET /v1/server_info`: what a publisher needs to know about the engine."""

    tp_size: int
    max_model_len: int
    served_model_name: str


class DraftItem(BaseModel):
    """The draft model served for speculative decoding."""

    version: str = Field(description="the version its weights came with")
    fingerprint: str | None = Field(
        description="its fingerprint as a model of its own (tensor names without 'draft.')"
    )
    bytes: int = Field(0, description="draft bytes rank 0 loaded with that version")
    max_chunk_bytes: int = Field(
        0, description="the most draft bytes rank 0 loaded at once (one bucket's share)"
    )
    load_s: float = Field(0.0, description="seconds rank 0 spent loading them")


class AdapterItem(BaseModel):
    """The LoRA adapter applied to the base model."""

    version: str = Field(description="the version it came with")
    fingerprint: str = Field(description="the fingerprint of its tensors alone")
    base_fingerprint: str = Field(description="the base model it applies to")
    r: int = Field(description="its rank")
    lora_alpha: float
    use_rslora: bool
    scaling: float = Field(description="what B @ A is multiplied by")
    target_modules: list[str]


class UpdateWeightsResponse(BaseModel):
    """A committed update: what the engine now serves and how long the update took; with
    `staged`, a two-phase update staged and verified, waiting for `/v1/commit_weights`."""

    version: str
    fingerprint: str | None
    bytes: int = Field(description="bytes that reached rank 0 through the transport")
    rank_bytes: list[int] = Field(
        default_factory=list,
        description="bytes that reached each rank through the transport, by TP rank (empty "
        "for a rollback or a commit of one)",
    )
    seconds: float
    phases: dict[str, float]
    engine_phases: dict[str, float | bool] | None = Field(
        None,
        exclude_if=lambda phases: phases is None,  # answers without them stay as they were
        description="where the update's time went on the engine, each stretch once "
        "(`weightbus.core.wire.phases.EnginePhases`: verify_s, pause_s, commit_s, resume_s, "
        "paused_first)",
    )
    staged: bool = False
    draft: DraftItem | None = Field(
        None, description="the draft model served once it commits (speculative decoding)"
    )


class ControlResponse(BaseModel):
    """A control action the engine carried out."""

    action: ControlAction | Literal["init_weights_group", "destroy_weights_group", "abort_weights"]
    message: str


class HistoryItem(BaseModel):
    """One committed version (oldest first in `WeightsInfo.history`)."""

    version: str
    step: int | None
    fingerprint: str | None
    committed_at: float
    seconds: float
    bytes: int
    draft: DraftItem | None = None
    adapter: AdapterItem | None = None


class WeightsInfo(BaseModel):
    """`GET /v1/weights`: the engine's weights as rank 0 last reported them."""

    version: str
    step: int | None
    status: WeightsStatus
    fingerprint: str | None
    generation: Literal["running", "paused"]
    released: list[MemoryTag]
    history: list[HistoryItem]
    rollback: HistoryItem | None = Field(
        None, description="the previous version, held for POST /v1/rollback_weights"
    )
    rollback_unavailable: str = Field("", description="why there is no rollback version")
    staged_version: str | None = Field(
        None, description="a two-phase update staged, waiting for its commit or abort"
    )
    waiting_for_initial_weights: bool = False
    two_phase_aborts: int = Field(0, description="staged two-phase updates discarded")
    rollbacks: int = Field(0, description="rollbacks committed")
    draft: DraftItem | None = Field(
        None, description="the draft model served for speculative decoding (None: no draft)"
    )
    adapter: AdapterItem | None = Field(
        None,
        description="the LoRA adapter applied (None: the base alone); `fingerprint` is then "
        "base and adapter's",
    )
    base_fingerprint: str | None = Field(
        None, description="the base model's fingerprint, with or without an adapter"
    )
