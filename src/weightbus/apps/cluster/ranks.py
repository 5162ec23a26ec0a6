"""Trainer processes on cluster hosts (`rank.py`, one per host), commanded together.

Every command goes to every rank at once (a sharded push is collective) and each rank answers
one JSON line; a rank that does not answer within the command's timeout is named.
"""

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from weightbus.apps.cluster.hosts import HOST_ENV, Cluster, Host
from weightbus.engines.vllm.launch import free_port

_START_TIMEOUT_S = 300.0


class RankError(RuntimeError):
    """A rank answered a command with an error, or not at all (`answers`: those read)."""

    def __init__(self, message: str, answers: list[dict]) -> None:
        super().__init__(message)
        self.answers = answers


class TrainerRanks:
    """One trainer process per host in `hosts` (rank i on `hosts[i]`), holding `spec`."""

    def __init__(self, cluster: Cluster, hosts: Sequence[Host], spec: Mapping) -> None:
        self.hosts = list(hosts)
        port = str(free_port())
        argv = [sys.executable, "-m", "weightbus.apps.cluster.rank", json.dumps(dict(spec))]
        self.procs = []
        for rank, host in enumerate(self.hosts):
            env = {
                **os.environ,
                **HOST_ENV,
                "RANK": str(rank),
                "WORLD_SIZE": str(len(self.hosts)),
                "MASTER_ADDR": self.hosts[0].address,
                "MASTER_PORT": port,
            }
            self.procs.append(
                cluster.popen(
                    host, argv, env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
                )
            )
        self.answers(_START_TIMEOUT_S, "start")

    def command(self, op: str, timeout_s: float = 600.0, **fields: object) -> list[dict]:
        """Send `op` to every rank; their answers, by rank.

        Raises:
            RankError: a rank failed (its error) or did not answer within `timeout_s`.
        """
        self.send(op, **fields)
        return self.answers(timeout_s, op)

    def send(self, op: str, **fields: object) -> None:
        """Send `op` to every rank without waiting (`answers` collects them)."""
        line = json.dumps({"op": op, **fields}) + "\n"
        for proc in self.procs:
            proc.stdin.write(line)
            proc.stdin.flush()

    def answers(self, timeout_s: float, op: str) -> list[dict]:
        """Every rank's answer to the last command sent, by rank (`answered_at`: when it was
        read, `time.monotonic()`).

        Raises:
            RankError: a rank failed (its error) or did not answer within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        answers: list[dict] = []
        for rank in range(len(self.procs)):
            answers.append(self.answer(rank, deadline - time.monotonic(), op, answers))
        errors = [f"rank {r}: {a['error']}" for r, a in enumerate(answers) if not a["ok"]]
        if errors:
            raise RankError(f"{op}: " + "; ".join(errors), answers)
        return answers

    def answer(self, rank: int, timeout_s: float, op: str, read: list | None = None) -> dict:
        """Rank `rank`'s answer to the last command (ok or not).

        Raises:
            RankError: it did not answer within `timeout_s`, or exited.
        """
        proc = self.procs[rank]
        if not select.select([proc.stdout], [], [], max(0.0, timeout_s))[0]:
            raise RankError(
                f"{op}: trainer rank {rank} (host {self.hosts[rank].index}) did not answer "
                f"within {timeout_s:.0f} s",
                read or [],
            )
        text = proc.stdout.readline()
        if not text:
            raise RankError(f"{op}: trainer rank {rank} exited ({proc.wait()})", read or [])
        return {**json.loads(text), "answered_at": time.monotonic()}

    def close(self) -> None:
        """Close every rank's stdin (it closes its publishers and exits); kill the laggards."""
        for proc in self.procs:
            proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def __enter__(self) -> "TrainerRanks":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
