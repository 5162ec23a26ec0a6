"""The launcher's stop of its workers: after a requested stop they have `shutdown_timeout_s` to
leave through the TP group; after a failure (a rank died: the group cannot stop them) only
`FAILED_STOP_GRACE_S`, then SIGTERM."""

import signal
import subprocess

import pytest

from weightbus.engines.reference.server.launcher import (
    FAILED_STOP_GRACE_S,
    Launcher,
    ServeConfig,
)


class _StuckWorker:
    """A worker that never exits on its own (a rank in a collective with a dead peer)."""

    pid = 12345

    def __init__(self) -> None:
        self.returncode: int | None = None
        self.waits: list[float] = []

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float) -> int:
        self.waits.append(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired("worker", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:  # what Popen.terminate and Popen.kill call
        self.returncode = -sig


@pytest.mark.parametrize(
    ("stop_requested", "grace_s"), [(True, 10.0), (False, FAILED_STOP_GRACE_S)]
)
def test_stuck_workers_are_terminated_after_the_grace_of_the_stop(stop_requested, grace_s):
    launcher = Launcher(ServeConfig(shutdown_timeout_s=10.0), max_model_len=64)
    launcher.stop_requested = stop_requested
    workers = [_StuckWorker(), _StuckWorker()]
    launcher.procs = workers

    launcher.stop_workers()

    assert [w.returncode for w in workers] == [-signal.SIGTERM] * 2
    # one grace for all the workers, not one each; then the terminated ones are reaped
    assert workers[0].waits[0] == pytest.approx(grace_s, abs=0.5)
    assert workers[1].waits[0] <= workers[0].waits[0]
    assert all(len(w.waits) == 2 for w in workers)
