"""schemathesis against the OpenAPI schema a real `weightbus serve --api-token` serves.

For every operation of the schema (fetched from `/openapi.json` with the bearer token, so a new
route is covered as soon as it exists), schemathesis generates valid bodies (positive) and
invalid ones (negative), bounded by `MAX_EXAMPLES` each. Every answer must be below 500 and
conform to the schema (status, content type, body; valid input to a route is allowed a 4xx,
since a schema cannot describe a usable session or a prompt that fits the model); the server
must stay alive and the weights must not change.

Valid input to some routes changes the engine's state, and the invariant is kept this way:

- `pause_generation`: a successful pause is undone at once with `continue_generation` (state
  of generation, not of weights: the weights invariant is checked after the undo);
- `release_memory`, `init_weights_group`, `setup_transport`: negative data only. A successful
  release of the weights discards them (only a push brings them back), and joining a group
  blocks every rank for up to `timeout_s` (an hour) on a store that may be anywhere; each is
  covered by its own tests with real parties (tests/core/pushes/, tests/core/);
- `update_weights`: generated freely. A schema-valid body names a registered transport but no
  session that exists, so rank 0 refuses it (400) and the weights stay as they were: checked
  after every case, which is the point of fuzzing this route.
- `commit_weights`, `abort_weights`, `rollback_weights`: generated freely. This engine never
  commits a push, so it holds no staged update and no previous version: each is refused (409)
  and the weights stay as they were.

Generated completions are capped at `MAX_TOKENS` tokens to bound the run's time.
"""

from typing import Any

import pytest
import schemathesis
from engine_harness import ServedEngine
from http_harness import (
    TOKEN,
    WeightsIdentity,
    app_openapi,
    assert_alive_and_unchanged,
    schema_operations,
    weights_identity,
)
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_EXAMPLES = 40
MAX_TOKENS = 8
REQUEST_TIMEOUT_S = 60.0
NEGATIVE_ONLY = {
    ("POST", "/v1/release_memory"),
    ("POST", "/v1/init_weights_group"),
    ("POST", "/v1/setup_transport"),
}
UNDO = {("POST", "/v1/pause_generation"): ("POST", "/v1/continue_generation")}


def _has_input(spec: dict, method: str, path: str) -> bool:
    operation = spec["paths"][path][method.lower()]
    return "requestBody" in operation or bool(operation.get("parameters"))


def _runs() -> list[tuple[str, str, GenerationMode]]:
    spec = app_openapi()
    runs = []
    for method, path in schema_operations(spec):
        if (method, path) not in NEGATIVE_ONLY:
            runs.append((method, path, GenerationMode.POSITIVE))
        if _has_input(spec, method, path):  # nothing to make invalid otherwise
            runs.append((method, path, GenerationMode.NEGATIVE))
    return runs


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    log_path = tmp_path_factory.mktemp("logs") / "serve.log"
    served = ServedEngine("--api-token", TOKEN, log_path=log_path, token=TOKEN)
    yield served
    assert served.stop() == 0


@pytest.fixture(scope="module", autouse=True)
def baseline(engine: ServedEngine) -> WeightsIdentity:
    """The weights the engine started with, read before any generated request (autouse)."""
    return weights_identity(engine)


@pytest.fixture(scope="module")
def schema(engine: ServedEngine) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{engine.url}/openapi.json", headers=AUTH)


def _bound_generation(body: Any) -> None:
    max_tokens = body.get("max_tokens") if isinstance(body, dict) else None
    if type(max_tokens) is int and max_tokens > MAX_TOKENS:
        body["max_tokens"] = MAX_TOKENS


def _assert_weights_unchanged(engine: ServedEngine, baseline: WeightsIdentity) -> None:
    assert_alive_and_unchanged(engine, baseline)
    weights = engine.client.get("/v1/weights").json()
    assert weights["generation"] == "running"
    assert weights["released"] == []


@pytest.mark.parametrize(
    ("method", "path", "mode"), _runs(), ids=lambda value: getattr(value, "value", value)
)
def test_answers_conform_and_change_no_weights(
    engine: ServedEngine,
    baseline: WeightsIdentity,
    schema: schemathesis.BaseSchema,
    method: str,
    path: str,
    mode: GenerationMode,
) -> None:
    operation = schema[path][method]
    undo = UNDO.get((method, path))

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        if mode == GenerationMode.POSITIVE:
            _bound_generation(case.body)
        response = case.call(base_url=engine.url, headers=AUTH, timeout=REQUEST_TIMEOUT_S)
        if undo is not None and response.status_code == 200:
            undone = engine.client.request(*undo, json={})
            assert undone.status_code == 200, undone.text
        case.validate_response(response, headers=AUTH, excluded_checks=[positive_data_acceptance])
        _assert_weights_unchanged(engine, baseline)

    check()


def test_the_weights_serve_as_before(engine: ServedEngine, baseline: WeightsIdentity) -> None:
    # last in the module: after every generated request above, the same weights answer
    assert weights_identity(engine) == baseline
