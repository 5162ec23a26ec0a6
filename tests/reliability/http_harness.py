"""Helpers of the HTTP input tests: the served routes, the weights' identity, bodies.

Routes come from the app itself (its OpenAPI schema, plus the routes it keeps out of the
schema such as `/docs`), so a route added later is covered without anyone listing it.
"""

import time
from dataclasses import dataclass
from typing import Any

from engine_harness import ServedEngine
from fastapi.routing import APIRoute

from weightbus.engines.reference.server.admin import AdminConfig
from weightbus.engines.reference.server.api import AppConfig, create_app
from weightbus.engines.reference.server.auth import PUBLIC_PATHS

TOKEN = "reliability-token-0123456789"
GREEDY_PROMPT = [3, 17, 42, 99, 5]
GREEDY_TOKENS = 6


@dataclass(frozen=True, slots=True)
class Route:
    """One method of one path, with what its OpenAPI operation says about its body."""

    method: str
    path: str
    body_schema: dict[str, Any] | None  # resolved JSON schema of the body, None: no body
    body_required: bool

    @property
    def id(self) -> str:
        return f"{self.method} {self.path}"

    @property
    def public(self) -> bool:
        return self.path in PUBLIC_PATHS


def _app_schema_and_hidden_routes() -> tuple[dict, list[tuple[str, str]]]:
    # building the app starts nothing: the engine is only reached from its lifespan
    config = AppConfig(
        model="tiny",
        served_model_name="tiny",
        ipc_dir="",
        bos_token_id=None,
        ready_timeout_s=1.0,
        request_timeout_s=1.0,
        admin=AdminConfig(update_margin_s=1.0, control_timeout_s=1.0),
    )
    app = create_app(config, hooks=None)
    hidden = [
        (method, route.path)
        for route in app.routes
        if not isinstance(route, APIRoute) and not getattr(route, "include_in_schema", True)
        for method in sorted(getattr(route, "methods", ()))
    ]
    return app.openapi(), hidden


def resolve(schema: dict, spec: dict) -> dict:
    """`schema` with a top-level `$ref` (or an `anyOf` holding one) resolved in `spec`."""
    for option in schema.get("anyOf", []):
        if "$ref" in option:
            schema = option
    ref = schema.get("$ref")
    if ref is None:
        return schema
    node: Any = spec
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def schema_operations(spec: dict) -> list[tuple[str, str]]:
    """(METHOD, path) of every operation of an OpenAPI document."""
    return sorted((method.upper(), path) for path, ops in spec["paths"].items() for method in ops)


def served_routes() -> list[Route]:
    """Every route of the app: its schema's operations, then the routes kept out of it."""
    spec, hidden = _app_schema_and_hidden_routes()
    routes = []
    for method, path in schema_operations(spec):
        body = spec["paths"][path][method.lower()].get("requestBody")
        body_schema = None
        if body is not None:
            body_schema = resolve(body["content"]["application/json"]["schema"], spec)
        routes.append(Route(method, path, body_schema, bool(body and body.get("required"))))
    routes.extend(Route(method, path, None, body_required=False) for method, path in hidden)
    return routes


def app_openapi() -> dict:
    """The OpenAPI document the app serves at `/openapi.json`."""
    return _app_schema_and_hidden_routes()[0]


@dataclass(frozen=True, slots=True)
class WeightsIdentity:
    """What must not change when a request is refused: the served version, its fingerprint
    and status, and the greedy completion of a fixed prompt."""

    version: str
    fingerprint: str | None
    status: str
    greedy_token_ids: tuple[int, ...]


def weights_identity(engine: ServedEngine, timeout_s: float = 30.0) -> WeightsIdentity:
    """Read the engine's weights identity (the client carries the token, if one is set).

    Waits up to `timeout_s` for the fingerprint: it is null until rank 0's first report.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        state = engine.client.get("/v1/weights")
        assert state.status_code == 200, state.text
        weights = state.json()
        if weights["fingerprint"] is not None or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    completion = engine.complete(prompt=GREEDY_PROMPT, max_tokens=GREEDY_TOKENS, temperature=0)
    assert completion.status_code == 200, completion.text
    return WeightsIdentity(
        version=weights["version"],
        fingerprint=weights["fingerprint"],
        status=weights["status"],
        greedy_token_ids=tuple(completion.json()["choices"][0]["token_ids"]),
    )


def assert_alive_and_unchanged(engine: ServedEngine, baseline: WeightsIdentity) -> None:
    """The server answers and serves the same version, fingerprint and status (cheap: the
    greedy completion is compared once per module, by its last test)."""
    health = engine.client.get("/health")
    assert health.status_code == 200, health.text
    weights = engine.client.get("/v1/weights").json()
    assert (weights["version"], weights["fingerprint"], weights["status"]) == (
        baseline.version,
        baseline.fingerprint,
        baseline.status,
    )
