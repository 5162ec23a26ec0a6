"""Fleet-wide pushes into real engines (TP 1, TP 2, TP 1): all commit or none, rollback,
engines joining and leaving, and load across fleet pushes.

Each fault hits the TP-2 engine before the commit point: its staged bytes corrupted (its ranks'
digests refuse them), SIGKILL once it accepted the update, a 409 refusal, SIGSTOP past the
push's timeout. Then no engine commits: every one serves what it served, token for token, and
the next push succeeds on the survivors.
"""

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from engine_harness import NUM_GREEDY_TOKENS, PROMPT, ServedEngine
from fleet_harness import (
    CorruptingTarget,
    Fleet,
    frozen,
    kill_midway,
    serving,
    tiny_weights,
    wait_until,
)
from update_harness import weights_state

from weightbus import Publisher, PushError
from weightbus.engines.reference.engine.pending_update import PEER_RESOLUTION_S

# Short, so the SIGSTOP case times out quickly; the tiny model stages in milliseconds.
TIMEOUT_S = 5.0
FAULTS = ("corrupt", "sigkill", "refuse", "sigstop")
# What the faulty engine's failure says, per fault.
FAULT_REASONS = {
    "corrupt": "digest mismatch",
    "sigkill": "",  # a dropped connection or a 503, depending on when the kernel reports it
    "refuse": "HTTP 409: step 1 is not above the current step 1000",
    "sigstop": "ReadTimeout",
}
# The SIGKILL case streams through shm slots in small buckets: the engine acks each bucket,
# so it is killed with most of the stream still to come.
SLOTS = {"transport": "shm", "transport_options": {"direct": False}, "bucket_bytes": 16 * 1024}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    started = Fleet(
        tmp_path_factory.mktemp("fleet-logs"),
        {"a": ("--tp", "1"), "b": ("--tp", "2"), "c": ("--tp", "1")},
    )
    yield started
    started.close()


def _publisher(engines: list, tmp_path: Path, **options) -> Publisher:
    options.setdefault("transport_options", {"root": tmp_path})
    return Publisher(engines, timeout_s=TIMEOUT_S, **options)


def _faulty_target(fault: str, engine: ServedEngine, tmp_path: Path):
    if fault == "corrupt":
        return CorruptingTarget(engine.url)
    if fault == "refuse":  # the same weights under a step the fleet push is not above
        with _publisher([engine.url], tmp_path / "alone") as alone:
            version = weights_state(engine)["version"]
            alone.push(tiny_weights(0), version=version, step=1000, force=True)
    return engine.url


def _push_with_fault(fault: str, publisher: Publisher, engine: ServedEngine) -> PushError:
    push = {"weights": tiny_weights(1), "version": f"{fault}-next", "step": 1}
    if fault == "sigkill":
        push["progress"] = kill_midway(engine, after_calls=3)
    with pytest.raises(PushError) as failed, frozen(engine, fault == "sigstop"):
        publisher.push(**push)
    return failed.value


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_before_the_commit_point_commits_nowhere(fleet, tmp_path, fault):
    fleet.ensure_alive()
    a, b, c = (fleet.engines[name] for name in "abc")
    with _publisher([a.url, b.url, c.url], tmp_path) as publisher:
        publisher.push(tiny_weights(0), version=f"{fault}-base")
    before = {name: serving(engine) for name, engine in fleet.engines.items()}
    target = _faulty_target(fault, b, tmp_path)
    options = SLOTS if fault == "sigkill" else {}
    with _publisher([a.url, target, c.url], tmp_path, **options) as publisher:
        error = _push_with_fault(fault, publisher, b)
        assert FAULT_REASONS[fault] in error.failures[b.url], error
        # the others failed only because of it (their stream was abandoned, or the push
        # aborted while they received), or staged and were told to discard
        for url, reason in error.failures.items():
            assert url == b.url or b.url in reason, error
        if fault == "sigstop":  # they staged long before the frozen one timed out
            assert sorted(error.aborted) == sorted([a.url, c.url])
            wait_until(
                lambda: (
                    weights_state(b)["two_phase_aborts"] >= 1
                    and weights_state(b)["status"] == "NORMAL"
                ),
                "the thawed engine discarded its staged version (no decision came)",
            )
        survivors = {"a": a, "c": c} if fault == "sigkill" else fleet.engines
        for name, engine in survivors.items():
            assert serving(engine) == before[name], name
        publisher.remove_engine(b.url)
        result = publisher.push(tiny_weights(2), version=f"{fault}-after", step=2)
    assert result.two_phase
    assert [e.url for e in result.engines] == [a.url, c.url]
    assert {e.fingerprint for e in result.engines} == {result.fingerprint}
    after = serving(a), serving(c)
    assert after[0].tokens == after[1].tokens  # the same weights at the same TP size


def test_rollback_returns_every_engine_to_the_previous_version(fleet, tmp_path):
    fleet.ensure_alive()
    engines = list(fleet.engines.values())
    with _publisher([e.url for e in engines], tmp_path) as publisher:
        publisher.push(tiny_weights(3), version="rb-v1")
        previous = [serving(e) for e in engines]
        pushed = publisher.push(tiny_weights(4), version="rb-v2")
        assert all(serving(e).tokens != p.tokens for e, p in zip(engines, previous, strict=True))
        result = publisher.rollback()
        assert (result.version, result.fingerprint, result.two_phase) == (
            "rb-v1",
            previous[0].fingerprint,
            True,
        )
        assert [serving(e) for e in engines] == previous
        assert publisher.fleet_version.version == "rb-v1"
        with pytest.raises(PushError) as refused:
            publisher.rollback()
    reason = (
        "no previous version is held: version 'rb-v1' was restored by a rollback from "
        "'rb-v2'; a rollback does not undo another"
    )
    assert refused.value.failures == dict.fromkeys([e.url for e in engines], reason)
    assert pushed.fingerprint != result.fingerprint
    for engine in engines:
        metrics = engine.client.get("/metrics").text
        assert "weightbus_rollbacks_total 1.0" in metrics
        assert "weightbus_rollback_available 0.0" in metrics


# A trainer that dies at the commit point of a two-phase push: it commits `commits` engines
# (0 or 1), says so, and SIGKILLs itself before sending any other commit.
_DYING_TRAINER = textwrap.dedent(
    """
    import os, signal, sys, threading
    from weightbus import Publisher
    from weightbus.core.publisher import HttpEngineTarget
    from weightbus.engines.reference.models.loader import random_hf_weights, tiny_config

    urls, commits, version = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]
    lock, sent = threading.Lock(), []
    commit = HttpEngineTarget.commit
    def commit_then_die(self, *args):
        with lock:  # the other commits wait here and die with the process, unsent
            if len(sent) < commits:
                commit(self, *args)
                sent.append(self.url)
            print("killed", *sent, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    HttpEngineTarget.commit = commit_then_die

    with Publisher(urls, transport="shm", timeout_s=TIMEOUT_S) as publisher:
        publisher.push(list(random_hf_weights(tiny_config(), 40 + commits)), version=version)
    """
).replace("TIMEOUT_S", str(TIMEOUT_S))


def _trainer_dies_at_commit(engines: list[ServedEngine], commits: int, version: str) -> list:
    """Run the dying trainer; the URLs it committed before its SIGKILL."""
    urls = ",".join(e.url for e in engines)
    trainer = subprocess.run(
        [sys.executable, "-c", _DYING_TRAINER, urls, str(commits), version],
        stdout=subprocess.PIPE,
        text=True,
        timeout=120,
        check=False,
    )
    assert trainer.returncode == -9, trainer
    killed, *committed = trainer.stdout.split()
    assert killed == "killed"
    return committed


def _settled(engines: list[ServedEngine], what: str) -> float:
    """Seconds until no engine holds a staged version any more."""
    start = time.monotonic()
    wait_until(lambda: all(weights_state(e)["staged_version"] is None for e in engines), what)
    return time.monotonic() - start


def test_trainer_killed_after_its_first_commit_the_peers_commit_the_rest(fleet):
    fleet.ensure_alive()
    engines = list(fleet.engines.values())
    (committed,) = _trainer_dies_at_commit(engines, commits=1, version="split-guard")
    waited_s = _settled(engines, "the staged engines settled with their peers")
    after = {name: serving(engine) for name, engine in fleet.engines.items()}
    first = next(s for n, s in after.items() if fleet.engines[n].url == committed)
    assert {(s.version, s.fingerprint) for s in after.values()} == {
        ("split-guard", first.fingerprint)
    }
    assert after["a"].tokens == after["c"].tokens  # the same weights at the same TP size
    assert waited_s < TIMEOUT_S + PEER_RESOLUTION_S  # the bound docs/fleet.md states
    for name, engine in fleet.engines.items():
        if engine.url != committed:
            assert "as the fleet's peers say" in engine.log_path.read_text(), name


def test_trainer_killed_before_any_commit_every_engine_discards(fleet):
    fleet.ensure_alive()
    engines = list(fleet.engines.values())
    before = {name: serving(engine) for name, engine in fleet.engines.items()}
    aborts = {name: weights_state(e)["two_phase_aborts"] for name, e in fleet.engines.items()}
    assert _trainer_dies_at_commit(engines, commits=0, version="never-committed") == []
    _settled(engines, "the staged engines discarded, no peer having committed")
    for name, engine in fleet.engines.items():
        assert serving(engine) == before[name], name
        assert weights_state(engine)["two_phase_aborts"] == aborts[name] + 1, name


def test_an_engine_joins_and_one_leaves_while_pushes_go_on(fleet, tmp_path):
    fleet.ensure_alive()
    a, b, c = (fleet.engines[name] for name in "abc")
    newcomer = fleet.start("d", "--tp", "2", "--seed", "7", "--wait-for-initial-weights")
    try:
        _check_waiting(newcomer)
        with _publisher([a.url, b.url, c.url], tmp_path) as publisher:
            publisher.push(tiny_weights(5), version="join-1", step=1)
            with pytest.raises(ValueError, match="is not the fleet's version 'join-1'"):
                publisher.add_engine(newcomer.url, tiny_weights(6))
            assert weights_state(newcomer)["status"] == "WAITING"  # nothing was sent
            caught_up = publisher.add_engine(newcomer.url, tiny_weights(5))
            assert caught_up.fingerprint == publisher.fleet_version.fingerprint
            assert serving(newcomer) == serving(b)  # same weights, same TP size
            result = publisher.push(tiny_weights(6), version="join-2", step=2)
            assert [e.url for e in result.engines] == [a.url, b.url, c.url, newcomer.url]
            publisher.remove_engine(a.url)
            result = publisher.push(tiny_weights(7), version="join-3", step=3)
            assert [e.url for e in result.engines] == [b.url, c.url, newcomer.url]
        assert weights_state(a)["version"] == "join-2"  # it left: it keeps what it served
        assert serving(newcomer).fingerprint == result.fingerprint
    finally:
        fleet.stop("d")


def _check_waiting(engine: ServedEngine) -> None:
    state = weights_state(engine)
    assert (state["status"], state["waiting_for_initial_weights"]) == ("WAITING", True)
    assert engine.client.get("/health").json()["waiting_for_initial_weights"] is True
    response = engine.complete(prompt=PROMPT, max_tokens=2)
    assert response.status_code == 503
    assert response.json()["error"]["message"].startswith("waiting for its initial weights")


def test_dist_group_reforms_when_an_engine_joins_or_leaves(fleet, tmp_path):
    fleet.ensure_alive()
    a, c = fleet.engines["a"], fleet.engines["c"]
    newcomer = fleet.start("d", "--tp", "1", "--wait-for-initial-weights")
    try:
        with Publisher([a.url, c.url], transport="dist", timeout_s=30) as publisher:
            publisher.init_weights_group("127.0.0.1")
            publisher.push(tiny_weights(8), version="dist-1")
            publisher.add_engine(newcomer.url, tiny_weights(8))
            result = publisher.push(tiny_weights(9), version="dist-2")
            assert [e.url for e in result.engines] == [a.url, c.url, newcomer.url]
            assert serving(newcomer) == serving(a)
            publisher.remove_engine(c.url)  # the group re-forms over the other two
            result = publisher.push(tiny_weights(10), version="dist-3")
        assert [e.url for e in result.engines] == [a.url, newcomer.url]
        assert weights_state(c)["version"] == "dist-2"
    finally:
        fleet.stop("d")


class _Clients:
    """One client thread per engine sends greedy completions back to back."""

    def __init__(self, engines: list[ServedEngine]) -> None:
        self.answers: list[tuple[float, int, dict | None]] = []  # (sent at, status, body)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(e.url,)) for e in engines]

    def __enter__(self) -> "_Clients":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _run(self, url: str) -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while not self._stop.is_set():
                sent_at = time.monotonic()
                try:
                    response = http.post(
                        "/v1/completions",
                        json={"prompt": PROMPT, "max_tokens": NUM_GREEDY_TOKENS, "temperature": 0},
                    )
                    answer = (sent_at, response.status_code, response.json())
                except (httpx.HTTPError, ValueError) as exc:
                    answer = (sent_at, -1, {"error": repr(exc)})
                with self._lock:
                    self.answers.append(answer)


def test_no_completion_lost_across_fleet_pushes(fleet, tmp_path):
    fleet.ensure_alive()
    engines = list(fleet.engines.values())
    returned: list[tuple[float, str]] = []  # (when the push returned, its version)
    with (
        _publisher([e.url for e in engines], tmp_path, bucket_bytes=64 * 1024) as publisher,
        _Clients(engines) as clients,
    ):
        for k in range(10):
            result = publisher.push(tiny_weights(20 + k), version=f"load-{k}")
            returned.append((time.monotonic(), result.version))
    failed = [a for a in clients.answers if a[1] != 200]
    assert not failed, failed[:3]
    assert len(clients.answers) > 30
    order = [version for _, version in returned]
    for sent_at, _, body in clients.answers:
        newest_before = [v for t, v in returned if t < sent_at]
        if not newest_before:
            continue
        (span,) = body["choices"][0]["weight_versions"]  # drain: one version per completion
        assert span["version"] in order
        assert order.index(span["version"]) >= order.index(newest_before[-1]), (span, sent_at)


def test_in_place_pushes_stay_one_phase(fleet, tmp_path):
    fleet.ensure_alive()
    engines = list(fleet.engines.values())
    with _publisher([e.url for e in engines], tmp_path) as publisher:
        result = publisher.push(tiny_weights(30), version="in-place", atomic=False)
        assert not result.two_phase
        with pytest.raises(ValueError, match="two_phase needs atomic=True"):
            publisher.push(tiny_weights(31), version="x", atomic=False, two_phase=True)


def test_removing_an_unknown_or_the_last_engine_is_refused(tmp_path):
    with _publisher(["http://127.0.0.1:9"], tmp_path) as publisher:
        with pytest.raises(ValueError, match="is not a member"):
            publisher.remove_engine("http://127.0.0.1:10")
        with pytest.raises(ValueError, match="is the last member"):
            publisher.remove_engine("http://127.0.0.1:9")
