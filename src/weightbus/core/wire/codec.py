"""Envelope and codec of wire messages.

A frame is the msgpack array `[protocol_version, message]`; the message is a map tagged with
its type name. Decoding goes through msgspec typed decoders: it builds only the declared
structs and plain values, never runs code, and any malformed, truncated, oversized,
wrong-version or wrong-type input raises `ProtocolError`.
"""

from typing import Any, ClassVar, Self, TypeVar, Union

import msgspec

PROTOCOL_VERSION = 2
# Far above any real message (a bucket of 100k tensors is ~10 MB) and far below memory limits.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ProtocolError(ValueError):
    """Bytes that are not a valid message of this protocol version."""


class Message(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag=True,
    tag_field="type",
):
    """Base of every wire message; subclasses are registered by `register`."""

    registry: ClassVar[dict[str, type["Message"]]] = {}

    def encode(self) -> bytes:
        """This message as one frame."""
        return encode(self)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Self:
        """Decode one frame that must hold a message of this class.

        Raises:
            ProtocolError: the bytes are not a valid frame, or hold another message type.
        """
        message = decode(data)
        if not isinstance(message, cls):
            raise ProtocolError(f"expected a {cls.__name__} message, got {type(message).__name__}")
        return message


MessageClass = TypeVar("MessageClass", bound=type[Message])


def register(message_class: MessageClass) -> MessageClass:
    """Class decorator: make a message type decodable."""
    Message.registry[message_class.__name__] = message_class
    _decoders.clear()
    return message_class


class _Envelope(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    version: int
    body: msgspec.Raw


# msgspec reports bad input as MsgspecError, except invalid UTF-8 in strings, which surfaces
# as UnicodeDecodeError (found by the fuzz tests).
_DECODE_ERRORS = (msgspec.MsgspecError, UnicodeDecodeError)
_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_decoders: dict[str, msgspec.msgpack.Decoder] = {}


def _message_decoder() -> msgspec.msgpack.Decoder:
    decoder = _decoders.get("all")
    if decoder is None:
        union: Any = Union[tuple(Message.registry.values())]  # noqa: UP007 (runtime union of a tuple)
        decoder = _decoders["all"] = msgspec.msgpack.Decoder(union)
    return decoder


def encode(message: Message) -> bytes:
    """Encode a message as one frame."""
    if type(message).__name__ not in Message.registry:
        raise TypeError(f"{type(message).__name__} is not a registered message type")
    return _encoder.encode((PROTOCOL_VERSION, message))


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Decode one frame.

    Raises:
        ProtocolError: not bytes, larger than `MAX_MESSAGE_BYTES`, malformed or truncated
            msgpack, another protocol version, an unknown message type, or fields of the
            wrong type or out of range.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(f"a message must be bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            f"message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE_BYTES} bytes"
        )
    try:
        envelope = _envelope_decoder.decode(data)
    except _DECODE_ERRORS as exc:
        raise ProtocolError(f"malformed message frame: {exc}") from None
    if envelope.version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {envelope.version} is not supported (expected {PROTOCOL_VERSION})"
        )
    try:
        return _message_decoder().decode(envelope.body)
    except _DECODE_ERRORS as exc:
        raise ProtocolError(f"invalid message: {exc}") from None
