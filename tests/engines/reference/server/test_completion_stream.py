"""`/v1/completions` with `stream: true` against a scripted rank 0 (real ZMQ, real HTTP): the
server-sent events, one chunk per token with the version that produced it, the last chunk's
`finish_reason` (an aborted stream's with its `abort_reason`), then `data: [DONE]`."""

import json
from collections.abc import Iterator

import pytest
from fake_rank0 import InProcessServer

from weightbus.engines.reference.engine import messages

# a failing assertion in the scripted rank 0's thread fails the test
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


@pytest.fixture(scope="module")
def rig() -> Iterator[InProcessServer]:
    server = InProcessServer()
    yield server
    server.close()


def _step(request_id: str, version: str, token_id: int, last: str | None) -> messages.StepOutputs:
    output = messages.TokenOutput(
        request_id=request_id,
        token_id=token_id,
        logprob=-0.5,
        top_token_ids=[],
        top_logprobs=[],
        finish_reason=last,
    )
    return messages.StepOutputs(weight_version=version, outputs=[output])


def _events(rig: InProcessServer, body: dict) -> list[str]:
    """The stream's `data:` payloads, in order."""
    with rig.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    blocks = text.split("\n\n")
    assert blocks[-1] == ""  # every event ends with a blank line
    assert all(block.startswith("data: ") for block in blocks[:-1]), text
    return [block.removeprefix("data: ") for block in blocks[:-1]]


def test_each_chunk_names_the_version_of_its_token_then_finish_and_done(rig) -> None:
    def generate(message: messages.ToEngine) -> list:
        if not isinstance(message, messages.AddRequest):
            return []
        rid = message.request_id
        return [
            _step(rid, "v1", 72, None),
            _step(rid, "v2", 105, None),
            _step(rid, "v2", 33, "length"),
        ]

    rig.rank0.handler = generate
    events = _events(rig, {"prompt": "hi", "max_tokens": 3})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1
    choices = [c["choices"][0] for c in chunks]
    assert [(c["token_ids"], c["weight_version"]) for c in choices] == [
        ([72], "v1"),
        ([105], "v2"),
        ([33], "v2"),
        ([], "v2"),
    ]
    assert "".join(c["text"] for c in choices) == "Hi!"
    assert [c.get("finish_reason") for c in choices] == [None, None, None, "length"]


def test_an_aborted_stream_ends_with_abort_and_its_reason(rig) -> None:
    reason = "weights update to 'v2' (pause_mode abort)"

    def generate(message: messages.ToEngine) -> list:
        if not isinstance(message, messages.AddRequest):
            return []
        rid = message.request_id
        return [_step(rid, "v1", 72, None), messages.Aborted(request_ids=[rid], reason=reason)]

    rig.rank0.handler = generate
    events = _events(rig, {"prompt": "hi", "max_tokens": 8})
    assert events[-1] == "[DONE]"
    first, last = (json.loads(event)["choices"][0] for event in events[:-1])
    assert (first["token_ids"], first["weight_version"]) == ([72], "v1")
    assert (last["token_ids"], last["finish_reason"], last["abort_reason"]) == (
        [],
        "abort",
        reason,
    )
    assert last["weight_version"] == "v1"  # the version of its last token
