"""`shm` into real co-located engines: one copy, two engines, bit-exact; a killed publisher."""

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from engine_harness import ServedEngine
from update_harness import weights_state

from weightbus import Publisher
from weightbus.core.transport.parts.shared_memory import SHM_DIR, SLOT_PREFIX
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import random_hf_weights

PROMPT = [4, 2, 42]
# `engines` (tests/core/pushes/conftest.py): the reference engine starts with these weights; the
# others receive them
SEED = 5


def _greedy(engine: ServedEngine) -> dict:
    body = {
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0.0,
        "logprobs": 2,
        "ignore_eos": True,
    }
    response = engine.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _slot_files() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"{SLOT_PREFIX}*")}


@pytest.mark.parametrize("mode", ["direct", "slots"])
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in_place"])
def test_one_push_updates_two_engines_bit_exactly(engines, atomic, mode):
    targets = [engines["tp2"], engines["tp1"]]
    reference = engines["reference_tp2"]
    weights = list(random_hf_weights(tiny_config(), SEED))
    # 64 KiB buckets: the 512 KiB embedding travels in chunks (slot mode)
    with Publisher(
        [e.url for e in targets],
        transport="shm",
        bucket_bytes=64 * 1024,
        timeout_s=60,
        transport_options={"direct": mode == "direct"},
    ) as pub:
        slots_before = None
        # three rounds: atomic pushes alternate between two parameter arenas
        for round_index in range(3):
            version = f"seed{SEED}-{atomic}-{mode}-{round_index}"
            result = pub.push(weights, version=version, atomic=atomic)
            assert result.mode == f"shm {mode}"
            slots_before = slots_before or _slot_files()
            assert _slot_files() == slots_before  # the same slots serve every push
    expected = weights_state(reference)["fingerprint"]
    assert result.fingerprint == expected
    assert [e.fingerprint for e in result.engines] == [expected, expected]
    for engine in targets:
        assert weights_state(engine)["fingerprint"] == expected
    # same weights, same TP: bit-identical logprobs; another TP size: the same tokens
    want = _greedy(reference)
    got_tp2, got_tp1 = _greedy(engines["tp2"]), _greedy(engines["tp1"])
    assert got_tp2["token_ids"] == want["token_ids"]
    assert got_tp2["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]
    assert got_tp1["token_ids"] == want["token_ids"]
    assert got_tp1["logprobs"]["token_logprobs"] == pytest.approx(
        want["logprobs"]["token_logprobs"], abs=1e-4
    )
    assert not slots_before & _slot_files()  # closed publisher: its slots are gone


_PUBLISHER = textwrap.dedent(
    """
    import sys
    from weightbus import Publisher
    from weightbus.engines.reference.models.config import tiny_config
    from weightbus.engines.reference.models.loader import random_hf_weights

    weights = list(random_hf_weights(tiny_config(), 11))
    slots = {"direct": False}  # slot mode makes its slots before the push is sent
    with Publisher([sys.argv[1]], transport="shm", timeout_s=3, transport_options=slots) as pub:
        print("ready", flush=True)  # imports done: the push starts on the test's word
        sys.stdin.readline()
        pub.push(weights, version="doomed", atomic=False)
    """
)


def test_killed_publisher_engine_times_out_keeps_serving_and_next_push_works(engines):
    engine = engines["tp2"]
    before = weights_state(engine)
    expected = _greedy(engine)
    publisher = subprocess.Popen(
        [sys.executable, "-c", _PUBLISHER, engine.url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    # the publisher's start-up (seconds) must not eat the long completion's time
    assert select.select([publisher.stdout], [], [], 60)[0], "the publisher did not start"
    assert publisher.stdout.readline() == b"ready\n"
    running = threading.Thread(
        target=lambda: engine.complete(prompt=PROMPT, max_tokens=400, ignore_eos=True)
    )
    running.start()
    assert engine.complete(prompt=[1], max_tokens=1).status_code == 200  # the long one runs
    publisher.stdin.write(b"go\n")
    publisher.stdin.flush()
    deadline = time.monotonic() + 60
    while weights_state(engine)["status"] != "UPDATING":
        assert time.monotonic() < deadline, "the push never reached the engine"
    os.kill(publisher.pid, signal.SIGKILL)  # mid-push: slots made, nothing streamed
    assert running.is_alive(), "the long completion ended before the kill: the push may have landed"
    publisher.wait(10)
    publisher.stdin.close()
    publisher.stdout.close()
    stale = {name for name in _slot_files() if name.startswith(f"{SLOT_PREFIX}{publisher.pid}-")}
    assert len(stale) == 2
    running.join(60)
    deadline = time.monotonic() + 30
    while (state := weights_state(engine))["status"] == "UPDATING":
        assert time.monotonic() < deadline, "the engine never gave up on the dead publisher"
    assert (state["status"], state["version"], state["fingerprint"]) == (
        "NORMAL",
        before["version"],
        before["fingerprint"],
    )
    assert _greedy(engine)["logprobs"] == expected["logprobs"]
    with Publisher([engine.url], transport="shm", timeout_s=30) as pub:
        assert not stale & _slot_files()  # the dead publisher's slots were removed
        result = pub.push(list(random_hf_weights(tiny_config(), 12)), version="after-kill")
    assert weights_state(engine)["fingerprint"] == result.fingerprint


_HANGING_DIRECT_PUBLISHER = textwrap.dedent(
    """
    import sys, threading
    import weightbus.core.transport.shm.direct as shm_direct
    from weightbus import Publisher
    from weightbus.engines.reference.models.config import tiny_config
    from weightbus.engines.reference.models.loader import random_hf_weights

    write_tensor, hang = shm_direct._write_tensor, threading.Event()
    first = threading.Lock()  # the pool writes tensors in parallel: say it once

    def write_then_hang(full, dests, *options):
        result = write_tensor(full, dests, *options)
        if first.acquire(blocking=False):
            print("written", flush=True)  # one tensor is in the live parameters now
        hang.wait()  # the publisher stalls mid-write until the test kills it
        return result

    shm_direct._write_tensor = write_then_hang
    with Publisher([sys.argv[1]], transport="shm", timeout_s=3) as pub:
        pub.push(
            list(random_hf_weights(tiny_config(), 13)),
            version="half-written",
            atomic=False,
            pause_mode="in_place",
        )
    """
)


def test_publisher_killed_mid_direct_write_fails_closed_until_a_good_push(engines):
    engine = engines["tp1"]
    publisher = subprocess.Popen(
        [sys.executable, "-c", _HANGING_DIRECT_PUBLISHER, engine.url], stdout=subprocess.PIPE
    )
    try:
        assert publisher.stdout.readline() == b"written\n"
    finally:
        os.kill(publisher.pid, signal.SIGKILL)
        publisher.wait(10)
    deadline = time.monotonic() + 30
    while (state := weights_state(engine))["status"] == "UPDATING":
        assert time.monotonic() < deadline, "the engine never gave up on the dead publisher"
    # in place and half-written: never served, until a good version lands
    assert state["status"] == "FAILED"
    assert engine.complete(prompt=PROMPT, max_tokens=2).status_code == 503
    with Publisher([engine.url], transport="shm", timeout_s=30) as pub:
        result = pub.push(list(random_hf_weights(tiny_config(), 14)), version="recovered")
    assert result.mode == "shm direct"
    state = weights_state(engine)
    assert (state["status"], state["fingerprint"]) == ("NORMAL", result.fingerprint)
    assert engine.complete(prompt=PROMPT, max_tokens=2).status_code == 200
