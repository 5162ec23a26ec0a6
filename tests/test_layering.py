"""The layering contracts (`[tool.importlinter]` in pyproject.toml) hold, and the checker that
`make test` runs catches a deliberate bad import against each of them: the wings (library,
engines, integrations, apps), the library's layers and the transports."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
pytestmark = pytest.mark.e2e  # runs the checker as a child process


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """Run the contracts of pyproject.toml against the package under `tree/src`."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(tree / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    shutil.copytree(
        ROOT / "src" / "weightbus",
        tmp_path / "src" / "weightbus",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_contracts_hold(package_copy: Path):
    result = _lint_imports(package_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 7 kept, 0 broken." in result.stdout


@pytest.mark.parametrize(
    ("module", "bad_import", "contract"),
    [
        (
            "core/transport/disk.py",
            "from weightbus.engines.reference.models.loader import create_model",
            "The library imports neither the engines, the integrations nor the apps BROKEN",
        ),
        (
            "integrations/trl/pushes.py",
            "from weightbus.apps.launch import start_engine",
            "An integration imports the library and the engines' targets, not the apps BROKEN",
        ),
        (
            "engines/vllm/staging.py",
            "from weightbus.apps.launch import start_engine",
            "An engine imports the library only BROKEN",
        ),
        (
            "engines/vllm/reload.py",
            "import weightbus.engines.reference.server.api",
            "Engines are independent of each other BROKEN",
        ),
        (
            "apps/launch.py",
            "from weightbus.apps.bench import cli",
            "Apps import what they like, but not each other in circles BROKEN",
        ),
        (
            "core/plan/planner.py",
            "from weightbus.core.wire import ProtocolError",
            "Library layers only look down: the path of a weight BROKEN",
        ),
        (
            "core/transport/hf_dir.py",
            "from weightbus.core.transport.disk import DiskSink",
            "Transports do not import each other (shared parts live in transport/ itself) BROKEN",
        ),
    ],
    ids=[
        "library imports an engine",
        "integration imports an app",
        "engine imports an app",
        "engine imports engine",
        "apps in a circle",
        "upward import",
        "transport imports transport",
    ],
)
def test_a_deliberate_bad_import_fails_the_check(
    package_copy: Path, module: str, bad_import: str, contract: str
):
    path = package_copy / "src" / "weightbus" / module
    path.write_text(f"{path.read_text()}\n{bad_import}  # noqa: F401, E402\n")
    result = _lint_imports(package_copy)
    assert result.returncode != 0
    assert contract in result.stdout
    assert "Contracts: 6 kept, 1 broken." in result.stdout
