"""Oversized and malformed bodies on every route of a real `weightbus serve`.

Each route of the app (derived from its OpenAPI schema and its other routes: see
`http_harness.served_routes`) gets bodies that are too large, that are not JSON, that Python's
JSON reader accepts but no field can hold, and that come with the wrong content type; against an
engine without a token and one with `--api-token`. Every answer must be a 4xx with a JSON error
saying what is wrong (never a 500), the server must keep serving, and the weights must stay the
ones it started with (version, fingerprint, status and the greedy completion of a fixed prompt).
"""

from collections.abc import Iterator

import httpx
import pytest
from engine_harness import ServedEngine
from http_harness import (
    TOKEN,
    Route,
    WeightsIdentity,
    app_openapi,
    assert_alive_and_unchanged,
    schema_operations,
    served_routes,
    weights_identity,
)

from weightbus.engines.reference.server.body_limit import DEFAULT_MAX_BODY_BYTES

ROUTES = served_routes()
BODY_ROUTES = [route for route in ROUTES if route.body_schema is not None]
BODYLESS_ROUTES = [route for route in ROUTES if route.body_schema is None]
JSON = "application/json"
PARSE_FAILED = "There was an error parsing the body: "
NOT_JSON_TYPE = "invalid request body: Content-Type must be application/json, got "

# (what, body, content type or None, status, start of the error message)
MALFORMED = [
    ("truncated", b'{"mode": ', JSON, 422, "invalid JSON at character 9: Expecting value"),
    ("not JSON", b"new weights please", JSON, 422, "invalid JSON at character 0: Expecting"),
    ("array", b"[1, 2]", JSON, 422, "invalid request body: Input should be a valid dictionary"),
    ("number", b"7", JSON, 422, "invalid request body: Input should be a valid dictionary"),
    ("string", b'"weights"', JSON, 422, "invalid request body: Input should be a valid dict"),
    ("text/plain", b"{}", "text/plain", 422, f"{NOT_JSON_TYPE}text/plain"),
    ("no content type", b"{}", None, 422, f"{NOT_JSON_TYPE}none"),
    ("form", b"mode=drain", "application/x-www-form-urlencoded", 422, f"{NOT_JSON_TYPE}appl"),
    ("nested arrays", b"[" * 100_000 + b"]" * 100_000, JSON, 400, f"{PARSE_FAILED}JSON nested"),
    ("nested objects", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, JSON, 400, f"{PARSE_FAILED}JSON"),
    ("huge integer", b'{"n": ' + b"9" * 5000 + b"}", JSON, 400, f"{PARSE_FAILED}Exceeds the"),
    ("invalid UTF-8", b'{"x": "\xff"}', JSON, 400, f"{PARSE_FAILED}body is not UTF-8"),
]
# for routes whose body is required (an optional body may be left out or null)
MISSING = [
    ("empty", b"", JSON, 422, "invalid request body: Field required"),
    ("null", b"null", JSON, 422, "invalid request body: expected a JSON object, got null"),
]
# routes the tiny model's engine answers 404: a dense model has no expert map
NO_EXPERTS_404 = {"/v1/experts"}
# values Python's JSON reader accepts that no field holds (and no answer may echo raw)
UNREPRESENTABLE = ["NaN", "Infinity", "-Infinity", "1e400", '"\\ud800"', '"\\udfff x"']


@pytest.fixture(scope="module", params=[None, TOKEN], ids=["open", "token"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    token = request.param
    args = ("--api-token", token) if token else ()
    log_path = tmp_path_factory.mktemp("logs") / "serve.log"
    served = ServedEngine(*args, log_path=log_path, token=token)
    yield served
    assert served.stop() == 0


@pytest.fixture(scope="module", autouse=True)
def baseline(engine: ServedEngine) -> WeightsIdentity:
    """The weights the engine started with, read before any test's request (autouse)."""
    return weights_identity(engine)


def _post(engine: ServedEngine, route: Route, content: bytes, content_type: str | None):
    headers = {} if content_type is None else {"Content-Type": content_type}
    return engine.client.request(route.method, route.path, content=content, headers=headers)


def _assert_error(response: httpx.Response, status: int, message_start: str, what: str = ""):
    assert response.status_code == status, (what, response.text[:500])
    assert response.headers["content-type"] == JSON, what
    error = response.json()["error"]
    assert error["message"].startswith(message_start), (what, error["message"])
    assert error["code"] == status


def test_the_routes_are_those_the_server_serves(engine: ServedEngine) -> None:
    live = engine.client.get("/openapi.json")
    assert live.status_code == 200
    assert schema_operations(live.json()) == schema_operations(app_openapi())
    assert {"/v1/update_weights", "/v1/completions", "/docs"} <= {r.path for r in ROUTES}


@pytest.mark.parametrize("route", BODY_ROUTES, ids=lambda route: route.id)
def test_malformed_bodies_are_4xx_naming_the_problem(
    engine: ServedEngine, baseline: WeightsIdentity, route: Route
) -> None:
    cases = MALFORMED + (MISSING if route.body_required else [])
    for what, content, content_type, status, message in cases:
        _assert_error(_post(engine, route, content, content_type), status, message, what)
    assert_alive_and_unchanged(engine, baseline)


@pytest.mark.parametrize("route", BODY_ROUTES, ids=lambda route: route.id)
def test_values_no_field_can_hold_are_422_naming_a_field(
    engine: ServedEngine, baseline: WeightsIdentity, route: Route
):
    fields = sorted(route.body_schema.get("properties", {}))
    for field in fields:
        for value in UNREPRESENTABLE:
            content = f'{{"{field}": {value}}}'.encode()
            response = _post(engine, route, content, JSON)
            _assert_error(response, 422, "invalid field '", content.decode())
            assert response.json()["error"]["param"] in fields
    assert_alive_and_unchanged(engine, baseline)


@pytest.mark.parametrize("route", BODYLESS_ROUTES, ids=lambda route: route.id)
def test_routes_without_a_body_ignore_one(
    engine: ServedEngine, baseline: WeightsIdentity, route: Route
) -> None:
    expected = engine.client.request(route.method, route.path)
    assert expected.status_code == (404 if route.path in NO_EXPERTS_404 else 200)
    for what, content, content_type, _, _ in MALFORMED:
        response = _post(engine, route, content, content_type)
        assert response.status_code == expected.status_code, (what, response.text[:500])
    assert_alive_and_unchanged(engine, baseline)


def _chunks(total_bytes: int, chunk_bytes: int = 2**20) -> Iterator[bytes]:
    for start in range(0, total_bytes, chunk_bytes):  # no Content-Length: counted as it arrives
        yield b" " * min(chunk_bytes, total_bytes - start)


@pytest.mark.parametrize("route", ROUTES, ids=lambda route: route.id)
def test_oversized_bodies_are_413(
    engine: ServedEngine, baseline: WeightsIdentity, route: Route
) -> None:
    message = f"request body exceeds {DEFAULT_MAX_BODY_BYTES} bytes"
    too_large = DEFAULT_MAX_BODY_BYTES + 1
    declared = _post(engine, route, b" " * too_large, JSON)
    chunked = engine.client.request(route.method, route.path, content=_chunks(too_large))
    for response in (declared, chunked):
        if route.method == "HEAD":  # no body in the answer
            assert response.status_code == 413
        else:
            _assert_error(response, 413, message)
    assert_alive_and_unchanged(engine, baseline)


@pytest.mark.parametrize(
    "route", [r for r in ROUTES if not r.public and r.method != "HEAD"], ids=lambda r: r.id
)
def test_without_a_token_the_body_of_an_admin_route_is_never_read(
    engine: ServedEngine, baseline: WeightsIdentity, route: Route
) -> None:
    response = httpx.request(
        route.method, f"{engine.url}{route.path}", content=b" " * (DEFAULT_MAX_BODY_BYTES + 1)
    )
    if engine.client.headers.get("Authorization") is None:  # no token set: the route is open
        _assert_error(response, 413, "request body exceeds")
    else:
        _assert_error(response, 401, "this route needs 'Authorization: Bearer <token>'")
    assert_alive_and_unchanged(engine, baseline)


# Authorization values with a wrong bearer token (403 with a token set) ...
WRONG_TOKENS = [
    b"Bearer",  # no credentials after the scheme
    b"Bearer x",
    f"Bearer {TOKEN[:-1]}".encode(),
    f"Bearer {TOKEN}x".encode(),
    f"Bearer {TOKEN.upper()}".encode(),
    b"Bearer " + b"t" * 8000,
    "Bearer t\u00f6k\u00e9n".encode(),  # UTF-8, not ASCII
    b"Bearer " + TOKEN.encode()[:-1] + b"\xff",  # not UTF-8
]
# ... and without one at all (401)
NO_BEARER = [b"", b"Basic eA==", b"\xff\xfe", f"Bearer\t{TOKEN}".encode(), TOKEN.encode()]


@pytest.mark.parametrize(
    "route", [r for r in ROUTES if not r.public and r.method != "HEAD"], ids=lambda r: r.id
)
def test_wrong_tokens_of_any_form_are_refused_without_a_500(
    engine: ServedEngine, baseline: WeightsIdentity, route: Route
) -> None:
    def request(authorization: bytes | None) -> httpx.Response:
        headers = {"Content-Type": JSON}
        if authorization is not None:
            headers["Authorization"] = authorization
        # a fresh client: the engine's carries the right token
        return httpx.request(
            route.method, f"{engine.url}{route.path}", content=b"{}", headers=headers
        )

    open_answer = request(None).status_code
    for authorization in WRONG_TOKENS + NO_BEARER:
        response = request(authorization)
        if engine.client.headers.get("Authorization") is None:  # no token set: ignored
            assert response.status_code == open_answer, (authorization, response.text[:300])
        elif authorization in WRONG_TOKENS:
            _assert_error(response, 403, "invalid API token")
        else:
            _assert_error(response, 401, "this route needs 'Authorization: Bearer <token>'")
    assert_alive_and_unchanged(engine, baseline)


@pytest.mark.parametrize(
    ("temperature", "top_p"), [(1.0, 1e-300), (5e-324, 1.0), (1e-40, 1e-9)], ids=str
)
def test_extreme_sampling_parameters_keep_the_engine_serving(
    engine: ServedEngine, baseline: WeightsIdentity, temperature: float, top_p: float
) -> None:
    # both once killed rank 0 (torch.multinomial on an all-zero or NaN distribution)
    body = {"prompt": [5, 6], "max_tokens": 4, "temperature": temperature, "top_p": top_p}
    response = engine.complete(**body, seed=1)
    assert response.status_code == 200, response.text
    greedy = engine.complete(prompt=[5, 6], max_tokens=4, temperature=0)
    assert response.json()["choices"][0]["token_ids"] == greedy.json()["choices"][0]["token_ids"]
    assert_alive_and_unchanged(engine, baseline)


def test_the_weights_serve_as_before(engine: ServedEngine, baseline: WeightsIdentity) -> None:
    # last in the module: after every refused request above, the same weights answer
    assert weights_identity(engine) == baseline
