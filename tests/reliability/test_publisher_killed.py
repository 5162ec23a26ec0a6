"""A Publisher SIGKILLed at each point of a co-located push: before the first bucket, between
buckets, after the last bucket (before its end), after the commit. The engine must give up within
its timeout, never serve a half-written model, and accept the next Publisher's push.

Outcomes (the contract in docs/reliability.md):
- atomic: the update lands only with the Publisher's end message, so the old weights stay served;
- in place: once bytes may have reached the live parameters (a bucket was delivered, or a direct
  session began: the Publisher writes the parameters itself), the engine is FAILED (503) until a
  good push lands; before that it keeps serving the old weights.
"""

import subprocess
import sys
import textwrap
import time

import pytest
from engine_harness import ServedEngine
from update_harness import weights_state

from weightbus import Publisher
from weightbus.core.transport.parts.shared_memory import SHM_DIR, SLOT_PREFIX
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import random_hf_weights

PROMPT = [5, 6, 7]
ENGINE_TIMEOUT_S = 3  # the killed Publisher's timeout_s: how long the engine waits for it

# The Publisher runs in its own process and stops at `phase`: it prints the phase, then
# waits for the SIGKILL. `after_commit` kills itself once the push returned. Between buckets
# it stops before bucket 8 of ~100: with two slots, buckets 0-6 have been acked, so whole
# tensors (the 512 KiB embedding first) are in the live parameters of an in-place update.
_PUBLISHER = textwrap.dedent(
    """
    import os, signal, sys, threading
    import weightbus.core.transport.shm.sink as shm
    import weightbus.core.transport.shm.direct as shm_direct
    from weightbus import Publisher
    from weightbus.engines.reference.models.config import tiny_config
    from weightbus.engines.reference.models.loader import random_hf_weights
    from weightbus.core.wire import BucketReady, UpdateEnd

    url, mode, phase, atomic = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "atomic"
    stop_at = {
        "before_first_bucket": lambda m: isinstance(m, BucketReady) and m.bucket_index == 0,
        "between_buckets": lambda m: isinstance(m, BucketReady) and m.bucket_index == 8,
        "after_last_bucket": lambda m: isinstance(m, UpdateEnd),
    }.get(phase, lambda m: False)

    def stop():
        print(phase, flush=True)
        threading.Event().wait()

    send_all = shm.ShmSink._send_all
    def send_or_stop(self, receivers, message):
        if stop_at(message):
            stop()
        send_all(self, receivers, message)
    shm.ShmSink._send_all = send_or_stop

    write = shm_direct.DirectWriter.write
    def write_or_stop(self, *args, **kwargs):
        if phase == "before_first_bucket":
            stop()
        return write(self, *args, **kwargs)
    shm_direct.DirectWriter.write = write_or_stop

    weights = list(random_hf_weights(tiny_config(), 21))
    options = {"direct": mode == "direct"}
    bucket_bytes = 128 * 1024
    with Publisher(
        [url], transport="shm", bucket_bytes=bucket_bytes, timeout_s=TIMEOUT_S,
        transport_options=options,
    ) as pub:
        result = pub.push(weights, version="doomed", atomic=atomic, pause_mode="in_place")
        print("after_commit", result.fingerprint, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """
).replace("TIMEOUT_S", str(ENGINE_TIMEOUT_S))

PHASES = ["before_first_bucket", "between_buckets", "after_last_bucket"]
CASES = [
    *[("slots", phase) for phase in PHASES],
    ("direct", "before_first_bucket"),
    ("direct", "after_last_bucket"),
]


def _greedy_logprobs(engine: ServedEngine) -> list[float]:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "logprobs": 1}
    response = engine.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["token_logprobs"]


def _settled_state(engine: ServedEngine, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (state := weights_state(engine))["status"] == "UPDATING":
        assert time.monotonic() < deadline, "the engine never gave up on the dead publisher"
    return state


def _run_publisher(engine: ServedEngine, mode: str, phase: str, atomic: bool) -> tuple:
    """Start the Publisher, wait for it to reach `phase`, SIGKILL it; (pid, its last line)."""
    publisher = subprocess.Popen(
        [sys.executable, "-c", _PUBLISHER, engine.url, mode, phase, "atomic" if atomic else "-"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = publisher.stdout.readline().split()
    finally:
        publisher.kill()
        publisher.wait(10)
    assert line, "the publisher exited before its phase"
    assert line[0] == phase
    return publisher.pid, line


def _slots_of(pid: int) -> set[str]:
    return {path.name for path in SHM_DIR.glob(f"{SLOT_PREFIX}{pid}-*")}


def _recover(engine: ServedEngine, version: str) -> str:
    with Publisher([engine.url], transport="shm", timeout_s=30) as pub:
        result = pub.push(list(random_hf_weights(tiny_config(), 22)), version=version)
    return result.fingerprint


@pytest.mark.parametrize(("mode", "phase"), CASES, ids=[f"{m}-{p}" for m, p in CASES])
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in_place"])
def test_killed_publisher_never_leaves_a_half_written_model_served(engine, mode, phase, atomic):
    before = _settled_state(engine)
    expected_logprobs = _greedy_logprobs(engine)
    pid, _ = _run_publisher(engine, mode, phase, atomic)
    stale_slots = _slots_of(pid)
    state = _settled_state(engine)
    bytes_may_have_landed = phase != "before_first_bucket" or mode == "direct"
    if atomic or not bytes_may_have_landed:
        assert (state["status"], state["version"], state["fingerprint"]) == (
            "NORMAL",
            before["version"],
            before["fingerprint"],
        )
        assert _greedy_logprobs(engine) == expected_logprobs
    else:
        assert state["status"] == "FAILED"
        refused = engine.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert refused.status_code == 503
    # the next Publisher removes the dead one's slots and its push brings the engine back
    fingerprint = _recover(engine, f"recovered-{mode}-{phase}-{atomic}")
    assert not stale_slots & {path.name for path in SHM_DIR.glob(f"{SLOT_PREFIX}*")}
    state = weights_state(engine)
    assert (state["status"], state["fingerprint"]) == ("NORMAL", fingerprint)


def test_publisher_killed_after_the_commit_leaves_the_new_version_served(engine):
    _settled_state(engine)
    pid, line = _run_publisher(engine, "direct", "after_commit", atomic=True)
    state = weights_state(engine)
    assert (state["status"], state["version"], state["fingerprint"]) == (
        "NORMAL",
        "doomed",
        line[1],
    )
    _recover(engine, "after-commit-kill")
    assert not _slots_of(pid)


# A `nixl` Publisher stops before posting the WRITEs of bucket 8: buckets 0-7 were written
# into the ranks' parameters (a direct session: they count as touched from its header on).
_NIXL_PUBLISHER = textwrap.dedent(
    """
    import sys, threading
    import weightbus.core.transport.nixl.writes as writes
    from weightbus import Publisher
    from weightbus.engines.reference.models.config import tiny_config
    from weightbus.engines.reference.models.loader import random_hf_weights

    url, atomic = sys.argv[1], sys.argv[2] == "atomic"
    post = writes.BucketWrites._post
    def post_or_stop(self, bucket, buffer):
        if bucket.index == 8:
            print("between_buckets", flush=True)
            threading.Event().wait()
        post(self, bucket, buffer)
    writes.BucketWrites._post = post_or_stop

    weights = list(random_hf_weights(tiny_config(), 21))
    with Publisher([url], transport="nixl", bucket_bytes=128 * 1024, timeout_s=TIMEOUT_S) as pub:
        pub.push(weights, version="doomed", atomic=atomic, pause_mode="in_place")
    """
).replace("TIMEOUT_S", str(ENGINE_TIMEOUT_S))


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in_place"])
def test_killed_nixl_publisher_mid_write_as_direct_mode(engine, atomic):
    before = _settled_state(engine)
    expected_logprobs = _greedy_logprobs(engine)
    publisher = subprocess.Popen(
        [sys.executable, "-c", _NIXL_PUBLISHER, engine.url, "atomic" if atomic else "-"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert publisher.stdout.readline().split() == ["between_buckets"]
    finally:
        publisher.kill()
        publisher.wait(10)
    state = _settled_state(engine)
    if atomic:  # the writes went into the staging copy: the old version serves on
        assert (state["status"], state["fingerprint"]) == ("NORMAL", before["fingerprint"])
        assert _greedy_logprobs(engine) == expected_logprobs
    else:  # the live parameters were half written: nothing is served from them
        assert state["status"] == "FAILED"
        refused = engine.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert refused.status_code == 503
    with Publisher([engine.url], transport="nixl", timeout_s=30) as pub:
        result = pub.push(list(random_hf_weights(tiny_config(), 22)), version=f"nixl-{atomic}")
    state = weights_state(engine)
    assert (state["status"], state["fingerprint"]) == ("NORMAL", result.fingerprint)
