"""The README's Python examples run as written (against a real engine where they need one)."""

import re
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
README_URL = "http://127.0.0.1:8000"
sys.path.insert(0, str(Path(__file__).parent / "engine"))


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory):
    from engine_harness import ServedEngine

    served = ServedEngine("--tp", "2", log_path=tmp_path_factory.mktemp("log") / "serve.log")
    yield served.url
    served.stop()


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_readme_example_runs(code, request):
    if README_URL in code:
        code = code.replace(README_URL, request.getfixturevalue("engine_url"))
    exec(compile(code, str(README), "exec"), {})
