"""NIXL's UCX transports, as far as they are known without starting UCX: the `UCX_TLS` the user
set, the transports `ucx_info -d` lists when it is installed, and the UCX modules the NIXL wheels
ship (a module that loads may still find no hardware). Nothing is guessed: "unknown" otherwise."""

import os
import shutil
import subprocess
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution

# the CUDA builds the `nixl` meta package picks from at import
NIXL_BUILDS = ("nixl-cu12", "nixl-cu13")
_UCT_MODULE_PREFIX = "libuct_"
UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class UcxReport:
    """Attributes:
    ucx_tls: the `UCX_TLS` environment variable (None: unset, UCX picks from all it finds).
    transports: the transports `ucx_info -d` lists, or "unknown (why)" without them.
    shipped_modules: the UCX transport modules in the installed NIXL wheels (`ib`, `cma`, ...).
    """

    ucx_tls: str | None
    transports: list[str] | str
    shipped_modules: list[str]


def ucx_info_transports(timeout_s: float = 5.0) -> list[str] | str:
    """The `Transport:` names of `ucx_info -d`, or "unknown (why)" when it is absent or fails."""
    command = shutil.which("ucx_info")
    if command is None:
        return f"{UNKNOWN} (no ucx_info on PATH)"
    try:
        done = subprocess.run(  # noqa: S603 - the ucx_info found on PATH, our arguments
            [command, "-d"], capture_output=True, text=True, timeout=timeout_s, check=True
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{UNKNOWN} (ucx_info -d: {exc})"
    names = [
        line.split(":", 1)[1].strip() for line in done.stdout.splitlines() if "Transport:" in line
    ]
    return sorted(set(names))


def _is_uct_module(file_name: str) -> bool:
    return file_name.startswith(_UCT_MODULE_PREFIX) and ".so" in file_name


def shipped_modules() -> list[str]:
    """UCX transport modules (`libuct_<name>.so`) listed in the NIXL wheels' file records."""
    modules = set()
    for build in NIXL_BUILDS:
        try:
            files = distribution(build).files or []
        except PackageNotFoundError:
            continue
        for path in files:
            if path.parent.name == "ucx" and _is_uct_module(path.name):
                modules.add(path.name.removeprefix(_UCT_MODULE_PREFIX).split(".so")[0])
    return sorted(modules)


def ucx_report() -> UcxReport:
    return UcxReport(os.environ.get("UCX_TLS"), ucx_info_transports(), shipped_modules())
