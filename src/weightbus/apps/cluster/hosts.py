"""A cluster on one machine: N hosts (network namespaces), each with one NIC to a common switch,
rate-limited both ways with `tbf` so the links, not the cores, bound what crosses them.

```
this namespace ── wbg<pid> ─┐            (the gateway: unlimited, for control and checks)
host0 ── eth0 ═══ h0 ───────┤ br0        (switch namespace `wb-switch-<pid>`)
host1 ── eth0 ═══ h1 ───────┘            ═══: tbf at the link rate, egress and ingress
```

Every host's NIC is `eth0` at 10.X.0.(10 + index)/24 (X: a subnet no address or route of this
namespace uses); this namespace reaches them all as 10.X.0.1 over the gateway. A host's egress
is limited on its `eth0`, its ingress on the switch's side of its link (`h<index>`), both at the
link rate.

Teardown: `Cluster.close` (also on exit of the `with` block) kills what runs in the hosts and
deletes every namespace; a watchdog process started first does the same when this process dies
without closing (SIGKILL, OOM): it waits for the end of a pipe only this process holds. The
veths and qdiscs go with their namespaces, the gateway veth with the switch's.
"""

import argparse
import contextlib
import itertools
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from weightbus.apps import netns
from weightbus.apps.launch import start_engine, stop_engines
from weightbus.apps.netns import ip

NIC = "eth0"
# every process on a host reaches the others over its NIC only: UCX's shared-memory and
# cross-memory transports would bypass the emulated links (the hosts share one kernel), and
# gloo would take the address the host name resolves to (loopback)
HOST_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": NIC, "GLOO_SOCKET_IFNAME": NIC}
FIRST_HOST = 10  # host i is 10.X.0.(FIRST_HOST + i)
MAX_HOSTS = 200
_BURST_S = 0.01  # tbf bucket: 10 ms of the rate (at least 64 KiB: one GSO packet)
_MIN_BURST_BYTES = 64 << 10
_QUEUE_S = 0.1  # tbf latency: how long a packet may wait before it is dropped
_WATCHDOG = Path(__file__).with_name("watchdog.py")
_SEQUENCE = itertools.count()  # clusters made by this process: unique gateway links


@dataclass(frozen=True)
class Host:
    """One host: its namespace and its NIC's address."""

    index: int
    namespace: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host (`ip netns exec` execs it: the parent stays ours)."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def nic_bytes(self) -> tuple[int, int]:
        """Bytes this host's NIC has sent and received (link headers included)."""
        shown = json.loads(ip("-n", self.namespace, "-s", "-j", "link", "show", "dev", NIC))
        stats = shown[0]["stats64"]
        return stats["tx"]["bytes"], stats["rx"]["bytes"]


@dataclass
class Cluster:
    """Hosts on one switch, each link at `link_bits_per_s` both ways (None: unlimited)."""

    hosts: list[Host]
    gateway: str  # this namespace's address on the switch
    link_bits_per_s: int | None
    switch: str
    gateway_link: str
    _watchdog: subprocess.Popen
    # the engines' API token (they listen on the hosts' addresses): pass it to publishers
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    _processes: list[subprocess.Popen] = field(default_factory=list)
    _engines: list[subprocess.Popen] = field(default_factory=list)

    def popen(
        self, host: Host, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs
    ) -> subprocess.Popen:
        """Start `argv` inside `host`; killed by `close` if still running."""
        proc = subprocess.Popen(  # noqa: S603 - our own commands
            host.command(argv), env=None if env is None else dict(env), **kwargs
        )
        self._processes.append(proc)
        return proc

    def start_engine(
        self, host: Host, model: str, tp: int, extra: Sequence[str] = ()
    ) -> tuple[subprocess.Popen, str]:
        """`weightbus serve` inside `host` on its NIC's address (UCX over that NIC only): the
        process and its URL; stopped by `close` if still running."""
        env = {**os.environ, **HOST_ENV, "WEIGHTBUS_API_TOKEN": self.token}
        extra = [*extra, "--host", host.address]
        proc, url = start_engine(model, tp, extra=extra, prefix=host.command([]), env=env)
        self._engines.append(proc)
        return proc, url

    def cut(self, host: Host) -> None:
        """Take `host`'s NIC down (`ip link set down`): nothing reaches or leaves it."""
        ip("-n", host.namespace, "link", "set", NIC, "down")

    def restore(self, host: Host, timeout_s: float = 30.0) -> None:
        """Bring `host`'s NIC back up and wait until it carries packets.

        Raises:
            TimeoutError: the link is not up within `timeout_s`.
        """
        ip("-n", host.namespace, "link", "set", NIC, "up")
        deadline = time.monotonic() + timeout_s
        while "LOWER_UP" not in ip("-n", host.namespace, "-o", "link", "show", "dev", NIC):
            if time.monotonic() > deadline:
                raise TimeoutError(f"host {host.index}'s link did not come up in {timeout_s} s")
            time.sleep(0.05)

    def close(self) -> None:
        """Stop the engines (SIGTERM: they free their shared memory), kill what else runs in
        the hosts, and delete every namespace (with their links)."""
        stop_engines(self._engines)
        for proc in self._processes:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        delete_namespaces([host.namespace for host in self.hosts] + [self.switch])
        ip("link", "del", self.gateway_link, check=False)  # else it goes some time later
        self._watchdog.stdin.close()  # it has nothing left to delete
        self._watchdog.wait(timeout=60)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_RATE_UNITS = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}


def bit_rate_arg(text: str) -> int:
    """`200mbit`, `1gbit`, `1.5gbit`: bits per second (tc's units, powers of ten).

    Raises:
        argparse.ArgumentTypeError: not a number and one of kbit, mbit, gbit, bit.
    """
    lowered = text.strip().lower()
    for unit, scale in _RATE_UNITS.items():
        if lowered.endswith(unit):
            try:
                value = float(lowered.removesuffix(unit))
            except ValueError:
                break
            if value > 0:
                return int(value * scale)
            break
    raise argparse.ArgumentTypeError(f"not a link rate: {text!r} (e.g. 200mbit, 1gbit)")


def unavailable() -> str | None:
    """Why this process cannot make a cluster (one line), or None."""
    return netns.unavailable(("ip", "tc"))


def start_cluster(num_hosts: int, link_bits_per_s: int | None) -> Cluster:
    """`num_hosts` hosts on one switch, each link limited to `link_bits_per_s` both ways
    (`with start_cluster(...) as cluster:` closes it on exit).

    Raises:
        PermissionError: this process may not make namespaces (`unavailable` says why).
        ValueError: `num_hosts` outside 1 .. MAX_HOSTS, or a rate < 1 Mbit/s.
    """
    if reason := unavailable():
        raise PermissionError(reason)
    if not 1 <= num_hosts <= MAX_HOSTS:
        raise ValueError(f"num_hosts must be in 1..{MAX_HOSTS}, got {num_hosts}")
    if link_bits_per_s is not None and link_bits_per_s < 1_000_000:
        raise ValueError(f"link_bits_per_s must be >= 1 Mbit/s, got {link_bits_per_s}")
    netns.reap_stale()
    subnet = f"10.{netns.free_subnet()}.0"
    switch = netns.namespace_name("switch")
    hosts = [
        Host(i, netns.namespace_name(f"host{i}"), f"{subnet}.{FIRST_HOST + i}")
        for i in range(num_hosts)
    ]
    watchdog = subprocess.Popen(  # noqa: S603 - this interpreter and our own script
        [sys.executable, "-I", str(_WATCHDOG), switch, *(host.namespace for host in hosts)],
        stdin=subprocess.PIPE,
        start_new_session=True,  # outlives a kill of our process group
    )
    gateway_link = f"wbg{os.getpid()}x{next(_SEQUENCE)}"
    try:
        _make_switch(switch, gateway_link, f"{subnet}.1")
        for host in hosts:
            _make_host(host, switch, link_bits_per_s)
    except BaseException:
        delete_namespaces([host.namespace for host in hosts] + [switch])
        watchdog.stdin.close()
        raise
    return Cluster(hosts, f"{subnet}.1", link_bits_per_s, switch, gateway_link, watchdog)


def _make_switch(switch: str, gateway_link: str, gateway: str) -> None:
    ip("netns", "add", switch)
    ip("-n", switch, "link", "set", "lo", "up")
    ip("-n", switch, "link", "add", "br0", "type", "bridge")
    ip("-n", switch, "link", "set", "br0", "up")
    ip("link", "add", gateway_link, "type", "veth", "peer", "name", "gw", "netns", switch)
    ip("-n", switch, "link", "set", "gw", "master", "br0", "up")
    ip("addr", "add", f"{gateway}/24", "dev", gateway_link)
    ip("link", "set", gateway_link, "up")


def _make_host(host: Host, switch: str, link_bits_per_s: int | None) -> None:
    port = f"h{host.index}"
    ip("netns", "add", host.namespace)
    ip("-n", host.namespace, "link", "set", "lo", "up")
    ip(
        "-n",
        switch,
        "link",
        "add",
        port,
        "type",
        "veth",
        "peer",
        "name",
        NIC,
        "netns",
        host.namespace,
    )
    ip("-n", switch, "link", "set", port, "master", "br0", "up")
    ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", NIC)
    ip("-n", host.namespace, "link", "set", NIC, "up")
    if link_bits_per_s is not None:
        _limit(host.namespace, NIC, link_bits_per_s)  # the host's egress
        _limit(switch, port, link_bits_per_s)  # its ingress: the switch's egress to it


def _limit(namespace: str, device: str, bits_per_s: int) -> None:
    burst_bytes = max(_MIN_BURST_BYTES, int(bits_per_s / 8 * _BURST_S))
    rate = ["rate", f"{bits_per_s}bit", "burst", str(burst_bytes), "latency", f"{_QUEUE_S}s"]
    subprocess.run(  # noqa: S603 - our own arguments
        ["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", *rate],  # noqa: S607
        check=True,
        capture_output=True,
        timeout=30,
    )


def delete_namespaces(names: Sequence[str]) -> None:
    """Kill every process inside each namespace, then delete it (its links go with it: a
    namespace with a process left in it would live on, links and all)."""
    for name in names:
        for pid in ip("netns", "pids", name, check=False).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
        ip("netns", "del", name, check=False)
