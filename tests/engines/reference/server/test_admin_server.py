"""`weightbus serve --api-token`: a real server process, real workers, real HTTP.

Only requests that the API server itself answers are sent to admin routes here (auth and
validation errors, `GET /v1/weights`): the round trips through rank 0 are covered in
test_admin_roundtrip.py against a scripted rank 0.
"""

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from engine_harness import ServedEngine
from fake_rank0 import AT_REST_FLEET_INFO
from prometheus_client.parser import text_string_to_metric_families

# every test starts `weightbus serve` or another process (tiers: tests/conftest.py)
pytestmark = pytest.mark.e2e
TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
UPDATE = {"version": "v1", "transport": "disk", "source": {"path": "/x"}}
ADMIN_ROUTES = [
    ("POST", "/v1/update_weights"),
    ("GET", "/v1/weights"),
    ("POST", "/v1/pause_generation"),
    ("POST", "/v1/continue_generation"),
    ("POST", "/v1/release_memory"),
    ("POST", "/v1/resume_memory"),
]
HEX32 = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedEngine]:
    served = ServedEngine(
        "--api-token", TOKEN, log_path=tmp_path_factory.mktemp("logs") / "serve.log"
    )
    yield served
    assert served.stop() == 0


def admin(engine: ServedEngine, path: str, body: object, headers: dict | None = None):
    return engine.client.post(path, json=body, headers=AUTH if headers is None else headers)


# --- auth ---


@pytest.mark.parametrize(("method", "path"), [*ADMIN_ROUTES, ("GET", "/docs")])
def test_admin_routes_need_the_token(engine: ServedEngine, method: str, path: str) -> None:
    missing = engine.client.request(method, path, json={})
    assert missing.status_code == 401
    assert missing.headers["WWW-Authenticate"] == "Bearer"
    assert missing.json()["error"] == {
        "message": "this route needs 'Authorization: Bearer <token>'",
        "type": "authentication_error",
        "param": None,
        "code": 401,
    }
    basic = engine.client.request(method, path, json={}, headers={"Authorization": "Basic eA=="})
    assert basic.status_code == 401
    wrong = engine.client.request(
        method, path, json={}, headers={"Authorization": f"Bearer {TOKEN}x"}
    )
    assert wrong.status_code == 403
    assert wrong.json()["error"]["message"] == "invalid API token"


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
def test_right_token_reaches_validation(engine: ServedEngine, method: str, path: str) -> None:
    # an unknown field: 422 proves the request got past the token check
    response = engine.client.request(method, path, json={"bogus": 1}, headers=AUTH)
    if method == "GET":
        assert response.status_code == 200
        return
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] in {"bogus", "version", "mode", "tags"}


def test_public_routes_need_no_token(engine: ServedEngine) -> None:
    assert engine.client.get("/health").status_code == 200
    assert engine.client.get("/metrics").status_code == 200
    assert engine.client.get("/v1/models").status_code == 200
    response = engine.complete(prompt="hi", max_tokens=2, temperature=0)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["weight_versions"] == [
        {"version": "init", "start": 0, "end": 2, "kv_recomputed": False}
    ]
    assert choice["abort_reason"] is None


def test_public_host_without_token_is_refused() -> None:
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTBUS_API_TOKEN"}
    result = subprocess.run(
        [sys.executable, "-m", "weightbus", "serve", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("weightbus serve: error: --host 0.0.0.0 is reachable")
    assert "set --api-token (or WEIGHTBUS_API_TOKEN)" in result.stderr
    assert "serving on" not in result.stdout


def test_token_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTBUS_API_TOKEN", "from-env")
    served = ServedEngine(log_path=tmp_path / "serve.log")  # inherits the environment
    try:
        assert served.client.get("/v1/weights").status_code == 401
        headers = {"Authorization": "Bearer from-env"}
        assert served.client.get("/v1/weights", headers=headers).status_code == 200
    finally:
        assert served.stop() == 0


# --- validation ---


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/update_weights", {"transport": "disk", "source": {}}, "version"),
        ("/v1/update_weights", {"version": "v1", "source": {}}, "transport"),
        ("/v1/update_weights", {"version": "v1", "transport": "disk"}, "source"),
        ("/v1/update_weights", {**UPDATE, "version": ""}, "version"),
        ("/v1/update_weights", {**UPDATE, "version": "v" * 257}, "version"),
        ("/v1/update_weights", {**UPDATE, "version": "v\n1"}, "version"),
        ("/v1/update_weights", {**UPDATE, "version": 1}, "version"),
        ("/v1/update_weights", {**UPDATE, "step": -1}, "step"),
        ("/v1/update_weights", {**UPDATE, "step": "5"}, "step"),
        ("/v1/update_weights", {**UPDATE, "force": "yes"}, "force"),
        ("/v1/update_weights", {**UPDATE, "transport": "carrier-pigeon"}, "transport"),
        ("/v1/update_weights", {**UPDATE, "source": "/x"}, "source"),
        ("/v1/update_weights", {**UPDATE, "source": {"n": 2**70}}, "source"),
        ("/v1/update_weights", {**UPDATE, "plan_hash": "abc"}, "plan_hash"),
        ("/v1/update_weights", {**UPDATE, "plan_hash": "A" * 32}, "plan_hash"),
        ("/v1/update_weights", {**UPDATE, "pause_mode": "later"}, "pause_mode"),
        ("/v1/update_weights", {**UPDATE, "atomic": 1}, "atomic"),
        ("/v1/update_weights", {**UPDATE, "verify": "some"}, "verify"),
        ("/v1/update_weights", {**UPDATE, "timeout_s": 0}, "timeout_s"),
        ("/v1/update_weights", {**UPDATE, "timeout_s": 1e9}, "timeout_s"),
        ("/v1/update_weights", {**UPDATE, "priority": 1}, "priority"),
        ("/v1/pause_generation", {}, "mode"),
        ("/v1/pause_generation", {"mode": "now"}, "mode"),
        ("/v1/pause_generation", {"mode": "drain", "tags": []}, "tags"),
        ("/v1/continue_generation", {"mode": "drain"}, "mode"),
        ("/v1/release_memory", {}, "tags"),
        ("/v1/release_memory", {"tags": []}, "tags"),
        ("/v1/release_memory", {"tags": ["gpu"]}, "tags"),
        ("/v1/release_memory", {"tags": "kv_cache"}, "tags"),
        ("/v1/release_memory", {"tags": ["kv_cache", "kv_cache"]}, "tags"),
        ("/v1/resume_memory", {"tags": ["weights"], "now": True}, "now"),
        ("/v1/resume_memory", {"tags": [None]}, "tags"),
    ],
)
def test_malformed_bodies_are_422_naming_the_field(
    engine: ServedEngine, path: str, body: dict, field: str
) -> None:
    response = admin(engine, path, body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert error["message"].startswith(f"invalid field '{field}'")
    assert error["type"] == "invalid_request_error"


def test_unknown_transport_lists_the_known_ones(engine: ServedEngine) -> None:
    response = admin(engine, "/v1/update_weights", {**UPDATE, "transport": "nope"})
    assert "unknown transport 'nope'; available: disk" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", [path for method, path in ADMIN_ROUTES if method == "POST"])
def test_broken_bodies_are_4xx(engine: ServedEngine, path: str) -> None:
    def post(content: bytes, content_type: str = "application/json") -> httpx.Response:
        headers = {**AUTH, "Content-Type": content_type}
        return engine.client.post(path, content=content, headers=headers)

    broken = post(b'{"version": ')
    assert broken.status_code == 422
    assert broken.json()["error"]["message"].startswith("invalid JSON at character 12")
    assert post(b"[1, 2]").status_code == 422
    assert post(b"\xff\xfe").status_code == 422
    assert post(b'{"tags": ["weights"]}', "text/plain").status_code == 422
    deep = post(b"[" * 100_000 + b"]" * 100_000)
    assert deep.status_code == 400
    assert deep.json()["error"]["message"] == (
        "There was an error parsing the body: JSON nested too deeply"
    )
    huge = post(b'{"source": "' + b"x" * (9 * 2**20) + b'"}')
    assert huge.status_code == 413
    assert huge.json()["error"]["message"] == "request body exceeds 8388608 bytes"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(9):
            yield b" " * 2**20

    chunked = engine.client.post(path, content=chunks(), headers=AUTH)
    assert chunked.status_code == 413
    assert engine.client.get("/health").status_code == 200


# --- state ---


def test_weights_start_from_ready(engine: ServedEngine) -> None:
    state = engine.client.get("/v1/weights", headers=AUTH).json()
    fingerprint = state.pop("fingerprint")
    # the base's own: no adapter is applied
    assert state.pop("base_fingerprint") == fingerprint
    assert state == {
        "version": "init",
        "step": None,
        "status": "NORMAL",
        "generation": "running",
        "released": [],
        "history": [],
        **{k: v for k, v in AT_REST_FLEET_INFO.items() if k != "base_fingerprint"},
    }
    # null from Ready alone; the worker's first WeightsState fills it in once it sends one
    assert fingerprint is None or HEX32.fullmatch(fingerprint)


def test_health_reports_the_weights(engine: ServedEngine) -> None:
    assert engine.client.get("/health").json() == {
        "status": "ok",
        "weight_version": "init",
        "weights_status": "NORMAL",
        "generation": "running",
        "waiting_for_initial_weights": False,
        "rollback_version": None,
    }


def test_metrics_parse_with_zero_counts_and_the_version(engine: ServedEngine) -> None:
    response = engine.client.get("/metrics")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in families.values()
        for s in family.samples
    }
    for name in ("weightbus_weight_updates", "weightbus_weight_update_bytes"):
        assert families[name].type == "counter"
        assert values[(f"{name}_total", ())] == 0
    for reason in ("rejected", "conflict", "unavailable", "timeout", "error"):
        key = ("weightbus_weight_update_failures_total", (("reason", reason),))
        assert values[key] == 0
    assert families["weightbus_weight_update_seconds"].type == "histogram"
    assert values[("weightbus_weight_update_seconds_count", ())] == 0
    (info,) = families["weightbus_weights_info"].samples
    assert info.labels["version"] == "init"
    assert info.value == 1
    status = {s.labels["status"]: s.value for s in families["weightbus_weights_status"].samples}
    assert status == {
        "NORMAL": 1,
        "UPDATING": 0,
        "CLEARING": 0,
        "CLEARED": 0,
        "FAILED": 0,
        "WAITING": 0,
    }
    for name in ("weightbus_two_phase_aborts", "weightbus_rollbacks"):
        assert families[name].type == "counter"
        assert values[(f"{name}_total", ())] == 0
    assert values[("weightbus_rollback_available", ())] == 0
    assert families["weightbus_completion_requests"].type == "counter"
