"""Helpers of the fleet tests: several served engines, their faults, and what they serve."""

import contextlib
import dataclasses
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import torch
from engine_harness import ServedEngine, is_alive, started_together, stopped_together
from update_harness import engine_greedy, weights_state

from weightbus.core.publisher import EngineResult, HttpEngineTarget, UpdateOrder
from weightbus.engines.reference.models.loader import random_hf_weights, tiny_config

# Bound of waiting for an engine to reach a state after a fault (it acts on its own timeout).
SETTLE_TIMEOUT_S = 60.0
SETTLE_POLL_S = 0.1


def tiny_weights(seed: int) -> dict[str, torch.Tensor]:
    """The tiny model's weights of `seed`, as a trainer pushes them."""
    return dict(random_hf_weights(tiny_config(), seed))


@dataclasses.dataclass(frozen=True, slots=True)
class Serving:
    """What an engine serves: its version, fingerprint, greedy tokens and their logprobs."""

    version: str
    fingerprint: str
    tokens: list[int]
    logprobs: list[float]


def serving(engine: ServedEngine) -> Serving:
    state = weights_state(engine)
    assert state["status"] == "NORMAL", state
    assert state["staged_version"] is None, state
    choice = engine_greedy(engine)
    return Serving(
        state["version"],
        state["fingerprint"],
        choice["token_ids"],
        choice["logprobs"]["token_logprobs"],
    )


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Poll `predicate` until it holds (the engine acts on its own timeout), bounded."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {SETTLE_TIMEOUT_S} s: {what}")
        time.sleep(SETTLE_POLL_S)


def engine_pids(engine: ServedEngine) -> list[int]:
    return [engine.proc.pid, *engine.worker_pids]


def signal_engine(engine: ServedEngine, sig: int) -> None:
    """Send `sig` to the API server and every rank of `engine`."""
    for pid in engine_pids(engine):
        if is_alive(pid):
            os.kill(pid, sig)


class Fleet:
    """Served tiny-model engines by name, restarted on demand after a fault killed one."""

    def __init__(self, log_dir: Path, flags: dict[str, tuple[str, ...]]) -> None:
        self.log_dir = log_dir
        self.flags = dict(flags)
        started = started_together(lambda name=name: self._served(name) for name in flags)
        self.engines: dict[str, ServedEngine] = dict(zip(flags, started, strict=True))

    def start(self, name: str, *flags: str) -> ServedEngine:
        if flags:
            self.flags[name] = flags
        self.engines[name] = self._served(name)
        return self.engines[name]

    def _served(self, name: str) -> ServedEngine:
        log_path = self.log_dir / f"{name}-{time.monotonic_ns()}.log"
        return ServedEngine(*self.flags[name], log_path=log_path)

    def ensure_alive(self) -> None:
        for name, engine in list(self.engines.items()):
            if not all(is_alive(pid) for pid in engine_pids(engine)):
                engine.stop()
                self.start(name)

    def stop(self, name: str) -> None:
        self.engines.pop(name).stop()

    def close(self) -> None:
        for engine in self.engines.values():
            signal_engine(engine, signal.SIGCONT)
        stopped_together(self.engines.values())


def corrupted_copy(order: UpdateOrder) -> UpdateOrder:
    """`order` reading its own copy of the disk session, with one byte flipped (the last byte
    of the last tensor's data): the engine's ranks' digest checks must refuse it."""
    session = Path(order.source["path"])
    copy = session.with_name(f"{session.name}-corrupted")
    shutil.copytree(session, copy)
    shard = min(copy.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    return msgspec.structs.replace(order, source={**order.source, "path": str(copy)})


class CorruptingTarget(HttpEngineTarget):
    """An engine whose copy of each disk session has one byte flipped: the bytes it stages
    are corrupted, and its ranks' digest checks must refuse them."""

    def update(self, order: UpdateOrder) -> EngineResult:
        return super().update(corrupted_copy(order))


def kill_midway(engine: ServedEngine, after_calls: int) -> Callable[[int], None]:
    """A push `progress` callback that SIGKILLs `engine` once `after_calls` parts of the
    stream were handed over: the engine dies while it receives."""
    calls = []

    def progress(nbytes: int) -> None:
        calls.append(nbytes)
        if len(calls) == after_calls:
            signal_engine(engine, signal.SIGKILL)

    return progress


@contextlib.contextmanager
def frozen(engine: ServedEngine, freeze: bool = True) -> Iterator[None]:
    """SIGSTOP every process of `engine` for the block (when `freeze`); SIGCONT after."""
    if not freeze:
        yield
        return
    signal_engine(engine, signal.SIGSTOP)
    try:
        yield
    finally:
        signal_engine(engine, signal.SIGCONT)
