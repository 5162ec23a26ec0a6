"""Errors of the HTTP API, all answered as `{"error": {message, type, param, code}, ...}`."""

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
    return JSONResponse(status_code=status_code, content=body, headers=headers)
