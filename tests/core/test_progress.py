"""The push progress bar (`Publisher(progress=True)`): drawn on a terminal only."""

import io

from weightbus.core.publisher.progress import PushProgress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_no_bar_is_made() -> None:
    assert PushProgress.on_terminal("v1", 3_000_000, stream=io.StringIO()) is None


def test_a_push_draws_bytes_rate_and_eta_on_one_line() -> None:
    stream = _Terminal()
    bar = PushProgress.on_terminal("v1", 3_000_000, stream=stream)
    assert bar is not None
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
