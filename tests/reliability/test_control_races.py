"""Admin calls that race each other and the requests they govern: pause/continue from many
clients, a push during a memory release and a release during a push. Every call gets an answer
(200 or 409 with a reason) well inside its bound, and no request is lost."""

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from engine_harness import ServedEngine
from update_harness import weights_state

from weightbus import Publisher, PushError
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import random_hf_weights

PROMPT = [3, 1, 4, 1, 5]
# A control call answers at once or when running requests have finished (a few seconds here);
# far below the server's own bound (request_timeout_s + 10 s), so a lost reply fails the test.
CALL_TIMEOUT_S = 60.0


def _weights(seed: int) -> list:
    return list(random_hf_weights(tiny_config(), seed))


def _control(engine: ServedEngine, route: str, body: dict) -> httpx.Response:
    return engine.client.post(route, json=body, timeout=CALL_TIMEOUT_S)


def _wait_for(engine: ServedEngine, predicate, what: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not predicate(state := weights_state(engine)):
        assert time.monotonic() < deadline, f"the engine never reached {what}: {state}"
    return state


def _long_request(engine: ServedEngine, results: list, max_tokens: int = 200) -> threading.Thread:
    def run() -> None:
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
        results.append(engine.client.post("/v1/completions", json=body, timeout=120))

    thread = threading.Thread(target=run)
    thread.start()
    # admitted in arrival order: once a later one-token request is done, the long one runs
    assert engine.complete(prompt=[1], max_tokens=1).status_code == 200
    return thread


def _assert_finished(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] in ("length", "abort"), choice
    if choice["finish_reason"] == "abort":
        assert choice["abort_reason"] == "generation paused (mode abort)"


def test_pause_and_continue_from_many_clients_answer_every_call_and_lose_no_request(engine):
    rng = random.Random(0)
    calls = [
        rng.choice(
            [
                ("/v1/pause_generation", {"mode": "drain"}),
                ("/v1/pause_generation", {"mode": "in_place"}),
                ("/v1/pause_generation", {"mode": "abort"}),
                ("/v1/continue_generation", {}),
            ]
        )
        for _ in range(40)
    ]
    body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}
    with ThreadPoolExecutor(max_workers=12) as pool:
        requests = [
            pool.submit(engine.client.post, "/v1/completions", json=body, timeout=120)
            for _ in range(16)
        ]
        answers = list(pool.map(lambda call: _control(engine, *call), calls))
        final = _control(engine, "/v1/continue_generation", {})
        completions = [future.result(timeout=CALL_TIMEOUT_S) for future in requests]
    for answer in [*answers, final]:
        assert answer.status_code in (200, 409), answer.text
        if answer.status_code == 409:
            assert answer.json()["error"]["message"].startswith("pause cancelled by")
    assert final.status_code == 200
    assert weights_state(engine)["generation"] == "running"
    for completion in completions:
        _assert_finished(completion)


def test_a_push_during_a_memory_release_is_409_and_the_release_completes(engine):
    with Publisher([engine.url], transport="shm", timeout_s=30) as pub:
        pub.push(_weights(1), version="release-base", force=True)
        results: list = []
        running = _long_request(engine, results)
        releasing = ThreadPoolExecutor(max_workers=1)
        release = releasing.submit(_control, engine, "/v1/release_memory", {"tags": ["kv_cache"]})
        _wait_for(engine, lambda s: s["status"] == "CLEARING", "CLEARING")
        with pytest.raises(PushError, match="HTTP 409: a memory release is in progress") as err:
            pub.push(_weights(2), version="during-release")
        # the Publisher stops waiting for the refusing engine's ranks at once, not at timeout_s
        transport_error = err.value.transport_error
        assert f"engine {engine.url} answered before the stream ended" in transport_error
        assert release.result(timeout=CALL_TIMEOUT_S).status_code == 200  # after the request
        running.join(CALL_TIMEOUT_S)
        releasing.shutdown()
        _assert_finished(results[0])
        state = weights_state(engine)
        assert (state["status"], state["version"]) == ("CLEARED", "release-base")
        assert _control(engine, "/v1/resume_memory", {"tags": ["kv_cache"]}).status_code == 200
        result = pub.push(_weights(2), version="after-release")
    state = weights_state(engine)
    assert (state["status"], state["fingerprint"]) == ("NORMAL", result.fingerprint)


def test_a_memory_release_during_a_push_is_409_and_the_push_lands(engine):
    results: list = []
    with Publisher([engine.url], transport="shm", timeout_s=60) as pub:
        pub.push(_weights(3), version="push-base", force=True)
        running = _long_request(engine, results)
        pushing = ThreadPoolExecutor(max_workers=1)
        # drain: the update waits for the running request, so it is in flight meanwhile
        push = pushing.submit(pub.push, _weights(4), version="pushed", pause_mode="drain")
        _wait_for(engine, lambda s: s["status"] == "UPDATING", "UPDATING")
        refused = _control(engine, "/v1/release_memory", {"tags": ["weights"]})
        assert refused.status_code == 409
        assert refused.json()["error"]["message"] == "an update or release is in progress"
        result = push.result(timeout=CALL_TIMEOUT_S)
        pushing.shutdown()
    running.join(CALL_TIMEOUT_S)
    _assert_finished(results[0])
    assert results[0].json()["choices"][0]["weight_version"] == "push-base"
    state = weights_state(engine)
    assert (state["status"], state["fingerprint"]) == ("NORMAL", result.fingerprint)
