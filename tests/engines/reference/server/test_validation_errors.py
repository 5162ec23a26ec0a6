"""422 answers name the field without echoing the request: `detail` is bounded whatever the body.

Against the API server in-process (real uvicorn, real HTTP) with a scripted rank 0: validation
happens in the API server, rank 0 is never asked.
"""

import json
from collections.abc import Iterator

import pytest
from fake_rank0 import InProcessServer

from weightbus.engines.reference.server.errors import ECHO_CHARS, MAX_DETAIL_ERRORS

MIB = 2**20
# far below the 1 MiB the requests carry, far above a few error lines
MAX_ANSWER_BYTES = 16 * 2**10
# an update body whose only fault is its missing version: 1024 names of 1 KiB each
LARGE_VALID_UPDATE = {
    "transport": "hf_dir",
    "source": {
        "path": "/p",
        "version": "v",
        "names": [f"{i:04d}" + "n" * 1020 for i in range(1024)],
    },
}


@pytest.fixture(scope="module")
def rig() -> Iterator[InProcessServer]:
    server = InProcessServer()
    yield server
    server.close()


@pytest.mark.parametrize(
    ("path", "body", "field", "input_chars"),
    [
        # a mistyped field: the input is the 1 MiB string
        ("/v1/completions", {"prompt": "hi", "max_tokens": "x" * MIB}, "max_tokens", MIB),
        # a missing field: the input is the whole body (1 MiB of valid tensor names), as JSON
        (
            "/v1/update_weights",
            LARGE_VALID_UPDATE,
            "version",
            len(json.dumps(LARGE_VALID_UPDATE)),
        ),
    ],
    ids=["mistyped", "missing"],
)
def test_a_large_invalid_field_is_422_naming_it_without_echoing_it(
    rig: InProcessServer, path: str, body: dict, field: str, input_chars: int
) -> None:
    response = rig.client.post(path, json=body)
    assert response.status_code == 422, response.text[:1000]
    assert len(response.content) < MAX_ANSWER_BYTES
    answer = response.json()
    assert answer["error"]["param"] == field
    assert answer["error"]["message"].startswith(f"invalid field '{field}': ")
    (error,) = answer["detail"]
    assert error["loc"] == ["body", field]
    echoed = error["input"]
    assert echoed.endswith(f"... [truncated, {input_chars} characters]")
    assert len(echoed) == ECHO_CHARS + len(f"... [truncated, {input_chars} characters]")
    assert "detail_omitted" not in answer


def test_an_unknown_key_of_1_mib_is_named_by_its_start(rig: InProcessServer) -> None:
    key = "k" * MIB
    response = rig.client.post("/v1/completions", json={"prompt": "hi", key: 1})
    assert response.status_code == 422
    assert len(response.content) < MAX_ANSWER_BYTES
    param = response.json()["error"]["param"]
    assert param.startswith("kkkk")
    assert param.endswith(f"... [truncated, {MIB} characters]")


def test_many_invalid_items_list_the_first_errors_and_count_the_rest(
    rig: InProcessServer,
) -> None:
    response = rig.client.post("/v1/completions", json={"prompt": [None] * 100_000})
    assert response.status_code == 422
    assert len(response.content) < MAX_ANSWER_BYTES
    answer = response.json()
    assert answer["error"]["param"] == "prompt"
    assert 1 <= len(answer["detail"]) <= MAX_DETAIL_ERRORS
    assert answer["detail_omitted"] > 100_000 - MAX_DETAIL_ERRORS
    assert all(error["loc"][:2] == ["body", "prompt"] for error in answer["detail"])
    # the server still answers
    assert rig.client.get("/health").status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "field", "reason"),
    [
        (
            "/v1/setup_transport",
            {"transport": "shm", "request": {}},
            "transport",
            "transport 'shm' needs no set-up on engine ranks; those that do: dist",
        ),
        (
            "/v1/setup_transport",
            {"transport": "dist", "request": {"action": "init", "master_addr": "h"}},
            "request",
            "dist set-up: Object missing required field `master_port`",
        ),
        (
            "/v1/setup_transport",
            {"transport": "dist", "request": {"action": "destroy"}},
            "request",
            "request: a tear-down request; post it to /v1/teardown_transport",
        ),
        (
            "/v1/teardown_transport",
            {"transport": "dist", "request": {"action": "destroy", "group_name": "a b"}},
            "request",
            "dist set-up: Expected `str` matching regex",
        ),
    ],
    ids=["no set-up", "missing", "tear-down to set-up", "out of range"],
)
def test_a_transport_setup_request_is_checked_by_its_transport(
    rig: InProcessServer, path: str, body: dict, field: str, reason: str
) -> None:
    response = rig.client.post(path, json=body)
    assert response.status_code == 422, response.text
    answer = response.json()
    assert answer["error"]["param"] == field
    assert reason in answer["error"]["message"]
