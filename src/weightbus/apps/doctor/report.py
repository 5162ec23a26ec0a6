"""One report of this host (`diagnose`): plain JSON values, which `text.report_text` lays out
as one screen."""

import dataclasses
import platform
from typing import Any

from weightbus import __version__
from weightbus.apps.doctor import host
from weightbus.apps.doctor.packages import Package, optional_packages, vllm_plugin_registered
from weightbus.apps.doctor.shm import SHM_DIR, shm_report
from weightbus.apps.doctor.torch_build import torch_build
from weightbus.apps.doctor.ucx import ucx_report


def package_entry(package: Package) -> dict[str, Any]:
    entry = dataclasses.asdict(package)
    entry["installed"] = package.installed
    return entry


def missing_pieces(report: dict[str, Any]) -> list[dict[str, str]]:
    """Every piece that is missing or does not work, with the line that installs or enables it
    (one line per distinct fix)."""
    pieces = [(name, p["install"]) for name, p in report["packages"].items() if not p["installed"]]
    for section, label in (("transports", "transport"), ("engines", "engine")):
        pieces += [(f"{label} {n}", a["fix"]) for n, a in report[section].items() if a["fix"]]
    if report["namespaces"]["fix"]:
        pieces.append(("network namespaces and tc", report["namespaces"]["fix"]))
    if report["shm"]["fix"]:
        pieces.append((str(SHM_DIR), report["shm"]["fix"]))
    fixes: dict[str, list[str]] = {}
    for what, fix in pieces:
        fixes.setdefault(fix, []).append(what)
    return [{"what": ", ".join(whats), "fix": fix} for fix, whats in fixes.items()]


def diagnose(model_bytes: int | None = None) -> dict[str, Any]:
    """What this host can do, as plain JSON values.

    Args:
        model_bytes: a model size to hold /dev/shm against, or None.

    Returns:
        `weightbus`, `python`, `torch`, `packages` (vllm, nixl, ray, trl, peft; vllm with
        `plugin_registered`, nixl with `ucx`), `shm`, `namespaces`, `transports`, `engines`,
        and `missing`: each missing piece with its `fix`.
    """
    torch = torch_build()
    packages = optional_packages(torch.cpu_build)
    registered = vllm_plugin_registered()
    report: dict[str, Any] = {
        "weightbus": __version__,
        "python": platform.python_version(),
        "torch": dataclasses.asdict(torch),
        "packages": {name: package_entry(p) for name, p in packages.items()},
        "shm": dataclasses.asdict(shm_report(model_bytes)),
        "namespaces": dataclasses.asdict(host.namespaces()),
        "transports": _asdicts(host.transports(packages["nixl"])),
        "engines": _asdicts(host.engines(packages["vllm"], registered)),
    }
    report["packages"]["vllm"]["plugin_registered"] = registered
    report["packages"]["nixl"]["ucx"] = dataclasses.asdict(ucx_report())
    report["missing"] = missing_pieces(report)
    return report


def _asdicts(items: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(item) for name, item in items.items()}
