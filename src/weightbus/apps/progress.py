"""Progress bars of the command line (tqdm, on stderr): `weightbus push` of a large checkpoint
and the bench suites' rounds. Off when stderr is not a terminal, or with `--quiet`."""

import argparse
import sys

from tqdm import tqdm

# `weightbus push` draws a bar from this many bytes on (`--progress-min-bytes`).
PUSH_PROGRESS_MIN_BYTES = 1 << 30

_quiet = False


def add_quiet_flag(parser: argparse.ArgumentParser, *, command: bool = True) -> None:
    """`--quiet` on `parser`. On a command's parser it leaves the value `weightbus --quiet`
    set alone unless given again (argparse copies a subcommand's defaults over the top's)."""
    parser.add_argument(
        "--quiet",
        action="store_true",
        default=argparse.SUPPRESS if command else False,
        help="draw no progress bars",
    )


def set_quiet(quiet: bool) -> None:
    """Draw no progress bars in this process (`--quiet`)."""
    global _quiet  # noqa: PLW0603 - one switch for the whole command, like tqdm's own `disable`
    _quiet = quiet


def bars_on() -> bool:
    """Whether progress bars are drawn: stderr is a terminal and `--quiet` was not given."""
    return not _quiet and sys.stderr.isatty()


class StepsProgress:
    """A suite's steps, run one after another, as one bar: which step runs now. Call `step`
    as each starts (the previous one is done). Draws nothing unless `bars_on()`.

    Args:
        total: the steps to run.
        label: what is measured, shown before the bar.
        unit: what a step is called on the bar.
    """

    def __init__(self, total: int, label: str = "", unit: str = "step") -> None:
        self._bar = (
            tqdm(total=total, unit=unit, file=sys.stderr, dynamic_ncols=True, desc=label or None)
            if bars_on()
            else None
        )
        self._running = False

    def __enter__(self) -> "StepsProgress":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def step(self, name: str, description: str | None = None) -> None:
        """Step `name` starts (the previous one is done); `description` replaces the label."""
        if self._bar is None:
            return
        if self._running:
            self._bar.update(1)
        self._running = True
        if description is not None:
            self._bar.set_description_str(description, refresh=False)
        self._bar.set_postfix_str(name)

    def close(self) -> None:
        """The last step is done: draw the final state and end the line."""
        if self._bar is not None:
            if self._running:
                self._bar.update(1)
            self._bar.close()
            self._bar = None


class RoundsProgress(StepsProgress):
    """A bench suite's interleaved rounds as one bar: which round runs, and which row.

    Call `row` as each row starts; round 0 is the untimed warm-up. Draws nothing unless
    `bars_on()`.

    Args:
        rows: rows per round.
        repeat: timed rounds (after the warm-up round).
        label: what is measured (e.g. a size), shown before the round.
    """

    def __init__(self, rows: int, repeat: int, label: str = "") -> None:
        super().__init__(rows * (repeat + 1), unit="row")
        self.repeat = repeat
        self.label = f"{label} " if label else ""

    def row(self, round_index: int, name: str) -> None:
        """Row `name` of round `round_index` starts (the previous row is done)."""
        round_name = f"round {round_index}/{self.repeat}" if round_index else "warm-up"
        self.step(name, description=f"{self.label}{round_name}")
