"""The Python examples of the README and of the docs that hold quickstarts run as written
(against a real engine where they need one), and every test that docs/reliability.md cites
exists."""

import re
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
RELIABILITY = Path(__file__).parents[1] / "docs" / "reliability.md"
# `tests/x.py::test_name[id]`, or `…::test_name` for the file cited last
CITED_TEST = re.compile(r"`(tests/[\w/]+\.py|…)(?:::(\w+))?(?:\[[^`]*\])?`")
# the pages whose Python blocks are runnable as written (others hold fragments of larger scripts)
RUNNABLE = [
    README,
    *(
        README.parent / "docs" / name
        for name in ("quickstart.md", "development.md", "own_engine.md")
    ),
]
EXAMPLES = [
    (page, code)
    for page in RUNNABLE
    for code in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)
]
README_URL = "http://127.0.0.1:8000"


# an example that talks to README_URL runs against `engine` (tests/conftest.py), one that
# starts Ray starts processes: both `e2e`
@pytest.mark.parametrize(
    ("page", "code"),
    [
        pytest.param(
            page,
            code,
            id=f"{page.stem}-example{i}",
            marks=[pytest.mark.e2e] if README_URL in code or "ray.init" in code else [],
        )
        for i, (page, code) in enumerate(EXAMPLES)
    ],
)
def test_example_runs_as_written(page, code, request):
    if README_URL in code:
        code = code.replace(README_URL, request.getfixturevalue("engine").url)
    exec(compile(code, str(page), "exec"), {})


def test_every_test_cited_in_the_reliability_doc_exists():
    root = README.parent
    cited, path = [], None
    for file, name in CITED_TEST.findall(RELIABILITY.read_text()):
        path = path if file == "…" else file
        assert path is not None, "a '…' citation before any file"
        cited.append((path, name))
    assert len(cited) > 50
    missing = [
        f"{path}::{name}"
        for path, name in cited
        if not (root / path).is_file() or (name and f"def {name}(" not in (root / path).read_text())
    ]
    assert not missing, f"docs/reliability.md cites tests that do not exist: {missing}"


ARCHITECTURE = README.parent / "docs" / "architecture.md"
# `core/plan/planner.py`, `shm/direct.py`, `transport/parts/` ...: a file or folder it names
NAMED_PATH = re.compile(r"`((?:[\w.]+/)*[\w]+(?:\.py|/))`")


def test_every_file_the_architecture_doc_names_exists():
    root = README.parent
    files = [
        p.relative_to(root).as_posix()
        for top in ("src", "tests", "bench")
        for p in (root / top).rglob("*.py")
    ]
    folders = {f"{Path(f).parent.as_posix()}/" for f in files}
    named = set(NAMED_PATH.findall(ARCHITECTURE.read_text()))
    assert len(named) > 40
    missing = sorted(
        name
        for name in named
        if not any(
            f == name or f.endswith(f"/{name}") for f in (folders if name.endswith("/") else files)
        )
    )
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
