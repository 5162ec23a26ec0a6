"""Progress bars: `weightbus push` and the bench suites draw one on a terminal (a pseudo-terminal
here), none in a pipe or with `--quiet`; `Publisher(progress=True)` draws each push's bytes."""

import fcntl
import io
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

import pytest
from safetensors.torch import save_file

from weightbus import Publisher, PushError
from weightbus.apps import progress
from weightbus.apps.progress import RoundsProgress, StepsProgress
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import random_hf_weights

# every test runs `python -m weightbus` or pushes into the shared engine (tiers: tests/conftest.py)
pytestmark = pytest.mark.e2e

TIMEOUT_S = 120.0
MARK = "=== command"

# Several `weightbus` commands in one interpreter (its start-up is most of a command's time), each
# run by the CLI's own entry point, after a line that marks where its output starts.
_COMMANDS = textwrap.dedent(
    f"""
    import json, sys
    from weightbus.apps.cli import main
    for index, args in enumerate(json.loads(sys.argv[1])):
        print("{MARK}", index, flush=True)
        main(args)
        sys.stderr.flush()
    """
)


def _on_pty(commands: list[list[str]]) -> list[str]:
    """What each of `commands` (`weightbus` arguments) drew on a pseudo-terminal holding stdout
    and stderr."""
    main_fd, sub_fd = pty.openpty()
    # 120 columns: a terminal of size 0x0 would leave tqdm no room to draw
    fcntl.ioctl(sub_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    child = subprocess.Popen(
        [sys.executable, "-c", _COMMANDS, json.dumps(commands)],
        stdin=subprocess.DEVNULL,
        stdout=sub_fd,
        stderr=sub_fd,
    )
    os.close(sub_fd)
    drawn = bytearray()
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if not select.select([main_fd], [], [], 1.0)[0]:
                continue
            try:
                chunk = os.read(main_fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            drawn += chunk
        code = child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
        os.close(main_fd)
    text = drawn.decode(errors="replace")
    assert code == 0, text
    return [part.split("\n", 1)[1] for part in text.split(MARK)[1:]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("checkpoint")
    save_file(dict(random_hf_weights(tiny_config(), 31)), str(path / "model.safetensors"))
    return path


def _push(engine, checkpoint: Path, version: str, *more: str) -> list[str]:
    return ["push", "--engine", engine.url, "--from", str(checkpoint), "--version", version, *more]


BENCH = ["bench", "buckets", "--size", "4MiB", "--bucket-bytes", "1MiB", "--repeat", "2"]


@pytest.fixture(scope="module")
def terminal(engine, checkpoint) -> dict[str, str]:
    """What each command drew on a terminal, by version (the bench suite: `bench`)."""
    stamp = time.monotonic_ns()
    versions = [f"{name}-{stamp}" for name in ("bar", "small", "quiet-first", "quiet-after")]
    bar, small, quiet_first, quiet_after = versions
    commands = [
        _push(engine, checkpoint, bar, "--progress-min-bytes", "0"),
        _push(engine, checkpoint, small),  # under the 1 GiB default
        ["--quiet", *_push(engine, checkpoint, quiet_first, "--progress-min-bytes", "0")],
        [*_push(engine, checkpoint, quiet_after, "--progress-min-bytes", "0"), "--quiet"],
        BENCH,
    ]
    return dict(zip([*versions, "bench"], _on_pty(commands), strict=True))


def test_push_draws_bytes_and_rate_on_a_terminal(terminal):
    version = next(name for name in terminal if name.startswith("bar-"))
    # the last redraw: bytes done of the total, [elapsed<remaining, rate]
    last = rf"push {version}: 100%\|[^\r\n]*\| 12\.7M/12\.7M \[[0-9:]+<00:00, [0-9.]+[kMG]?B/s\]"
    assert re.search(last, terminal[version]), terminal[version]
    assert f'"version": "{version}"' in terminal[version]
    # the checkpoint's read came first, with its own bar
    read = r"read \S+: 100%\|[^\r\n]*\| 12\.7M/12\.7M \["
    assert re.search(read, terminal[version].split(f"push {version}:")[0]), terminal[version]


@pytest.mark.parametrize("case", ["small", "quiet-first", "quiet-after"])
def test_a_small_or_quiet_push_draws_no_bar_on_a_terminal(terminal, case):
    version = next(name for name in terminal if name.startswith(f"{case}-"))
    assert f'"version": "{version}"' in terminal[version]
    assert "B/s" not in terminal[version]
    assert f"push {version}:" not in terminal[version]
    assert "read " not in terminal[version]


def test_push_draws_no_bar_in_a_pipe(engine, checkpoint):
    version = f"pipe-{time.monotonic_ns()}"
    push = _push(engine, checkpoint, version, "--progress-min-bytes", "0")
    done = subprocess.run(
        [sys.executable, "-m", "weightbus", *push],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f'"version": "{version}"' in done.stdout
    assert "B/s" not in done.stderr + done.stdout
    assert "\r" not in done.stderr


def test_a_bench_suite_shows_its_round_and_row_on_a_terminal(terminal):
    drawn = terminal["bench"]
    assert "warm-up" in drawn
    assert "round 2/2" in drawn
    assert "floor: memcpy" in drawn.split("round 1/2", 1)[1]  # a row's name beside its round


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("where", ["pipe", "quiet"])
def test_rounds_draw_nothing_in_a_pipe_or_quiet(where, monkeypatch):
    stream = io.StringIO() if where == "pipe" else _Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(progress, "_quiet", where == "quiet")
    with RoundsProgress(rows=2, repeat=1) as rounds:
        for index in range(2):
            rounds.row(index, "a row")
            rounds.row(index, "another")
    assert stream.getvalue() == ""


def test_rounds_draw_the_round_and_row_running(monkeypatch):
    stream = _Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(progress, "_quiet", False)
    with RoundsProgress(rows=2, repeat=3, label="8 MiB") as rounds:
        rounds.row(0, "floor")
        assert stream.getvalue().rsplit("\r", 1)[-1].startswith("8 MiB warm-up:   0%")
        rounds.row(2, "shm")
        assert "8 MiB round 2/3:  12%" in stream.getvalue()
        assert stream.getvalue().rstrip().endswith("shm]")
    assert stream.getvalue().endswith("\n")


def test_publisher_progress_draws_each_push_and_closes_a_failed_one(engine, monkeypatch):
    stream = _Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    weights = list(random_hf_weights(tiny_config(), 32))
    counted: list[int] = []
    version = f"in-process-{time.monotonic_ns()}"
    with Publisher([engine.url], progress=True, timeout_s=60) as publisher:
        result = publisher.push(weights, version=version, progress=counted.append)
        drawn = stream.getvalue()
        assert drawn.endswith("\n")
        assert drawn.rsplit("\r", 1)[-1].startswith(f"push {version}: 100%")
        assert sum(counted) == result.nbytes  # the bar's bytes are the callback's
        stream.seek(0)
        stream.truncate()
        with pytest.raises(PushError, match="already being served"):
            publisher.push(weights, version=version)
        assert stream.getvalue().endswith("\n")  # closed with the push
    with Publisher([engine.url], timeout_s=60) as publisher:
        stream.seek(0)
        stream.truncate()
        publisher.push(weights, version=f"no-bar-{time.monotonic_ns()}")
    assert stream.getvalue() == ""


def test_steps_draw_the_step_running_and_nothing_in_a_pipe(monkeypatch):
    monkeypatch.setattr(progress, "_quiet", False)
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    with StepsProgress(3, label="bench serving") as steps:
        steps.step("warm-up")
    assert piped.getvalue() == ""
    stream = _Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    with StepsProgress(3, label="bench serving") as steps:
        steps.step("warm-up")
        assert stream.getvalue().rsplit("\r", 1)[-1].startswith("bench serving:   0%")
        steps.step("drain")
        assert "bench serving:  33%" in stream.getvalue()
        assert stream.getvalue().rstrip().endswith("drain]")
    assert stream.getvalue().endswith("\n")
