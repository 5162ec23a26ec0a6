"""A one-line progress bar for long pushes (tqdm), shown only when stderr is a terminal."""

import sys
from typing import TextIO

from tqdm import tqdm

# Pushes shorter than this never draw a bar: it would only flicker.
SHOW_AFTER_S = 1.0


class PushProgress:
    """Counts bytes handed to the transport and draws a tqdm bar on a terminal.

    The bar shows bytes (unit-scaled), rate and ETA. Off a terminal (logs, CI, an engine's
    pipes) no bar is created at all.

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
        self._bar = (
            tqdm(
                desc=f"push {version}",
                total=self.total_bytes,
                unit="B",
                unit_scale=True,
                file=self.stream,
                delay=SHOW_AFTER_S,
                leave=True,
                dynamic_ncols=True,
            )
            if self.enabled
            else None
        )

    def advance(self, nbytes: int) -> None:
        """Account for `nbytes` more bytes sent."""
        self.done_bytes += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)

    def close(self) -> None:
        """End the line if one was drawn."""
        if self._bar is not None:
            self._bar.close()
