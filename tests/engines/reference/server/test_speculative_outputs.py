"""Speculative steps as the API server sees them: several tokens of one request per
`StepOutputs`, and the draft-token counters on `/metrics` (scripted rank 0, real HTTP)."""

from collections.abc import Iterator

import pytest
from fake_rank0 import InProcessServer, wait_until
from prometheus_client.parser import text_string_to_metric_families

from weightbus.engines.reference.engine import messages

# a failing assertion in the scripted rank 0's thread fails the test
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


@pytest.fixture
def rig() -> Iterator[InProcessServer]:
    server = InProcessServer()
    yield server
    server.close()


def spec_samples(rig: InProcessServer) -> dict[str, float]:
    text = rig.client.get("/metrics").text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("weightbus_spec_")
    }


def output(
    request_id: str, token_id: int, finish_reason: str | None = None
) -> messages.TokenOutput:
    return messages.TokenOutput(
        request_id=request_id,
        token_id=token_id,
        logprob=-0.25,
        top_token_ids=[token_id],
        top_logprobs=[-0.25],
        finish_reason=finish_reason,
    )


def test_several_tokens_per_step_and_the_counters(rig: InProcessServer) -> None:
    assert spec_samples(rig) == {
        "weightbus_spec_draft_tokens_total": 0.0,
        "weightbus_spec_accepted_tokens_total": 0.0,
        "weightbus_spec_acceptance_rate": 0.0,
    }

    def generate(message: messages.ToEngine) -> list:
        if not isinstance(message, messages.AddRequest):
            return []
        rid = message.request_id
        # two speculative steps: 3 of 3 proposals kept (+ 1 bonus), then 0 of 3 (+ 1)
        return [
            messages.StepOutputs(
                weight_version="init",
                outputs=[output(rid, t) for t in (72, 105, 33, 32)],
                num_draft_tokens=3,
                num_accepted_tokens=3,
            ),
            messages.StepOutputs(
                weight_version="init",
                outputs=[output(rid, 10, "length")],
                num_draft_tokens=3,
                num_accepted_tokens=0,
            ),
        ]

    rig.rank0.handler = generate
    body = {"prompt": "hi", "max_tokens": 5, "logprobs": 1}
    response = rig.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["token_ids"] == [72, 105, 33, 32, 10]
    assert choice["text"] == "Hi! \n"
    assert choice["logprobs"]["token_logprobs"] == [-0.25] * 5
    assert choice["weight_versions"] == [
        {"version": "init", "start": 0, "end": 5, "kv_recomputed": False}
    ]
    assert choice["finish_reason"] == "length"
    wait_until(lambda: spec_samples(rig)["weightbus_spec_draft_tokens_total"] == 6)
    assert spec_samples(rig) == {
        "weightbus_spec_draft_tokens_total": 6.0,
        "weightbus_spec_accepted_tokens_total": 3.0,
        "weightbus_spec_acceptance_rate": 0.5,
    }


def test_a_stop_string_inside_a_step_cuts_there(rig: InProcessServer) -> None:
    def generate(message: messages.ToEngine) -> list:
        if not isinstance(message, messages.AddRequest):
            return []
        tokens = [output(message.request_id, t) for t in b"ab;cd"]
        return [messages.StepOutputs(weight_version="init", outputs=tokens)]

    rig.rank0.handler = generate
    body = {"prompt": "x", "max_tokens": 8, "stop": [";"]}
    response = rig.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("ab", "stop")
    assert choice["token_ids"] == list(b"ab;")
    wait_until(lambda: rig.rank0.received_of(messages.AbortRequest))
