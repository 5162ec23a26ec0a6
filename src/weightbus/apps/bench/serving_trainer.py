"""The trainer process of `weightbus bench serving`: pushes a model into one engine every
`push_every_s` seconds until `duration_s` has passed, each as a new version.

`python -m weightbus.apps.bench.serving_trainer CONFIG_JSON`: it loads the model's weights
from `model_dir` (the checkpoint the engine started from) and prints one JSON line per push
(`PushRecord`) on stdout; a failed push is recorded with its error and the pushes go on. It
prints `ready` once loaded, then waits for a line on stdin before its first period starts,
and for another one (the load ended) before it closes its Publisher and exits.
`TrainerProcess` is the bench's side of it.
"""

import json
import select
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec
from safetensors.torch import load_file

from weightbus.core.publisher import Publisher

READY = "ready"


class TrainerConfig(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    engine: str = "reference"  # or `vllm`: pushed through `VllmEngineTarget`
    model_dir: str
    transport: str
    pause_mode: str
    running_kv: str = "keep"
    push_every_s: float
    duration_s: float
    version_prefix: str
    timeout_s: float = 120.0


@dataclass
class PushRecord:
    """One push: its version, wall-clock start and end (`time.time()`), phases, error."""

    version: str
    start_s: float
    end_s: float
    phases: dict[str, float] = field(default_factory=dict)
    error: str | None = None


class TrainerProcess:
    """A trainer process started with `config`: wait for its `ready`, say `go`, read its
    pushes once it exited. Every wait is bounded and names the trainer."""

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.process = subprocess.Popen(  # noqa: S603 - this interpreter and this module
            [sys.executable, "-m", __name__, msgspec.json.encode(config).decode()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def wait_ready(self, timeout_s: float) -> None:
        """Raises: RuntimeError: not ready in `timeout_s`, or it failed to start."""
        assert self.process.stdout is not None
        if not select.select([self.process.stdout], [], [], timeout_s)[0]:
            raise RuntimeError(
                f"the {self.config.pause_mode} trainer was not ready in {timeout_s} s"
            )
        line = self.process.stdout.readline().strip()
        if line != READY:
            raise RuntimeError(
                f"the {self.config.pause_mode} trainer failed to start (said {line!r})"
            )

    def go(self) -> None:
        """Start its push schedule."""
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def pushes(self) -> list[PushRecord]:
        """Say `stop` (the load ended: it may close its Publisher), then return its push
        records once it exited (bounded: its last push's timeout).

        Raises: RuntimeError: it did not exit in time, or it failed.
        """
        timeout_s = self.config.push_every_s + self.config.timeout_s + 60
        try:
            out, _ = self.process.communicate("stop\n", timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(
                f"the {self.config.pause_mode} trainer did not exit {timeout_s:g} s after the load"
            ) from None
        if self.process.returncode != 0:
            raise RuntimeError(
                f"the {self.config.pause_mode} trainer exited with code {self.process.returncode}"
            )
        return [PushRecord(**json.loads(line)) for line in out.splitlines() if line.strip()]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


def run(config: TrainerConfig) -> None:
    weights = load_file(str(Path(config.model_dir) / "model.safetensors"))
    with Publisher(
        [_target(config)], transport=config.transport, timeout_s=config.timeout_s
    ) as pub:
        # started and loaded: the load starts with the first line on stdin, and so does the
        # push schedule (the start-up's CPU time must not fall in the measured window)
        print(READY, flush=True)
        sys.stdin.readline()
        deadline = time.time() + config.duration_s
        next_push = time.time() + config.push_every_s
        index = 0
        while next_push < deadline:
            time.sleep(max(0.0, next_push - time.time()))
            record = _push(pub, weights, f"{config.version_prefix}-{index}", config)
            print(json.dumps(asdict(record)), flush=True)
            index += 1
            next_push = max(next_push + config.push_every_s, time.time())
        # closing the Publisher tears its transport down on the engine (seen: a 0.5 s gap in
        # a 256 MiB model's tokens right after the last push): it waits for the bench's `stop`
        sys.stdin.readline()


def _target(config: TrainerConfig) -> object:
    if config.engine == "reference":
        return config.url
    from weightbus.engines.vllm.target import VllmEngineTarget

    return VllmEngineTarget(config.url)


def _push(pub: Publisher, weights: dict, version: str, config: TrainerConfig) -> PushRecord:
    start = time.time()
    try:
        result = pub.push(
            weights,
            version=version,
            pause_mode=config.pause_mode,
            running_kv=config.running_kv,
            force=True,
        )
    except Exception as exc:  # noqa: BLE001 - a failed push is a row of the report
        return PushRecord(version, start, time.time(), error=f"{type(exc).__name__}: {exc}")
    return PushRecord(version, start, time.time(), dict(result.phases))


if __name__ == "__main__":
    run(msgspec.json.decode(sys.argv[1], type=TrainerConfig))
