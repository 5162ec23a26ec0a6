import json
import subprocess
import sys

import pytest

from weightbus import __version__

# every test runs `python -m weightbus` (tiers: tests/conftest.py)
pytestmark = pytest.mark.e2e


def _weightbus(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weightbus", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_help_lists_commands():
    result = _weightbus("--help")
    assert result.returncode == 0
    assert "bench" in result.stdout


def test_version():
    result = _weightbus("--version")
    assert result.stdout.strip() == f"weightbus {__version__}"


def test_bucket_benchmark_reports_its_ratio_to_memcpy(tmp_path):
    out = tmp_path / "bench.json"
    result = _weightbus(
        "bench",
        "buckets",
        "--size",
        "8MiB",
        "--bucket-bytes",
        "1MiB",
        "--repeat",
        "1",
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert "x memcpy bandwidth" in result.stdout
    report = json.loads(out.read_text())
    assert report["model_bytes"] >= 4 * 2**20
    assert report["pack_ratio"] > 0
    assert report["rows"][0]["name"].startswith("floor: memcpy")


def test_bad_size_is_a_usage_error():
    result = _weightbus("bench", "buckets", "--size", "lots")
    assert result.returncode == 2
    assert "argument --size: invalid size 'lots'" in result.stderr
    assert "Traceback" not in result.stderr
