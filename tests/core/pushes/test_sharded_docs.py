"""docs/sharded.md's scripts (FSDP2, then Megatron-style declared shards) run as written:
`torchrun --nproc-per-node 2` against a started engine (the shared tiny TP-2 `weightbus serve`);
the engine then serves the last version with the fingerprint rank 0 printed, and each trainer
rank sent bytes."""

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


def _script(index: int) -> str:
    section = SHARDED_DOC.read_text().split("## What a trainer writes", 1)[1].split("\n## ")[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)[index]


@pytest.mark.parametrize(("index", "last_version"), [(0, "fsdp2-step-2"), (1, "megatron-step-1")])
def test_the_script_runs_as_written_with_torchrun(engine, tmp_path, index, last_version):
    script = tmp_path / "push.py"
    script.write_text(_script(index).replace(DOC_URL, engine.url))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), str(script)]
    ran = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    prefix = last_version.rsplit("-", 1)[0]
    printed = [line.split(" ", 2) for line in ran.stdout.splitlines() if line.startswith(prefix)]
    assert printed[-1][0] == last_version, ran.stdout
    _, fingerprint, rank_sent_bytes = printed[-1]
    assert all(sent > 0 for sent in ast.literal_eval(rank_sent_bytes))
    weights = httpx.get(f"{engine.url}/v1/weights", timeout=30).json()
    assert (weights["version"], weights["fingerprint"]) == (last_version, fingerprint)
