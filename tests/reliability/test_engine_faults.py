"""An engine rank SIGKILLed mid-update, and an engine frozen (SIGSTOP) under a push: the
Publisher fails with the reason within its bounds, the engine reports itself (exit code 1 and the
rank's death in its log, or the old weights served after it thaws), nothing is left behind."""

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from engine_harness import (
    ServedEngine,
    children_of,
    is_alive,
    started_together,
    stopped_together,
)
from prometheus_client.parser import text_string_to_metric_families
from update_harness import weights_state

from weightbus import Publisher, PushError
from weightbus.core.publisher.targets.http import HTTP_MARGIN_S
from weightbus.core.transport.parts.shared_memory import ARENA_PREFIX, SHM_DIR
from weightbus.core.transport.shm.sink import ShmSink
from weightbus.core.wire import BucketReady
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import random_hf_weights

# every test starts `weightbus serve` or another process (tiers: tests/conftest.py)
pytestmark = pytest.mark.e2e
PROMPT = [2, 7, 1, 8]
HOLD_TIMEOUT_S = 60.0  # bound of the test's own waits on the publisher it holds


@pytest.fixture(scope="module")
def doomed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServedEngine]]:
    """A fresh `--tp 2` engine for each test that ends one (a rank killed, each rank; one
    frozen), started together; each test stops its own."""
    logs = tmp_path_factory.mktemp("logs")
    names = ["killed-0", "killed-1", "frozen"]
    started = started_together(
        lambda name=name: ServedEngine("--tp", "2", log_path=logs / f"{name}.log") for name in names
    )
    engines = dict(zip(names, started, strict=True))
    yield engines
    stopped_together(engines.values())  # those whose test did not run


def _weights(seed: int) -> list:
    return list(random_hf_weights(tiny_config(), seed))


class _HeldPush:
    """A push (in a thread) whose Publisher stops before bucket 8 until released: the engine
    is then mid-update, with whole tensors already received."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, pub: Publisher) -> None:
        self.reached, self.release = threading.Event(), threading.Event()
        self.error: list[BaseException] = []
        send_all = ShmSink._send_all

        def send_or_hold(sink, receivers, message):
            if isinstance(message, BucketReady) and message.bucket_index == 8:
                self.reached.set()
                self.release.wait(HOLD_TIMEOUT_S)
            send_all(sink, receivers, message)

        monkeypatch.setattr(ShmSink, "_send_all", send_or_hold)
        self.thread = threading.Thread(target=self._push, args=(pub,))
        self.thread.start()
        assert self.reached.wait(HOLD_TIMEOUT_S), "the push never reached bucket 8"

    def _push(self, pub: Publisher) -> None:
        try:
            pub.push(_weights(31), version="held", atomic=False, pause_mode="in_place")
        except PushError as exc:
            self.error.append(exc)

    def finish(self) -> PushError:
        self.release.set()
        self.thread.join(HOLD_TIMEOUT_S)
        assert not self.thread.is_alive(), "the publisher hung"
        [error] = self.error
        return error


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_killed_mid_update_fails_the_push_and_stops_the_engine(monkeypatch, doomed, rank):
    engine = doomed[f"killed-{rank}"]
    workers = engine.worker_pids
    arenas = [path for pid in workers for path in SHM_DIR.glob(f"{ARENA_PREFIX}{pid}-*")]
    try:
        slots = {"direct": False}  # slot mode: the held bucket is a point mid-stream
        with Publisher(
            [engine.url],
            transport="shm",
            bucket_bytes=128 * 1024,
            timeout_s=30,
            transport_options=slots,
        ) as pub:
            held = _HeldPush(monkeypatch, pub)
            assert weights_state(engine)["status"] == "UPDATING"
            os.kill(workers[rank], signal.SIGKILL)
            assert engine.proc.wait(timeout=60) == 1  # the engine stops: it reports, not hangs
            error = held.finish()
        assert error.failures[engine.url].startswith("HTTP 503: ")
    finally:
        engine.stop()
    assert not [pid for pid in workers if is_alive(pid)], "orphan worker"
    assert f"worker rank {rank} exited with code -9" in engine.log_path.read_text()
    with Publisher([engine.url], transport="shm"):  # a new publisher removes dead arenas
        assert not [path for path in arenas if path.exists()], "parameter arena left behind"


def _updates_answered(engine: ServedEngine) -> float:
    for family in text_string_to_metric_families(engine.client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "weightbus_weight_updates_total":
                return sample.value
    raise AssertionError("no weightbus_weight_updates_total in /metrics")


def test_a_frozen_engine_fails_the_fleet_push_naming_it_and_frees_the_healthy_one(engine, doomed):
    frozen = doomed["frozen"]
    processes = [frozen.proc.pid, *children_of(frozen.proc.pid)]
    try:
        before = weights_state(frozen)
        healthy_before = weights_state(engine)
        answered_before = _updates_answered(frozen)
        timeout_s = 3
        with Publisher([engine.url, frozen.url], transport="shm", timeout_s=timeout_s) as pub:
            for pid in processes:
                os.kill(pid, signal.SIGSTOP)
            start = time.monotonic()
            try:
                with pytest.raises(PushError) as raised:
                    pub.push(_weights(32), version="frozen")
            finally:
                for pid in processes:
                    os.kill(pid, signal.SIGCONT)
            elapsed_s = time.monotonic() - start
        # the bound docs/fleet.md states: the stream's timeout, then the HTTP margin for an
        # engine that never answers (generous slack: a bound, not a speed)
        assert elapsed_s < timeout_s + HTTP_MARGIN_S + 20
        reason = str(raised.value)
        assert "ReadTimeout" in raised.value.failures[frozen.url]
        assert (
            "timed out waiting for every engine rank to join; "
            f"not joined: {frozen.url} (no rank joined)"
        ) in reason
        # the healthy engine heard of it at once, is named as aborted, and serves what it served
        assert "publisher failed" in raised.value.failures[engine.url]
        assert raised.value.aborted == [engine.url]
        # counted apart from the frozen one, its reason (an echo of the publisher's) not said
        assert reason.startswith(
            "push of version 'frozen' failed on 1 engine(s) (1 more aborted because of it): "
            f"{frozen.url}: ReadTimeout"
        ), reason
        assert reason.endswith(f"; aborted because of the others: {engine.url}"), reason
        state = weights_state(engine)
        assert (state["status"], state["fingerprint"]) == ("NORMAL", healthy_before["fingerprint"])
        # the thawed engine gets the abandoned request, finds no publisher, keeps the old weights
        deadline = time.monotonic() + 60
        while _updates_answered(frozen) < answered_before + 1:
            assert time.monotonic() < deadline, "the abandoned update was never answered"
        state = weights_state(frozen)
        assert (state["status"], state["version"], state["fingerprint"]) == (
            "NORMAL",
            before["version"],
            before["fingerprint"],
        )
        with Publisher([frozen.url], transport="shm", timeout_s=30) as pub:
            result = pub.push(_weights(33), version="thawed")
        assert weights_state(frozen)["fingerprint"] == result.fingerprint
        assert frozen.complete(prompt=PROMPT, max_tokens=2).status_code == 200
    finally:
        frozen.stop()
