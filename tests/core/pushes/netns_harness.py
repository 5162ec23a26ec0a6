"""An engine's own network namespace, joined to the test's by two veth links: a control link
(HTTP) and a data link (the weights), so a test can cut the data link and keep talking."""

import os
import subprocess
import time
from dataclasses import dataclass

import pytest

from weightbus.apps import netns
from weightbus.apps.netns import ip


@dataclass(frozen=True)
class Namespaces:
    """The engine's namespace, joined to this one by a control link and a data link."""

    name: str
    control_host: str  # this side of the control link (HTTP)
    engine_control_host: str
    data_host: str  # this side of the data link (the weights)
    data_link: str  # this side's interface of the data link
    engine_data_link: str  # the engine's interface of the data link
    control_link: str  # this side's interface of the control link


def create_namespaces() -> Namespaces | None:
    """The engine's namespace and its two links (None where namespaces cannot be made).

    Made once per test session, before any test runs: UCX (transport `nixl`) reads the
    routing table once per process, so links made after its first use are unreachable to it.
    Namespaces that earlier runs left behind (killed before deleting them) are deleted first,
    and the subnet is one no address or route uses.
    """
    if netns.unavailable() is not None:
        return None
    netns.reap_stale()
    tag, subnet = os.getpid(), netns.free_subnet()
    name = netns.namespace_name("engine")
    links = {"control": (f"wbc{tag}a", f"wbc{tag}b", 1), "data": (f"wbd{tag}a", f"wbd{tag}b", 2)}
    ip("netns", "add", name)
    try:
        ip("-n", name, "link", "set", "lo", "up")
        for ours, theirs, third in links.values():
            ip("link", "add", ours, "type", "veth", "peer", "name", theirs, "netns", name)
            ip("addr", "add", f"10.{subnet}.{third}.1/24", "dev", ours)
            ip("-n", name, "addr", "add", f"10.{subnet}.{third}.2/24", "dev", theirs)
            ip("link", "set", ours, "up")
            ip("-n", name, "link", "set", theirs, "up")
    except BaseException:
        delete_namespaces(name)
        raise
    return Namespaces(
        name=name,
        control_host=f"10.{subnet}.1.1",
        engine_control_host=f"10.{subnet}.1.2",
        data_host=f"10.{subnet}.2.1",
        data_link=links["data"][0],
        engine_data_link=links["data"][1],
        control_link=links["control"][0],
    )


def delete_namespaces(name: str) -> None:
    """Delete the namespace (its veth links go with it)."""
    ip("netns", "del", name, check=False)


@pytest.fixture
def namespaces(engine_namespaces: Namespaces | None) -> Namespaces:
    """The session's engine namespace, both links up (tests that cut one bring it back)."""
    if engine_namespaces is None:
        pytest.skip(netns.unavailable() or "the engine's namespace could not be made")
    for link in (engine_namespaces.control_link, engine_namespaces.data_link):
        link_up(link)
    return engine_namespaces


def link_up(link: str, timeout_s: float = 30.0) -> None:
    """Bring `link` up and wait until it carries packets again (its routes are back)."""
    ip("link", "set", link, "up")
    deadline = time.monotonic() + timeout_s
    while "LOWER_UP" not in _link_flags(link):
        assert time.monotonic() < deadline, f"{link} did not come up in {timeout_s} s"
        time.sleep(0.05)


def _link_flags(link: str) -> str:
    shown = subprocess.run(
        ["ip", "-o", "link", "show", "dev", link],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return shown.stdout.split(">", 1)[0]


class CutLinkAfterFirstBucket:
    """Progress callback: takes the data link down once the first bucket was sent."""

    def __init__(self, link: str) -> None:
        self.link = link
        self.cut = False

    def __call__(self, nbytes: int) -> None:
        if nbytes and not self.cut:
            ip("link", "set", self.link, "down")
            self.cut = True
