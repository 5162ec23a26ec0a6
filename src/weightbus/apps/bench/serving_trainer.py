"""The trainer process of `weightbus bench serving`: pushes a model into one engine every
`push_every_s` seconds until `duration_s` has passed, each as a new version.

`python -m weightbus.apps.bench.serving_trainer CONFIG_JSON`: it loads the model's weights
from `model_dir` (the checkpoint the engine started from) and prints one JSON line per push
(`PushRecord`) on stdout; a failed push is recorded with its error and the pushes go on. It
prints `ready` once loaded, then waits for a line on stdin before its first period starts.
"""

import json
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


def run(config: TrainerConfig) -> None:
    weights = load_file(str(Path(config.model_dir) / "model.safetensors"))
    with Publisher([config.url], transport=config.transport, timeout_s=config.timeout_s) as pub:
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
