"""docs/sharded.md's FSDP2 script runs as written: `torchrun --nproc-per-node 2` against a
started engine (the shared tiny TP-2 `weightbus serve`); the engine then serves the last
version with the fingerprint rank 0 printed, and each trainer rank sent bytes."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from weightbus.engines.vllm.launch import free_port

SHARDED_DOC = Path(__file__).parents[3] / "docs" / "sharded.md"
DOC_URL = "http://127.0.0.1:8000"

pytestmark = pytest.mark.e2e  # an engine and two trainer processes (tiers: tests/conftest.py)


def _script() -> str:
    section = SHARDED_DOC.read_text().split("## What a trainer writes", 1)[1]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)[0]


def test_the_fsdp2_script_runs_as_written_with_torchrun(engine, tmp_path):
    script = tmp_path / "fsdp2_push.py"
    script.write_text(_script().replace(DOC_URL, engine.url))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), str(script)]
    ran = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    printed = [line.split(" ", 2) for line in ran.stdout.splitlines() if "fsdp2-step-" in line]
    assert [version for version, _, _ in printed] == ["fsdp2-step-1", "fsdp2-step-2"]
    _, fingerprint, rank_sent_bytes = printed[-1]
    assert all(sent > 0 for sent in ast.literal_eval(rank_sent_bytes))
    weights = httpx.get(f"{engine.url}/v1/weights", timeout=30).json()
    assert (weights["version"], weights["fingerprint"]) == ("fsdp2-step-2", fingerprint)
