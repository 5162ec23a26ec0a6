"""Deletes a cluster's namespaces when the process that made them dies without doing it.

Run by `hosts.start_cluster` as `python -I watchdog.py NAMESPACE...` in its own session, with a
pipe on stdin that only the cluster's maker holds: the pipe ends when the maker closes the
cluster or dies (SIGKILL included). Then every process left in each namespace is killed and
the namespace deleted (its veths and qdiscs go with it). Standard library only, so it starts
in milliseconds and holds no model memory.
"""

import contextlib
import os
import signal
import subprocess
import sys


def _ip(*args: str) -> str:
    done = subprocess.run(  # noqa: S603 - our own arguments
        ["ip", *args],  # noqa: S607 - iproute2 from PATH
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return done.stdout


def main(names: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C for the maker is not for us
    while sys.stdin.buffer.read(4096):
        pass
    for name in names:
        for pid in _ip("netns", "pids", name).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", name)


if __name__ == "__main__":
    main(sys.argv[1:])
