"""The report as one screen of text: a section per concern, then the missing pieces."""

from typing import Any

from weightbus.core.units import format_bytes

_OK, _NO = "ok", "--"


def torch_lines(torch: dict[str, Any]) -> list[str]:
    lines = [f"  torch {torch['version']} ({torch['build']} build), {torch['cpu_count']} CPUs"]
    for device in torch["devices"]:
        memory = format_bytes(device["memory_bytes"])
        lines.append(f"  device {device['index']}: {device['name']} ({memory})")
    if not torch["devices"]:
        lines.append("  no accelerator")
    return lines


def package_line(name: str, package: dict[str, Any]) -> str:
    if not package["installed"]:
        return f"  {_NO} {name:<6} missing: {package['install']}"
    line = f"  {_OK} {name:<6} {package['distribution']} {package['version']}"
    if name == "vllm":
        registered = "registered" if package["plugin_registered"] else "NOT registered"
        line += f", backend weightbus {registered}"
    return line


def ucx_lines(ucx: dict[str, Any]) -> list[str]:
    tls = ucx["ucx_tls"] or "(unset)"
    return [
        f"         UCX_TLS={tls}, transports: {_listed(ucx['transports'])}",
        f"         UCX modules in the wheels: {_listed(ucx['shipped_modules'])}",
    ]


def package_lines(packages: dict[str, Any]) -> list[str]:
    lines = []
    for name, package in packages.items():
        lines.append(package_line(name, package))
        if name == "nixl" and package["installed"]:
            lines += ucx_lines(package["ucx"])
    return lines


def shm_lines(shm: dict[str, Any]) -> list[str]:
    lines = [
        f"  /dev/shm {format_bytes(shm['size_bytes'])}, {format_bytes(shm['free_bytes'])} free"
    ]
    if shm["model_bytes"] is None:
        return lines
    lines.append(
        f"  a push of {format_bytes(shm['model_bytes'])} into one engine on this host keeps:"
    )
    for use in shm["uses"]:
        verdict = "fits" if use["fits"] else "does NOT fit"
        lines.append(f"    {use['name']:<52} {format_bytes(use['need_bytes']):>11}  {verdict}")
    return lines


def availability_lines(items: dict[str, Any]) -> list[str]:
    lines = []
    for name, item in items.items():
        mark = _OK if item["available"] else _NO
        lines.append(f"  {mark} {name:<10} {item['reason'] or ''}".rstrip())
    return lines


def missing_lines(missing: list[dict[str, str]]) -> list[str]:
    if not missing:
        return ["  nothing"]
    return [f"  {piece['what']}: {piece['fix']}" for piece in missing]


def _listed(values: list[str] | str) -> str:
    if isinstance(values, str):
        return values
    return ", ".join(values) or "none"


def report_text(report: dict[str, Any]) -> str:
    namespaces = report["namespaces"]
    sections = [
        (f"weightbus {report['weightbus']}, Python {report['python']}", []),
        ("torch", torch_lines(report["torch"])),
        ("packages", package_lines(report["packages"])),
        ("shared memory", shm_lines(report["shm"])),
        ("privileges (weightbus bench cluster)", availability_lines({"netns+tc": namespaces})),
        ("transports", availability_lines(report["transports"])),
        ("engines", availability_lines(report["engines"])),
        ("missing", missing_lines(report["missing"])),
    ]
    return "\n".join(line for title, lines in sections for line in (title, *lines))
