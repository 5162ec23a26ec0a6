"""What travels for `nixl`: a session's description (publisher -> engines, over HTTP) and each
rank's hello (rank -> publisher, on the session's ZMQ socket)."""

from typing import Annotated

import msgspec

from weightbus.core.transport.base import SourceDescription
from weightbus.core.wire import DirectTarget
from weightbus.core.wire.codec import Message, register
from weightbus.core.wire.messages import Hex128, NonNegative

# NIXL agent metadata holds the connection details and memory keys of every registered region
MAX_AGENT_METADATA_BYTES = 16 << 20
AgentName = Annotated[str, msgspec.Meta(pattern=r"^weightbus-[0-9A-Za-z_.-]{1,120}$")]


class NixlDescription(SourceDescription, frozen=True):
    """One `nixl` session, as engine number `group` of the push opens it.

    Attributes:
        endpoint: the publisher's ZMQ socket, `tcp://host:port` (control messages only: the
            bytes travel as NIXL WRITEs).
        session_id: the session's id (messages of other sessions are ignored).
        group: this engine's index among the engines of the push.
    """

    endpoint: Annotated[str, msgspec.Meta(pattern=r"^tcp://[^\s/]{1,255}:[0-9]{1,5}$")]
    session_id: Hex128
    group: NonNegative = 0


@register
class NixlHello(Message, kw_only=True):
    """A rank joins a `nixl` session and offers its parameters for one-sided writes.

    `memory_address` is where the rank's parameter memory (`target`, registered with its NIXL
    agent) starts in the rank's address space; `target` is None when the rank has no
    registered parameter memory, with `refusal` saying why.
    """

    session_id: Hex128
    group: NonNegative
    rank: NonNegative
    tp_size: Annotated[int, msgspec.Meta(ge=1)]
    agent_name: AgentName
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_AGENT_METADATA_BYTES)]
    memory_address: NonNegative = 0
    target: DirectTarget | None = None
    refusal: Annotated[str, msgspec.Meta(max_length=4096)] = ""


@register
class NixlInbox(Message, kw_only=True):
    """A rank offers its inbox for the session: where the tensors it holds no slice of (a
    delta's payload) are written whole.

    Sent after the `UpdateBegin` and before the `DirectReady`, only by a rank whose slice map
    lacks some tensor of the session. `slots` slots of `slot_bytes` each start at `address`
    (registered with the rank's agent, whose metadata, `agent_metadata`, now includes it);
    bucket b lands in slot `b % slots`, and the publisher reuses a slot only once the rank
    acknowledged (`SlotAck`) the bucket it held before.
    """

    session_id: Hex128
    group: NonNegative
    rank: NonNegative
    address: NonNegative
    slot_bytes: NonNegative
    slots: Annotated[int, msgspec.Meta(ge=1)]
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_AGENT_METADATA_BYTES)]
