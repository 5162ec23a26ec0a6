"""The cluster harness itself: links carry the rate they were given (egress and ingress), a
crash leaves nothing behind, and a process without the privilege is told why in one line."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weightbus.apps import netns
from weightbus.apps.cluster import start_cluster, unavailable
from weightbus.apps.cluster.linkrate import measure

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")

MBIT = 10**6


@pytest.mark.parametrize(("rate", "nbytes"), [(200 * MBIT, 16 << 20), (1000 * MBIT, 64 << 20)])
def test_a_link_carries_its_rate_out_of_and_into_a_host(rate, nbytes):
    with start_cluster(2, rate) as made:
        first, second = made.hosts
        between_hosts = measure(made, first, second, nbytes)  # both ends limited
        into_host = measure(made, None, second, nbytes)  # the gateway is not: the ingress limit
        out_of_host = measure(made, first, None, nbytes)  # the egress limit alone
    for measured in (between_hosts, into_host, out_of_host):
        assert 0.9 * rate <= measured <= 1.1 * rate, (measured / MBIT, rate / MBIT)


_CRASHING_MAKER = """
import sys, time
from weightbus.apps.cluster import start_cluster
made = start_cluster(2, 100_000_000)
made.popen(made.hosts[0], ["sleep", "600"])
print(made.gateway_link, flush=True)
time.sleep(600)
"""


def test_a_killed_maker_leaves_no_namespace_link_or_process():
    maker = subprocess.Popen([sys.executable, "-c", _CRASHING_MAKER], stdout=subprocess.PIPE)
    try:
        gateway = maker.stdout.readline().decode().strip()
        assert gateway, "the maker did not start its cluster"
        names = _namespaces_of(maker.pid)
        assert len(names) == 3  # the switch and two hosts
        sleepers = [int(pid) for name in names for pid in netns.ip("netns", "pids", name).split()]
        assert sleepers
    finally:
        os.kill(maker.pid, signal.SIGKILL)
        maker.wait()
    deadline = time.monotonic() + 30
    while _namespaces_of(maker.pid) or gateway in netns.ip("-o", "link"):
        assert time.monotonic() < deadline, "the dead maker's cluster is still there"
        time.sleep(0.05)
    assert not [pid for pid in sleepers if _running(pid)]


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _namespaces_of(pid: int) -> list[str]:
    listed = [line.split(" ", 1)[0] for line in netns.ip("netns", "list").splitlines()]
    return [name for name in listed if name.endswith(f"-{pid}") and name.startswith("wb-")]


def test_without_the_privilege_the_bench_says_why_in_one_line():
    drop = ["setpriv", "--bounding-set=-net_admin,-sys_admin", "--inh-caps=-all"]
    done = subprocess.run(
        [*drop, sys.executable, "-m", "weightbus", "bench", "cluster"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == (
        "weightbus bench cluster: network namespaces need CAP_NET_ADMIN and CAP_SYS_ADMIN "
        "(run as root), which this process lacks\n"
    )
