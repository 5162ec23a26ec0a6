"""Bearer-token protection of the admin routes, and the loopback test behind `--api-token`.

Protection is deny-by-default: with a token set, every path except the public ones
(`PUBLIC_PATHS`) needs `Authorization: Bearer <token>`, so a route added later is protected
without anyone remembering to. The check runs as ASGI middleware, before the body is read.
"""

import ipaddress
import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from weightbus.engines.reference.server.errors import error_response

# Inference and monitoring stay open: they change nothing in the engine.
PUBLIC_PATHS = frozenset({"/v1/completions", "/v1/models", "/health", "/metrics"})


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server reachable from this machine only.

    Args:
        host: an address or a host name, as given to `--host`.

    Returns:
        True for `localhost`, 127.0.0.0/8 and ::1; False for anything else (names included:
        they may resolve anywhere).
    """
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, credentials = value.partition(b" ")
            return credentials.strip() if scheme.lower() == b"bearer" else None
    return None


class TokenAuth:
    """ASGI middleware: admin routes answer 401 without a bearer token, 403 with a wrong one.

    Args:
        app: the wrapped app.
        token: the expected token; None lets every request through.
    """

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self._token = None if token is None else token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the token of an HTTP request to a non-public path, then pass it on."""
        if self._token is None or scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        given = _bearer(scope)
        if given is None:
            response = error_response(
                401,
                "this route needs 'Authorization: Bearer <token>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        elif not secrets.compare_digest(given, self._token):
            response = error_response(403, "invalid API token")
        else:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)
