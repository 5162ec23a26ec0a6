"""Who may reach the engine's admin routes: loopback binding and the token's form."""

import pytest

from weightbus.engines.reference.server.auth import is_loopback
from weightbus.engines.reference.server.launcher import ServeConfig


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.1.2.3", False),
        ("192.168.0.1", False),
        ("128.0.0.1", False),
        ("localhost.example.com", False),
        ("engine-0", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "engine-0"])
def test_public_host_needs_a_token(host: str) -> None:
    with pytest.raises(ValueError, match=rf"^--host {host} is reachable .* set --api-token"):
        ServeConfig(host=host)
    assert ServeConfig(host=host, api_token="t0ken").api_token == "t0ken"


@pytest.mark.parametrize("token", ["", "two words", "tab\there", "caf\u00e9", "new\nline"])
def test_token_must_be_visible_ascii(token: str) -> None:
    with pytest.raises(ValueError, match="--api-token must be non-empty visible ASCII"):
        ServeConfig(api_token=token)


def test_token_is_not_in_the_repr() -> None:
    assert "s3cret" not in repr(ServeConfig(api_token="s3cret"))
