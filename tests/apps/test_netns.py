"""Test and bench hosts in network namespaces: a namespace whose maker died (SIGKILL, a
timeout) is deleted by the next run, with its links, and a subnet in use is never picked
again (a leftover used to capture the next run's routes)."""

import subprocess
import time

import pytest

from weightbus.apps import netns


def test_a_dead_makers_namespace_is_reaped_and_a_used_subnet_is_avoided():
    if reason := netns.unavailable():
        pytest.skip(reason)
    maker = subprocess.Popen(["true"])  # a process that is gone by now
    maker.wait()
    name, link = f"wb-test-{maker.pid}", f"wbt{maker.pid}a"
    netns.ip("netns", "add", name)
    try:
        netns.ip("link", "add", link, "type", "veth", "peer", "name", f"wbt{maker.pid}b")
        netns.ip("link", "set", f"wbt{maker.pid}b", "netns", name)
        taken = netns.free_subnet()
        netns.ip("addr", "add", f"10.{taken}.1.1/24", "dev", link)
        netns.ip("link", "set", link, "up")
        assert netns.free_subnet() != taken
        assert name in netns.reap_stale()
        assert name not in netns.ip("netns", "list")
        # the veth goes with its namespace, once the kernel's deferred namespace clean-up ran
        deadline = time.monotonic() + 10
        while link in netns.ip("-o", "link") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert link not in netns.ip("-o", "link")
    finally:
        netns.ip("link", "del", link, check=False)
        netns.ip("netns", "del", name, check=False)
