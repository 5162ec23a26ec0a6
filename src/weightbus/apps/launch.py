"""The launchers the apps share: `weightbus serve` in a child process, stopped cleanly, and a
trainer's ranks as processes of one torch.distributed group (`run_rank_processes`).

`weightbus demo`, every `weightbus bench` and the tests start their reference engines here, so
no app reaches into another for it.
"""

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from weightbus.engines.vllm.launch import free_port


def start_engine(
    model: str,
    tp: int,
    timeout_s: float = 300.0,
    extra: Sequence[str] = (),
    *,
    prefix: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start `weightbus serve --port 0` (quiet) and return the process and its URL.

    `prefix`: what runs the command (`ip netns exec NAME` for a cluster host; it must exec the
    command, so the server's parent stays this process); `env`: its environment (else ours).

    Raises:
        RuntimeError: the server did not print its URL within `timeout_s`.
    """
    cmd = [sys.executable, "-m", "weightbus", "--log-level", "WARNING", "serve", "--port", "0"]
    cmd.append("--exit-with-parent")  # a killed bench (OOM, Ctrl-C twice) leaves no engine
    proc = subprocess.Popen(  # noqa: S603 - argv is this interpreter and our own command
        [*prefix, *cmd, "--model", model, "--tp", str(tp), *extra],
        stdout=subprocess.PIPE,
        env=None if env is None else dict(env),
    )
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        if not select.select([proc.stdout], [], [], remaining)[0]:
            break
        line = proc.stdout.readline().decode()
        if not line:
            break
        if "serving on " in line:
            return proc, line.split("serving on ", 1)[1].strip()
    stop_engine(proc)
    raise RuntimeError(f"weightbus serve --tp {tp} did not start")


def stop_engine(proc: subprocess.Popen) -> None:
    """SIGTERM the server, then kill it if it has not exited within 30 s."""
    stop_engines([proc])


def stop_engines(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every server at once (they shut down side by side), then wait for each; kill
    one that has not exited within 30 s of its wait."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)  # nothing if it has exited already
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def run_rank_processes(module: str, argument: str, world_size: int, timeout_s: float) -> list[int]:
    """Run `python -m module argument` as ranks `0..world_size-1` of one torch.distributed
    group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: a free port here) and return their exit
    codes; a rank still running after `timeout_s` (from the start) is killed, and so are the
    others.

    Raises:
        subprocess.TimeoutExpired: a rank ran past `timeout_s` (every rank is stopped).
    """
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        subprocess.Popen(  # noqa: S603 - this interpreter and our own module
            [sys.executable, "-m", module, argument],
            env=os.environ | {"RANK": str(rank), "WORLD_SIZE": str(world_size), **master},
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        return [proc.wait(timeout=max(deadline - time.monotonic(), 0.0)) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
