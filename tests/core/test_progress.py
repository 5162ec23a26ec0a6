"""The push progress bar: drawn on a terminal once a push outlasts `SHOW_AFTER_S`, else silent."""

import io

import pytest

from weightbus.core.publisher import progress
from weightbus.core.publisher.progress import PushProgress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_nothing_is_drawn() -> None:
    stream = io.StringIO()
    bar = PushProgress("v1", 3_000_000, stream=stream)
    bar.advance(3_000_000)
    bar.close()
    assert not bar.enabled
    assert bar.done_bytes == 3_000_000
    assert stream.getvalue() == ""


def test_a_short_push_draws_nothing() -> None:
    stream = _Terminal()
    bar = PushProgress("v1", 3_000_000, stream=stream)  # SHOW_AFTER_S (1 s) never elapses
    bar.advance(3_000_000)
    bar.close()
    assert stream.getvalue() == ""


def test_a_long_push_draws_bytes_rate_and_eta_on_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)
    stream = _Terminal()
    bar = PushProgress("v1", 3_000_000, stream=stream)
    bar.advance(1_000_000)
    bar.advance(2_000_000)
    bar.close()
    drawn = stream.getvalue()
    assert drawn.startswith("\rpush v1:")
    assert drawn.endswith("\n")
    assert drawn.count("\n") == 1  # redrawn in place
    last = drawn.rsplit("\r", 1)[-1]
    assert "100%" in last
    assert "3.00M/3.00M" in last
    assert "B/s]" in last  # rate
    assert "<00:00" in last  # elapsed<remaining
