"""Network namespaces as test and benchmark hosts: the `ip` command, a free subnet, and the
clean-up of namespaces left behind by processes that died before deleting them.

Every namespace weightbus makes is named `wb-<role>-<pid>` after the process that made it, so
`reap_stale` can tell one whose maker is gone (killed by a timeout, by SIGKILL) and delete it:
left alone, its veth links keep their addresses and routes in this namespace, and a later run
that picked the same subnet would route to the dead one.
"""

import ipaddress
import os
import re
import shutil
import subprocess
from pathlib import Path

_NAME = re.compile(r"^wb-[a-z0-9]+-(\d+)$")
_FIRST_SUBNET, _SUBNETS = 20, 200  # 10.20.0.0/16 .. 10.219.0.0/16


def ip(*args: str, check: bool = True) -> str:
    """Run `ip ARGS`; its output.

    Raises:
        subprocess.CalledProcessError: the command failed (with `check`).
    """
    done = subprocess.run(  # noqa: S603 - our own arguments
        ["ip", *args],  # noqa: S607 - iproute2 from PATH
        check=check,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.stdout


# Capability bits (linux/capability.h): `ip netns add` mounts (CAP_SYS_ADMIN), links and
# qdiscs need CAP_NET_ADMIN.
_CAPABILITIES = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}


def unavailable(commands: tuple[str, ...] = ("ip",)) -> str | None:
    """Why this process cannot make namespaces (one line), or None; `commands`: the tools
    needed besides (`tc` for rate limits)."""
    missing = [name for name, bit in _CAPABILITIES.items() if not _effective() >> bit & 1]
    if missing:
        return (
            f"network namespaces need {' and '.join(missing)} (run as root), "
            "which this process lacks"
        )
    absent = [command for command in commands if shutil.which(command) is None]
    if absent:
        return f"the {', '.join(absent)} command(s) (iproute2) are not installed"
    return None


def _effective() -> int:
    """This process's effective capability set (`CapEff` in /proc/self/status)."""
    for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def namespace_name(role: str) -> str:
    """`wb-<role>-<pid>` (`role`: lower-case letters and digits): the name `reap_stale`
    recognises."""
    return f"wb-{role}-{os.getpid()}"


def reap_stale() -> list[str]:
    """Delete the weightbus namespaces whose maker is no longer alive; their names."""
    reaped = []
    for line in ip("netns", "list", check=False).splitlines():
        name = line.split(" ", 1)[0]
        match = _NAME.match(name)
        if match and not _alive(int(match.group(1))):
            ip("netns", "del", name, check=False)
            reaped.append(name)
    return reaped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_subnet() -> int:
    """An `X` such that no address or route of this namespace lies in 10.X.0.0/16 (tried from
    one that depends on the pid, so concurrent runs start apart).

    Raises:
        RuntimeError: every candidate is taken.
    """
    used = _used_networks()
    start = os.getpid() % _SUBNETS
    for step in range(_SUBNETS):
        second = _FIRST_SUBNET + (start + step) % _SUBNETS
        candidate = ipaddress.ip_network(f"10.{second}.0.0/16")
        if not any(candidate.overlaps(network) for network in used):
            return second
    raise RuntimeError("no free 10.X.0.0/16 subnet for a test namespace")


def _used_networks() -> list[ipaddress.IPv4Network]:
    networks = []
    listing = ip("-4", "-o", "addr", "show") + ip("-4", "route", "show", "table", "all")
    for word in listing.split():
        if word[:1].isdigit() and "." in word:
            try:
                networks.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    return networks
