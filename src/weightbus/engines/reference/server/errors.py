"""Errors of the HTTP API, all answered as `{"error": {message, type, param, code}, ...}`."""

import json
import math
from collections.abc import Sequence
from typing import Any

from fastapi.encoders import jsonable_encoder
from starlette.responses import JSONResponse

# A 422 answer says what was wrong, it does not echo the request (up to the body limit, 8 MiB):
# each error's `input` is cut to ECHO_CHARS of its JSON text, every other string (`loc` may name
# an unknown key, `msg` and `ctx` may quote the input) to TEXT_CHARS, and `detail` lists the
# first errors up to MAX_DETAIL_ERRORS and DETAIL_CHARS (the first one always).
ECHO_CHARS = 256
TEXT_CHARS = 1024
MAX_DETAIL_ERRORS = 16
DETAIL_CHARS = 8192


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


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [truncated, {len(text)} characters]"


def _clip_strings(value: object) -> object:
    if isinstance(value, str):
        return _clip(value, TEXT_CHARS)
    if isinstance(value, dict):
        return {_clip_strings(key): _clip_strings(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_clip_strings(item) for item in value]
    return value


def _echo(value: object) -> object:
    # the input itself when short, else the start of its text (a string's own, or its JSON)
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return value if len(text) <= ECHO_CHARS else _clip(text, ECHO_CHARS)


def _bytes_text(data: bytes) -> str:
    return data.decode("utf-8", "backslashreplace")


def validation_detail(errors: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The `detail` of a 422 answer: the validation errors, bounded in size.

    Args:
        errors: FastAPI's `RequestValidationError.errors()` (they carry the offending `input`).

    Returns:
        The first errors, JSON-able, each `input` cut to `ECHO_CHARS` of its JSON text and every
        other string to `TEXT_CHARS` (a cut one ends with `... [truncated, N characters]`), at
        most `MAX_DETAIL_ERRORS` of them and `DETAIL_CHARS` of JSON in all (the first error is
        always kept); and how many errors were left out.
    """
    detail: list[dict[str, Any]] = []
    size = 0
    # a body of another content type arrives as bytes, which need not be UTF-8
    encoded = jsonable_encoder(
        list(errors[:MAX_DETAIL_ERRORS]), custom_encoder={bytes: _bytes_text}
    )
    for error in encoded:
        bounded = {
            key: _echo(value) if key == "input" else _clip_strings(value)
            for key, value in error.items()
        }
        size += len(json.dumps(bounded, ensure_ascii=False))
        if detail and size > DETAIL_CHARS:
            break
        detail.append(bounded)
    return detail, len(errors) - len(detail)


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
