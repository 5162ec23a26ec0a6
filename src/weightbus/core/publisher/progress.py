"""A one-line progress bar of a push (tqdm), drawn only when stderr is a terminal."""

import sys
from typing import TextIO

from tqdm import tqdm


class PushProgress:
    """A tqdm bar of the bytes handed to the transport: bytes (unit-scaled), rate and ETA.

    `Publisher(progress=True)` draws one per push. Off a terminal (logs, CI, pipes) none is
    made at all (`on_terminal`), so such a push pays nothing per part.

    Args:
        version: the version being pushed (shown in the line).
        total_bytes: bytes of the whole push (its plan's).
        stream: where to draw.
    """

    def __init__(self, version: str, total_bytes: int, stream: TextIO) -> None:
        self._bar = tqdm(
            desc=f"push {version}",
            total=max(total_bytes, 1),
            unit="B",
            unit_scale=True,
            file=stream,
            leave=True,
            dynamic_ncols=True,
        )

    @classmethod
    def on_terminal(
        cls, version: str, total_bytes: int, stream: TextIO | None = None
    ) -> "PushProgress | None":
        """A bar on `stream` (default: stderr) if it is a terminal, else None."""
        stream = stream if stream is not None else sys.stderr
        return cls(version, total_bytes, stream) if stream.isatty() else None

    def advance(self, nbytes: int) -> None:
        """Account for `nbytes` more bytes handed to the transport."""
        self._bar.update(nbytes)

    def close(self) -> None:
        """Draw the final state and end the line."""
        self._bar.close()
