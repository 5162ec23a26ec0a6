"""Admin routes and completions against a scripted rank 0 over real ZMQ sockets and real HTTP.

The scripted rank 0 (`fake_rank0.FakeRank0`) answers as the worker's contract says: results keyed
by the id the API server drew, `WeightsState` after changes, `Aborted` for requests it ends, and
`StepOutputs` whose `weight_version` changes when an update lands mid-sequence.
"""

import re
import threading
from collections.abc import Iterator

import httpx
import pytest
from fake_rank0 import AT_REST_FLEET_INFO, InProcessServer, wait_until, weights_state
from prometheus_client.parser import text_string_to_metric_families

from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.expert_requests import NO_EXPERTS

# a failing assertion in the scripted rank 0's thread fails the test
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")

UPDATE = {"version": "step-1", "step": 1, "transport": "disk", "source": {"path": "/x"}}
FINGERPRINT = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def rig() -> Iterator[InProcessServer]:
    server = InProcessServer()
    yield server
    server.close()


def samples(rig: InProcessServer) -> dict[tuple[str, tuple], float]:
    text = rig.client.get("/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def tokens(request_id: str, version: str, ids: list[int], last: str | None) -> list:
    """One StepOutputs per token, the last one finishing with `last`."""
    return [
        messages.StepOutputs(
            weight_version=version,
            outputs=[
                messages.TokenOutput(
                    request_id=request_id,
                    token_id=token_id,
                    logprob=-0.5,
                    top_token_ids=[],
                    top_logprobs=[],
                    finish_reason=last if i == len(ids) - 1 else None,
                )
            ],
        )
        for i, token_id in enumerate(ids)
    ]


# --- updates ---


def test_update_commits_and_is_visible_at_once(rig: InProcessServer) -> None:
    history = messages.HistoryEntry(
        version="step-1",
        step=1,
        fingerprint=FINGERPRINT,
        committed_at=1700000000.0,
        seconds=0.25,
        nbytes=4096,
    )

    def commit(message: messages.ToEngine) -> list:
        assert isinstance(message, messages.UpdateWeights)
        result = messages.UpdateResult(
            update_id=message.update_id,
            status_code=200,
            version=message.version,
            fingerprint=FINGERPRINT,
            nbytes=4096,
            rank_nbytes=[4096, 2048],
            seconds=0.25,
            phases={"load_s": 0.125},
        )
        # rank 0's contract: the new state first, then the result that reveals it
        return [
            weights_state(version="step-1", step=1, fingerprint=FINGERPRINT, history=[history]),
            result,
        ]

    rig.rank0.handler = commit
    response = rig.client.post("/v1/update_weights", json={**UPDATE, "plan_hash": "a" * 32})
    assert response.status_code == 200, response.text
    assert response.json() == {
        "version": "step-1",
        "fingerprint": FINGERPRINT,
        "bytes": 4096,
        "rank_bytes": [4096, 2048],
        "seconds": 0.25,
        "phases": {"load_s": 0.125},
        "staged": False,
        "draft": None,
    }
    (sent,) = rig.rank0.received_of(messages.UpdateWeights)
    assert re.fullmatch(r"[0-9a-f]{32}", sent.update_id)
    assert sent == messages.UpdateWeights(
        update_id=sent.update_id,
        version="step-1",
        step=1,
        force=False,
        transport="disk",
        source={"path": "/x"},
        plan_hash="a" * 32,
        pause_mode="drain",
        atomic=True,
        verify="full",
        timeout_s=60.0,
    )
    assert rig.client.get("/v1/weights").json() == {
        "version": "step-1",
        "step": 1,
        "status": "NORMAL",
        "fingerprint": FINGERPRINT,
        "generation": "running",
        "released": [],
        "history": [
            {
                "version": "step-1",
                "step": 1,
                "fingerprint": FINGERPRINT,
                "committed_at": 1700000000.0,
                "seconds": 0.25,
                "bytes": 4096,
                "draft": None,
                "adapter": None,
            }
        ],
        **AT_REST_FLEET_INFO,
    }
    metrics = samples(rig)
    assert metrics[("weightbus_weight_updates_total", ())] == 1
    assert metrics[("weightbus_weight_update_bytes_total", ())] == 4096
    assert metrics[("weightbus_weight_update_seconds_count", ())] == 1
    assert metrics[("weightbus_weight_update_seconds_sum", ())] == 0.25
    info = (("fingerprint", FINGERPRINT), ("version", "step-1"))
    assert metrics[("weightbus_weights_info", info)] == 1
    assert sum(v for (name, _), v in metrics.items() if "failures_total" in name) == 0


@pytest.mark.parametrize(
    ("status_code", "error", "names", "reason"),
    [
        (400, "digest mismatch", ["model.norm.weight", "lm_head.weight"], "rejected"),
        (409, "version 'step-1' is already being served", [], "conflict"),
        (503, "memory released", [], "unavailable"),
        (504, "update timed out after 65.0 s", [], "timeout"),
    ],
)
def test_update_errors_carry_status_message_and_names(
    rig: InProcessServer, status_code: int, error: str, names: list[str], reason: str
) -> None:
    rig.rank0.handler = lambda message: [
        messages.UpdateResult(
            update_id=message.update_id,
            status_code=status_code,
            version=message.version,
            error=error,
            names=names,
        )
    ]
    response = rig.client.post("/v1/update_weights", json=UPDATE)
    assert response.status_code == status_code
    body = response.json()
    assert body["error"]["message"] == error
    assert body["error"]["code"] == status_code
    assert body["names"] == names
    metrics = samples(rig)
    assert metrics[("weightbus_weight_update_failures_total", (("reason", reason),))] == 1
    assert metrics[("weightbus_weight_updates_total", ())] == 1
    assert metrics[("weightbus_weight_update_bytes_total", ())] == 0


def test_silent_engine_is_504_and_a_late_answer_is_dropped(rig: InProcessServer) -> None:
    response = rig.client.post("/v1/update_weights", json={**UPDATE, "timeout_s": 0.1})
    assert response.status_code == 504
    assert "no answer from the engine within 0.4 s" in response.json()["error"]["message"]
    (sent,) = rig.rank0.received_of(messages.UpdateWeights)
    rig.rank0.send(
        messages.UpdateResult(update_id=sent.update_id, status_code=200, version="step-1")
    )
    rig.rank0.send(
        weights_state(version="late")
    )  # sent after the late result: the pump survived it
    wait_until(lambda: rig.client.get("/v1/weights").json()["version"] == "late")
    assert samples(rig)[("weightbus_weight_update_failures_total", (("reason", "timeout"),))] == 1


def test_engine_death_answers_a_waiting_update_503(rig: InProcessServer) -> None:
    result: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: result.append(rig.client.post("/v1/update_weights", json=UPDATE))
    )
    thread.start()
    wait_until(lambda: rig.rank0.received_of(messages.UpdateWeights))
    rig.hooks.reason = "worker rank 0 exited with code -9"
    thread.join(timeout=10)
    (response,) = result
    assert response.status_code == 503
    assert response.json()["error"]["message"] == (
        "engine unavailable: worker rank 0 exited with code -9"
    )
    assert rig.hooks.failures == ["worker rank 0 exited with code -9"]


# --- control ---


@pytest.mark.parametrize(
    ("path", "body", "expected", "after"),
    [
        (
            "/v1/pause_generation",
            {"mode": "in_place"},
            {"action": "pause", "mode": "in_place", "tags": []},
            {"generation": "paused"},
        ),
        ("/v1/continue_generation", None, {"action": "continue", "tags": []}, {}),
        (
            "/v1/release_memory",
            {"tags": ["kv_cache", "weights"]},
            {"action": "release", "tags": ["kv_cache", "weights"]},
            {"status": "CLEARED", "released": ["kv_cache", "weights"]},
        ),
        (
            "/v1/resume_memory",
            {"tags": ["weights"]},
            {"action": "resume", "tags": ["weights"]},
            {},
        ),
    ],
)
def test_control_round_trip(
    rig: InProcessServer, path: str, body: dict | None, expected: dict, after: dict
) -> None:
    def answer(message: messages.ToEngine) -> list:
        assert isinstance(message, messages.Control)
        done = messages.ControlResult(
            request_id=message.request_id, status_code=200, message=f"{message.action} done"
        )
        return [weights_state(**after), done]

    rig.rank0.handler = answer
    response = rig.client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.json() == {
        "action": expected["action"],
        "message": f"{expected['action']} done",
    }
    (sent,) = rig.rank0.received_of(messages.Control)
    assert re.fullmatch(r"[0-9a-f]{32}", sent.request_id)
    assert (sent.action, sent.tags) == (expected["action"], expected["tags"])
    if "mode" in expected:
        assert sent.mode == expected["mode"]
    weights = rig.client.get("/v1/weights").json()
    assert {key: weights[key] for key in after} == after


def test_control_error_and_silence(rig: InProcessServer) -> None:
    rig.rank0.handler = lambda message: [
        messages.ControlResult(
            request_id=message.request_id, status_code=409, message="an update is in progress"
        )
    ]
    response = rig.client.post("/v1/release_memory", json={"tags": ["kv_cache"]})
    assert response.status_code == 409
    assert response.json()["error"]["message"] == "an update is in progress"
    rig.rank0.handler = lambda message: []
    response = rig.client.post("/v1/pause_generation", json={"mode": "drain"})
    assert response.status_code == 504
    assert "no answer from the engine within 1.0 s" in response.json()["error"]["message"]


# --- completions ---


def test_versions_change_mid_sequence(rig: InProcessServer) -> None:
    def generate(message: messages.ToEngine) -> list:
        if not isinstance(message, messages.AddRequest):
            return []
        rid = message.request_id
        return tokens(rid, "v1", [72, 105], None) + tokens(rid, "v2", [33, 10], "length")

    rig.rank0.handler = generate
    response = rig.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["token_ids"] == [72, 105, 33, 10]
    assert choice["text"] == "Hi!\n"
    assert choice["weight_version"] == "v2"
    assert choice["weight_versions"] == [
        {"version": "v1", "start": 0, "end": 2, "kv_recomputed": False},
        {"version": "v2", "start": 2, "end": 4, "kv_recomputed": False},
    ]
    assert (choice["finish_reason"], choice["abort_reason"]) == ("length", None)
    metrics = samples(rig)
    assert metrics[("weightbus_completion_requests_total", (("code", "200"),))] == 1
    assert metrics[("weightbus_completion_tokens_total", ())] == 4


def test_engine_aborted_choices_report_the_reason(rig: InProcessServer) -> None:
    reason = "weights update to 'v2' (pause_mode abort)"

    def generate(message: messages.ToEngine) -> list:
        if not isinstance(message, messages.AddRequest):
            return []
        rid = message.request_id
        if rid.endswith("-0"):  # one token, then aborted
            return [
                *tokens(rid, "v1", [72], None),
                messages.Aborted(request_ids=[rid], reason=reason),
            ]
        return [messages.Aborted(request_ids=[rid, "unknown-request"], reason=reason)]

    rig.rank0.handler = generate
    response = rig.client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 4})
    assert response.status_code == 200, response.text
    first, second = response.json()["choices"]
    assert (first["finish_reason"], first["abort_reason"]) == ("abort", reason)
    assert first["token_ids"] == [72]
    assert first["weight_versions"] == [
        {"version": "v1", "start": 0, "end": 1, "kv_recomputed": False}
    ]
    assert (second["finish_reason"], second["abort_reason"]) == ("abort", reason)
    assert second["token_ids"] == []
    assert second["weight_versions"] == []
    assert second["weight_version"] == "init"  # no token: the version serving now
    # the engine ended them: nothing to abort back
    assert rig.rank0.received_of(messages.AbortRequest) == []


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (
            {"status": "FAILED", "version": "step-2"},
            (
                "weights failed to update (version 'step-2' is not valid): push a good version "
                "with POST /v1/update_weights"
            ),
        ),
        (
            {"status": "CLEARED", "released": ["kv_cache"]},
            "memory released (kv_cache): call POST /v1/resume_memory before generating",
        ),
        (
            {"status": "CLEARING"},
            "memory released (in progress): call POST /v1/resume_memory before generating",
        ),
    ],
)
def test_completions_refused_while_weights_cannot_serve(
    rig: InProcessServer, weights: dict, message: str
) -> None:
    rig.rank0.send(weights_state(**weights))
    wait_until(lambda: rig.client.get("/v1/weights").json()["status"] == weights["status"])
    response = rig.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 503
    assert response.json()["error"]["message"] == message
    assert rig.rank0.received_of(messages.AddRequest) == []
    health = rig.client.get("/health").json()
    assert health["weights_status"] == weights["status"]
    assert samples(rig)[("weightbus_completion_requests_total", (("code", "503"),))] == 1


def test_initial_state_comes_from_ready(rig: InProcessServer) -> None:
    # the scripted rank 0 sends only Ready: the mirror starts from it
    assert rig.client.get("/v1/weights").json() == {
        "version": "init",
        "step": None,
        "status": "NORMAL",
        "fingerprint": None,
        "generation": "running",
        "released": [],
        "history": [],
        **AT_REST_FLEET_INFO,
    }


def test_a_dense_engine_has_no_expert_map(rig: InProcessServer) -> None:
    # the scripted rank 0's Ready names no experts: the API server answers without asking it
    response = rig.client.get("/v1/experts")
    assert (response.status_code, response.json()["error"]["message"]) == (404, NO_EXPERTS)
    placed = rig.client.post("/v1/experts/place", json={"placement": "linear"})
    assert (placed.status_code, placed.json()["error"]["message"]) == (400, NO_EXPERTS)
    assert rig.client.get("/v1/weights/layout").json()["expert_map"] is None
    assert rig.rank0.received_of(messages.PlaceExperts) == []
