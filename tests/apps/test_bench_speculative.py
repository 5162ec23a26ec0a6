"""`weightbus bench engine --draft` runs end to end: three real engines (no draft, a draft
pushed every step, the step-0 draft kept), one RL step, a row per step and the greedy rows."""

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e  # starts `weightbus serve` (through the bench)


def test_bench_engine_draft_reports_every_engine(tmp_path):
    command = [sys.executable, "-m", "weightbus", "--log-level", "WARNING", "bench", "engine"]
    command += ["--draft", "--tp", "1", "--steps", "2", "--max-tokens", "8"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = re.findall(
        r"^\s+(\d+)\s+([\d.]+)((?:\s+\d+){3})\s+([\d.]+)\s+([\d.]+)$", result.stdout, re.MULTILINE
    )
    assert [int(row[0]) for row in rows] == [1, 2]
    for row in rows:
        assert 0.0 <= float(row[3]) <= 1.0  # accepted, draft in step
        assert 0.0 <= float(row[4]) <= 1.0  # accepted, frozen draft
    for name in ("plain", "in step", "frozen"):
        assert re.search(
            rf"^  {name}\s+\d+ ->\s+\d+\s+\([\d.]+x plain\)$", result.stdout, re.MULTILINE
        )
