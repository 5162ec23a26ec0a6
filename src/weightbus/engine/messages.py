"""Messages between the API server and rank 0, as msgspec structs over msgpack (never pickle).

API server -> rank 0: `AddRequest`, `AbortRequest`, `Shutdown`.
Rank 0 -> API server: `Ready` once, then `StepOutputs` after every step, `RequestError` when a
request cannot run. Decoding checks every field's type; unknown tags are rejected.
"""

import msgspec

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


class AbortRequest(msgspec.Struct, tag="abort", frozen=True):
    request_id: str


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


class Ready(msgspec.Struct, tag="ready", frozen=True):
    protocol_version: int
    tp_size: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    weight_version: str


class TokenOutput(msgspec.Struct, frozen=True):
    request_id: str
    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    finish_reason: str | None = None


class StepOutputs(msgspec.Struct, tag="outputs", frozen=True):
    weight_version: str
    outputs: list[TokenOutput]


class RequestError(msgspec.Struct, tag="error", frozen=True):
    request_id: str
    message: str


ToEngine = AddRequest | AbortRequest | Shutdown
FromEngine = Ready | StepOutputs | RequestError

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(message: ToEngine | FromEngine) -> bytes:
    """msgpack bytes of a message."""
    return _encoder.encode(message)


def decode_to_engine(data: bytes) -> ToEngine:
    """Decode a message for rank 0.

    Raises:
        msgspec.DecodeError: malformed bytes or an unknown message.
    """
    return _to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    """Decode a message for the API server.

    Raises:
        msgspec.DecodeError: malformed bytes or an unknown message.
    """
    return _from_engine.decode(data)
