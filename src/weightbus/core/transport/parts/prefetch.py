"""Run a batch iterator one step ahead in a thread, so receiving overlaps loading."""

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

Item = TypeVar("Item")
_DONE = object()


class Prefetcher(Generic[Item]):
    """Iterates `source` in a background thread, at most `depth` items ahead.

    `get(timeout_s)` returns the next item, raises the exception the source raised, raises
    `StopIteration` at the end and `TimeoutError` when nothing arrived in time.
    """

    def __init__(self, source: Iterator[Item], depth: int = 1, name: str = "prefetch") -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._source = source
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
            except queue.Full:
                continue
            return True
        return False

    def _run(self) -> None:
        try:
            for item in self._source:
                if not self._put(item):
                    return
        except BaseException as exc:  # noqa: BLE001 (handed to the consumer, which re-raises it)
            self._put(exc)
            return
        self._put(_DONE)

    def get(self, timeout_s: float) -> Item:
        try:
            item = self._queue.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            raise TimeoutError(f"nothing arrived within {timeout_s:.1f} s") from None
        if item is _DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (it exits at its next hand-over) and wait up to `timeout_s`."""
        self._stop.set()
        self._thread.join(timeout_s)
