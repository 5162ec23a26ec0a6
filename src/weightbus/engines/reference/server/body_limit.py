"""A bound on request bodies: larger ones answer 413 before any JSON parsing."""

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from weightbus.engines.reference.server.errors import error_response

# Far above any admin body or prompt list the engine can take (a 32k-token text prompt is
# ~128 KiB), far below what would hurt the server's memory.
DEFAULT_MAX_BODY_BYTES = 8 * 2**20


# scope key: the request's body is JSON `null` (set for every bounded request)
NULL_BODY_KEY = "weightbus.null_body"


class _BodyTooLargeError(Exception):
    pass


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value)  # ValueError: malformed header
    return None


async def _read_body(receive: Receive, max_body_bytes: int) -> bytes | None:
    # None: the client went away before sending the whole body
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_body_bytes:
            raise _BodyTooLargeError
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class BodyLimit:
    """ASGI middleware: reads each request body up to `max_body_bytes`, else answers 413.

    The body is read here (checked against `Content-Length` first, then counted, so chunked
    uploads are bounded too) and replayed to the app.

    Args:
        app: the wrapped app.
        max_body_bytes: the largest body accepted.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Bound the body of an HTTP request, then pass the request on."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = error_response(413, f"request body exceeds {self.max_body_bytes} bytes")
        try:
            declared = _declared_length(scope)
            if declared is not None and declared > self.max_body_bytes:
                await too_large(scope, receive, send)
                return
            body = await _read_body(receive, self.max_body_bytes)
        except ValueError:
            await error_response(400, "malformed Content-Length header")(scope, receive, send)
            return
        except _BodyTooLargeError:
            await too_large(scope, receive, send)
            return
        if body is None:
            return
        # a JSON `null` body: FastAPI versions disagree on what to call it (the 422 names it)
        scope[NULL_BODY_KEY] = body.strip() == b"null"
        await self.app(scope, _replay(body, receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:  # later calls wait for the disconnect, as the server's receive does
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
