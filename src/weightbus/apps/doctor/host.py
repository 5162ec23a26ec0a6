"""What works on this host: network namespaces and `tc` (the cluster bench), each registered
transport, each engine; what does not, with why and the line that enables it."""

import os
from dataclasses import dataclass

import torch.distributed

from weightbus.apps.cluster import unavailable as cluster_unavailable
from weightbus.apps.doctor.packages import VLLM_PLUGIN_INSTALL, Package
from weightbus.apps.doctor.shm import SHM_DIR, SHM_MOUNT
from weightbus.core.transport import transport_names

NAMESPACES_FIX = "run as root, or with CAP_NET_ADMIN and CAP_SYS_ADMIN"
IPROUTE2_FIX = "apt-get install iproute2"
SHARED_DIRECTORY = "a directory the engines read (default under /dev/shm: root=)"
GLOO_FIX = "install a torch build with torch.distributed and gloo (the PyPI wheels have both)"


@dataclass(frozen=True, slots=True)
class Availability:
    """Attributes:
    available: it works on this host.
    reason: why not (or a note when it works), or None.
    fix: the line that installs or enables it, or None.
    """

    available: bool
    reason: str | None = None
    fix: str | None = None


def namespaces() -> Availability:
    """Network namespaces and `tc` rate limits, as `weightbus bench cluster` makes them."""
    reason = cluster_unavailable()
    if reason is None:
        return Availability(True)
    fix = IPROUTE2_FIX if "iproute2" in reason else NAMESPACES_FIX
    return Availability(False, reason, fix)


def shm_writable() -> Availability:
    if os.access(SHM_DIR, os.W_OK):
        return Availability(True, "engines on this host only")
    return Availability(False, f"{SHM_DIR} is missing or not writable", SHM_MOUNT)


def gloo() -> Availability:
    if torch.distributed.is_available() and torch.distributed.is_gloo_available():
        return Availability(True, "torch.distributed gloo")
    return Availability(False, "needs torch.distributed with gloo", GLOO_FIX)


def nixl_installed(nixl: Package) -> Availability:
    if nixl.installed:
        return Availability(True, f"nixl {nixl.version}")
    return Availability(False, "needs the nixl package", nixl.install)


def transport(name: str, nixl: Package) -> Availability:
    """Whether transport `name` works here (a plugin's transport is not checked)."""
    checks = {
        "disk": lambda: Availability(True, SHARED_DIRECTORY),
        "hf_dir": lambda: Availability(True, SHARED_DIRECTORY),
        "shm": shm_writable,
        "dist": gloo,
        "nixl": lambda: nixl_installed(nixl),
    }
    check = checks.get(name)
    return check() if check else Availability(True, "registered by a plugin (not checked)")


def transports(nixl: Package) -> dict[str, Availability]:
    return {name: transport(name, nixl) for name in transport_names()}


def vllm_engine(vllm: Package, plugin_registered: bool) -> Availability:
    if not vllm.installed:
        return Availability(False, "vLLM is not installed", vllm.install)
    if not plugin_registered:
        return Availability(
            False, "backend `weightbus` is not registered with vLLM", VLLM_PLUGIN_INSTALL
        )
    return Availability(True, f"{vllm.distribution} {vllm.version}, backend `weightbus`")


def engines(vllm: Package, plugin_registered: bool) -> dict[str, Availability]:
    return {
        "reference": Availability(True, "weightbus serve"),
        "vllm": vllm_engine(vllm, plugin_registered),
    }
