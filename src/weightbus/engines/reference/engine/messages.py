"""Messages between the API server and rank 0, as msgspec structs over msgpack (never pickle).

API server -> rank 0: `AddRequest`, `AbortRequest`, `Shutdown`, `UpdateWeights`, `Control`,
`TransportSetup`, `Decide` (commit or abort a two-phase update), `Rollback`, `AskOutcome`
(what became of a two-phase version: the fleet's peers resolving it without the trainer),
`PlaceExperts` (move a mixture-of-experts model's experts to a new expert map).
Rank 0 -> API server: `Ready` once, then `StepOutputs` after every step, `RequestError` when a
request cannot run, `Aborted` when the engine ends requests itself (pause mode `abort`, memory
release), `UpdateResult` answering `UpdateWeights`, `Decide` and `Rollback`, `ControlResult`
answering `Control` (and `TransportSetup`, `PlaceExperts`), `WeightsState` whenever the
weights' version, status or memory changes (and once after Ready), and `LayoutChanged` when
the ranks' slice maps change (an expert re-placement; `Ready` carries the first ones).
Decoding checks every field's type; unknown tags are rejected.
"""

from typing import Any, Literal

import msgspec

from weightbus.core.wire import PauseMode, UpdateOrder
from weightbus.core.wire.adapter import AdapterSpec
from weightbus.core.wire.messages import SliceSpec
from weightbus.core.wire.phases import EnginePhases

PROTOCOL_VERSION = 1


class AddRequest(msgspec.Struct, tag="add", frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None = None
    num_logprobs: int | None = None
    ignore_eos: bool = False
    prompt_logprobs: bool = False


class AbortRequest(msgspec.Struct, tag="abort", frozen=True):
    request_id: str


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


class ExpertsInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A mixture-of-experts engine's live expert map (`GET /v1/experts`): `expert_map[r][s]`
    is the expert that slot `s` of expert-parallel rank `r` holds; `placement` names the
    placement that gives this map (`linear`, `round_robin`) or is `custom`."""

    num_experts: int
    expert_map: list[list[int]]
    hash: str
    placement: str
    redundant_experts: int


class Ready(msgspec.Struct, tag="ready", frozen=True):
    protocol_version: int
    tp_size: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    weight_version: str
    # each rank's slice of every tensor (`GET /v1/weights/layout`: what a delta's publisher
    # digests per rank)
    rank_slices: list[list[SliceSpec]] = msgspec.field(default_factory=list)
    experts: ExpertsInfo | None = None  # the live expert map (None: a dense model)


class LayoutChanged(msgspec.Struct, tag="layout_changed", frozen=True, kw_only=True):
    """The ranks' slice maps changed (the experts moved to the map `experts`): what
    `GET /v1/weights/layout` and `GET /v1/experts` answer from now on. Sent before the
    `ControlResult` that answers the `PlaceExperts`."""

    rank_slices: list[list[SliceSpec]]
    experts: ExpertsInfo


class TokenOutput(msgspec.Struct, frozen=True):
    request_id: str
    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    finish_reason: str | None = None
    # on a sequence's first token when it asked: each prompt token's logprob given the ones
    # before it (None for the first)
    prompt_logprobs: list[float | None] | None = None
    # the first token after the sequence's whole KV was computed again on the weights of its
    # step (an in-place push with running_kv "recompute")
    kv_recomputed: bool = False


class StepOutputs(msgspec.Struct, tag="outputs", frozen=True):
    """The tokens of one step, in order (a speculative step may bring several per request).

    `num_draft_tokens` / `num_accepted_tokens`: draft tokens proposed and kept in the step
    (0 without speculative decoding). `num_prefix_queries` / `num_prefix_hits`: prompt tokens
    the step's admissions looked up in the prefix cache and found there.
    """

    weight_version: str
    outputs: list[TokenOutput]
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0


class RequestError(msgspec.Struct, tag="error", frozen=True):
    request_id: str
    message: str


MemoryTag = Literal["kv_cache", "weights"]
# WAITING: started with --wait-for-initial-weights and no version pushed yet.
WeightsStatus = Literal["NORMAL", "UPDATING", "CLEARING", "CLEARED", "FAILED", "WAITING"]


class UpdateWeights(UpdateOrder, tag="update", frozen=True, kw_only=True):
    """Receive a new weights version (`POST /v1/update_weights`): the publisher's `UpdateOrder`
    as the API server validated it, with an `update_id` (32 hex digits) it draws; ranks use the
    id in their verdicts.

    With `two_phase` (atomic only) rank 0 answers once every rank staged and verified the
    version (`UpdateResult.staged`) and swaps only on a `Decide` to commit. With `delta` the
    stream carries changes to the version served, which must be `delta.base_fingerprint`.
    """

    update_id: str


class Decide(msgspec.Struct, tag="decide", frozen=True, kw_only=True):
    """Commit or abort the two-phase update (or rollback) of `version` that rank 0 holds staged;
    answered with an `UpdateResult` whose `update_id` is this `request_id`. A commit names the
    staged `fingerprint` it expects (None: any)."""

    request_id: str
    version: str
    decision: Literal["commit", "abort"]
    fingerprint: str | None = None
    reason: str = ""
    timeout_s: float = 60.0
    by_peers: bool = False  # decided by the fleet's peers: passes the fence of `AskOutcome`


Outcome = Literal["committed", "staged", "receiving", "absent"]


class AskOutcome(msgspec.Struct, tag="ask_outcome", frozen=True, kw_only=True):
    """What became of the two-phase update of `version` here: answered with an `UpdateResult`
    (`update_id` = this `request_id`) whose `outcome` is `committed` (served, in the history, or
    its commit under way), `staged` (waiting for its decision), `receiving` or `absent`.

    Asking fences a staged update: from then on only a `Decide` with `by_peers` commits it (a
    late commit from the trainer is refused), so the peers' answers stay true while they
    decide.
    """

    request_id: str
    version: str
    fingerprint: str | None = None


class Rollback(msgspec.Struct, tag="rollback", frozen=True, kw_only=True):
    """Swap back to the previous version, which the staging memory still holds (no bytes move).

    `version` / `fingerprint`, when set, are what the caller expects to return to (an engine
    holding another previous version refuses). Answered with an `UpdateResult`.
    """

    update_id: str
    version: str | None = None
    fingerprint: str | None = None
    pause_mode: PauseMode = "drain"
    two_phase: bool = False
    timeout_s: float = 60.0


class Control(msgspec.Struct, tag="control", frozen=True, kw_only=True):
    """Pause/continue generation or release/resume memory."""

    request_id: str
    action: Literal["pause", "continue", "release", "resume"]
    mode: PauseMode = "drain"
    tags: list[MemoryTag] = msgspec.field(default_factory=list)


class TransportSetup(msgspec.Struct, tag="transport_setup", frozen=True, kw_only=True):
    """Set transport `transport` up (or tear it down) on every rank: each rank decodes `request`
    with the registry's `decode_setup_request` and runs the transport's `rank_setup`.

    Answered with a `ControlResult`.
    """

    request_id: str
    transport: str
    request: dict[str, Any]


class PlaceExperts(msgspec.Struct, tag="place_experts", frozen=True, kw_only=True):
    """Move the experts to `expert_map` (`POST /v1/experts/place`, validated by the API
    server against the live map): every rank moves its live and staging experts at the same
    step boundary. Answered with a `ControlResult` (409 while a push, a transport set-up, a
    rollback or a memory release is in flight)."""

    request_id: str
    expert_map: list[list[int]]


class DraftInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The draft model an engine serves: the version its weights came with, their fingerprint
    as a model of their own (names without `draft.`), and how rank 0 loaded them (bytes, the
    largest chunk loaded at once, seconds; zero for the weights it started with)."""

    version: str
    fingerprint: str | None
    nbytes: int = 0
    max_chunk_bytes: int = 0
    load_s: float = 0.0


class AdapterInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The LoRA adapter an engine applies: the version it came with, the fingerprint of its
    tensors alone, and its spec (rank, alpha, targets, the base it belongs to)."""

    version: str
    fingerprint: str
    spec: AdapterSpec


class UpdateResult(msgspec.Struct, tag="update_result", frozen=True, kw_only=True):
    """Outcome of an `UpdateWeights`; `status_code` is the HTTP status to answer with.

    200: committed. 400: the pushed data was wrong (`names` lists the offending tensors).
    409: an update is running, or the version/step is not new. 504: the update timed out.
    503: the engine cannot take updates (memory released). `staged`: a two-phase update is
    staged and verified, and waits for its `Decide`. `nbytes`: the bytes that reached rank 0
    through the transport; `rank_nbytes[r]`: those that reached rank r (on a push's staged
    and committed answers; empty otherwise).
    """

    update_id: str
    status_code: int
    version: str
    fingerprint: str | None = None
    nbytes: int = 0
    rank_nbytes: list[int] = msgspec.field(default_factory=list)
    seconds: float = 0.0
    phases: dict[str, float] = msgspec.field(default_factory=dict)
    engine_phases: EnginePhases | None = None  # where the update's time went (`EnginePhases`)
    error: str | None = None
    names: list[str] = msgspec.field(default_factory=list)
    staged: bool = False
    draft: DraftInfo | None = None  # the draft served once this update commits
    outcome: Outcome | None = None  # the answer to an `AskOutcome`


class ControlResult(msgspec.Struct, tag="control_result", frozen=True, kw_only=True):
    request_id: str
    status_code: int
    message: str = ""


class HistoryEntry(msgspec.Struct, frozen=True, kw_only=True):
    version: str
    step: int | None
    fingerprint: str | None
    committed_at: float
    seconds: float
    nbytes: int
    draft: DraftInfo | None = None  # with speculative decoding: the draft served with it
    adapter: AdapterInfo | None = None  # the LoRA adapter applied with it


class WeightsState(msgspec.Struct, tag="weights", frozen=True, kw_only=True):
    """The engine's weights as `GET /v1/weights` reports them."""

    version: str
    step: int | None
    status: WeightsStatus
    fingerprint: str | None
    generation: Literal["running", "paused"]
    released: list[MemoryTag]
    history: list[HistoryEntry]
    rollback: HistoryEntry | None = None  # the previous version, still held in staging memory
    rollback_unavailable: str = ""  # why there is no rollback version
    staged_version: str | None = None  # a two-phase update waiting for its decision
    two_phase_aborts: int = 0  # staged two-phase updates discarded (aborted or expired)
    rollbacks: int = 0  # rollbacks committed
    draft: DraftInfo | None = None  # with speculative decoding: the draft model served
    adapter: AdapterInfo | None = None  # the LoRA adapter applied (None: the base alone)
    base_fingerprint: str | None = None  # the base model's, with or without an adapter


class SettleWithPeers(msgspec.Struct, tag="settle_with_peers", frozen=True, kw_only=True):
    """Rank 0 heard no decision on its staged two-phase `version` within `timeout_s`: the API
    server asks `peers` what became of it and answers with a `Decide` (`by_peers`) within
    `PEER_RESOLUTION_S`, else rank 0 discards it."""

    version: str
    fingerprint: str | None
    peers: list[str]
    timeout_s: float


class Aborted(msgspec.Struct, tag="aborted", frozen=True):
    """The engine ended these requests itself (finish_reason "abort", with `reason`)."""

    request_ids: list[str]
    reason: str


ToEngine = (
    AddRequest
    | AbortRequest
    | Shutdown
    | UpdateWeights
    | Control
    | TransportSetup
    | Decide
    | Rollback
    | AskOutcome
    | PlaceExperts
)
FromEngine = (
    Ready
    | StepOutputs
    | RequestError
    | UpdateResult
    | ControlResult
    | WeightsState
    | Aborted
    | SettleWithPeers
    | LayoutChanged
)

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(message: ToEngine | FromEngine) -> bytes:
    """msgpack bytes of a message."""
    return _encoder.encode(message)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes) -> Any:
    try:
        return decoder.decode(data)
    except UnicodeDecodeError as exc:
        # msgspec reports invalid UTF-8 in a string this way, not as a DecodeError
        raise msgspec.DecodeError(f"invalid UTF-8 in a string: {exc}") from None


def decode_to_engine(data: bytes) -> ToEngine:
    """Decode a message for rank 0.

    Raises:
        msgspec.DecodeError: malformed bytes (invalid UTF-8 included) or an unknown message.
    """
    return _decode(_to_engine, data)


def decode_from_engine(data: bytes) -> FromEngine:
    """Decode a message for the API server.

    Raises:
        msgspec.DecodeError: malformed bytes (invalid UTF-8 included) or an unknown message.
    """
    return _decode(_from_engine, data)
