"""A one-line progress bar for long pushes, shown only when stderr is a terminal."""

import sys
import time
from typing import TextIO

from weightbus.units import format_bytes

# Pushes shorter than this never draw a bar: it would only flicker.
SHOW_AFTER_S = 1.0


class PushProgress:
    """Counts bytes handed to the transport and redraws one status line on a terminal.

    Args:
        version: the version being pushed (shown in the line).
        total_bytes: bytes of the whole push.
        stream: where to draw; nothing is drawn unless it is a terminal.
    """

    def __init__(self, version: str, total_bytes: int, stream: TextIO | None = None) -> None:
        self.version = version
        self.total_bytes = max(total_bytes, 1)
        self.done_bytes = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self.started = time.monotonic()
        self.drawn = False

    def advance(self, nbytes: int) -> None:
        """Account for `nbytes` more bytes sent."""
        self.done_bytes += nbytes
        if self.enabled and time.monotonic() - self.started >= SHOW_AFTER_S:
            self._draw()

    def _draw(self) -> None:
        fraction = min(self.done_bytes / self.total_bytes, 1.0)
        bar = "#" * int(30 * fraction)
        line = (
            f"\rpush {self.version} [{bar:<30}] {100 * fraction:5.1f}% "
            f"{format_bytes(self.done_bytes)} / {format_bytes(self.total_bytes)}"
        )
        self.stream.write(line)
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        """End the line if one was drawn."""
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
