"""Typed messages that cross process boundaries, encoded with msgpack (never pickle)."""

from weightbus.wire.codec import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Message,
    ProtocolError,
    decode,
    encode,
)
from weightbus.wire.messages import (
    BucketReady,
    ErrorReply,
    RankVerdict,
    ReceiverHello,
    SlotAck,
    UpdateAbort,
    UpdateBegin,
    UpdateCommit,
    UpdateEnd,
    WireEntry,
    WireMeta,
)

__all__ = [
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "BucketReady",
    "ErrorReply",
    "Message",
    "ProtocolError",
    "RankVerdict",
    "ReceiverHello",
    "SlotAck",
    "UpdateAbort",
    "UpdateBegin",
    "UpdateCommit",
    "UpdateEnd",
    "WireEntry",
    "WireMeta",
    "decode",
    "encode",
]
