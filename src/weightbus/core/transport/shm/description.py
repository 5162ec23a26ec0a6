"""What a `shm` session's engines open: the publisher's socket and its slots."""

from typing import Annotated

import msgspec

from weightbus.core.transport.base import SourceDescription
from weightbus.core.transport.parts.shared_memory import SLOT_PREFIX
from weightbus.core.wire.messages import Hex128, NonNegative


class ShmDescription(SourceDescription, frozen=True):
    """One `shm` session, as engine number `group` of the push opens it.

    Attributes:
        endpoint: the publisher's ZMQ socket, an `ipc://` path in a private directory.
        session_id: the session's id (messages of other sessions are ignored).
        slots: names of the publisher's slots under /dev/shm (mapped if the session streams
            through them; a direct session never does).
        slot_bytes: the size of each slot.
        group: this engine's index among the engines of the push.
    """

    endpoint: Annotated[str, msgspec.Meta(max_length=4096)]
    session_id: Hex128
    slots: list[Annotated[str, msgspec.Meta(max_length=255)]]
    slot_bytes: Annotated[int, msgspec.Meta(gt=0)]
    group: NonNegative = 0

    def __post_init__(self) -> None:
        if not self.endpoint.startswith("ipc://"):
            raise ValueError(f"shm endpoint must be an ipc:// address, got {self.endpoint!r}")
        if len(self.slots) < 2:
            raise ValueError("shm source needs a list of at least two slot names")
        for name in self.slots:
            if not name.startswith(SLOT_PREFIX) or "/" in name or "\0" in name:
                raise ValueError(f"{name!r} is not a weightbus shared-memory file")
