"""Errors of the HTTP API, all answered as `{"error": {message, type, param, code}, ...}`."""

import math

from starlette.responses import JSONResponse


class APIError(Exception):
    """An error answered as `{"error": {...}}` with an HTTP status.

    Args:
        status_code: the HTTP status.
        message: what went wrong, for a person.
        param: the request field at fault, if one is.
        extra: more top-level keys of the body (e.g. `names` of offending tensors).
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        extra: dict[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.extra = extra or {}


def error_type(status_code: int) -> str:
    """OpenAI-style `type` of an error with this status."""
    if status_code in (401, 403):
        return "authentication_error"
    return "invalid_request_error" if status_code < 500 else "server_error"


def json_safe(value: object) -> object:
    """`value` with what strict JSON in UTF-8 cannot carry replaced by its text.

    Validation details echo the request's input, which Python's JSON reader accepts but no
    answer may contain: non-finite numbers (`NaN`, `1e400`) become `"nan"`, `"inf"`; lone
    surrogates (`"\\ud800"`) become their escape sequence.

    Args:
        value: a JSON-able value (dicts, lists, strings, numbers, None).

    Returns:
        The value, renderable by `JSONResponse`.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {json_safe(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


def error_response(
    status_code: int,
    message: str,
    param: str | None = None,
    *,
    headers: dict[str, str] | None = None,
    **extra: object,
) -> JSONResponse:
    """The JSON error body every route and middleware answers with.

    Args:
        status_code: the HTTP status.
        message: what went wrong.
        param: the request field at fault, if one is.
        headers: extra response headers.
        **extra: more top-level keys of the body.

    Returns:
        The response.
    """
    body = {
        "error": {
            "message": message,
            "type": error_type(status_code),
            "param": param,
            "code": status_code,
        },
        **extra,
    }
    return JSONResponse(status_code=status_code, content=json_safe(body), headers=headers)
