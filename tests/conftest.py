"""Fixtures shared across test directories, and the test tiers (markers `unit`, `e2e`, `gpu`).

The harnesses (`helpers`, `engine_harness`, `update_harness`...) are importable by name: the
directories holding them are pytest's `pythonpath` (pyproject.toml).
"""

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from engine_harness import ServedEngine
    from netns_harness import Namespaces

# Tests are small; two threads match the CI machine and keep runs comparable.
torch.set_num_threads(2)

# Tiers. A test is `e2e` when it starts real processes or servers: `weightbus serve`, rank
# processes, any child process, an HTTP server on a TCP port. Else it is `unit`: one process,
# where threads and ZMQ `ipc://` sockets in a private temporary directory (the shm transport's
# control channel, `fake_rank0.FakeRank0`) count as in-process. The rule, for every test:
#  1. it is marked `e2e` itself (the test, its parameter or its module's `pytestmark`): tests
#     that start `weightbus serve`, a Python child or a server in their own body;
#  2. or it uses, directly or through other fixtures, a fixture that starts them (the names
#     below; a new fixture that starts processes belongs here);
#  3. every other test is `unit`.
# Deciding by fixture and mark, not by directory, keeps in-process tests that live next to
# end-to-end ones (tests/reliability/test_decoders_fuzz.py, ...) in the fast tier.
PROCESS_FIXTURES = frozenset(
    {
        "engine",  # `weightbus serve` (below, and the modules' own `engine`)
        "engines",  # several `weightbus serve` (tests/core/pushes/conftest.py)
        "fleet",  # several `weightbus serve`, restarted after faults (test_fleet.py)
        "tiny_tp2",  # `weightbus serve --tp 2` (test_engine_server.py)
        "observed",  # `weightbus serve`, pushed into over every transport (test_security.py)
        "tp2_results",  # two TP rank processes and a TCPStore (test_model_vs_hf.py)
        "rig",  # uvicorn on a real port, a rank 0 on ZMQ sockets (test_admin_roundtrip.py)
        "namespaces",  # network namespaces via `ip` (tests/core/pushes/netns_harness.py)
        "tied_tp1",  # a vLLM server (tests/engines/vllm_backend/conftest.py)
        "untied_tp2",  # a vLLM server, TP 2 (tests/engines/vllm_backend/conftest.py)
        "ray_cluster",  # a Ray cluster of three nodes (tests/apps/ray_fleet/conftest.py)
    }
)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    gpu_skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False")
    cuda = None  # asked once, and only when a gpu test was collected
    for item in items:
        if item.get_closest_marker("e2e") is None:
            starts = not PROCESS_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
            item.add_marker(pytest.mark.e2e if starts else pytest.mark.unit)
        if item.get_closest_marker("gpu") is not None:
            if cuda is None:
                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(gpu_skip)


# The engine namespace of the session (tests/core/pushes/netns_harness.py), made once collection
# shows a test that needs it, before any test runs (UCX reads the routes once per process).
_ENGINE_NAMESPACES = pytest.StashKey["Namespaces | None"]()


def pytest_collection_finish(session: pytest.Session) -> None:
    if any("namespaces" in getattr(item, "fixturenames", ()) for item in session.items):
        from netns_harness import create_namespaces

        session.config.stash[_ENGINE_NAMESPACES] = create_namespaces()


def pytest_sessionfinish(session: pytest.Session) -> None:
    namespaces = session.config.stash.get(_ENGINE_NAMESPACES, None)
    if namespaces is not None:
        from netns_harness import delete_namespaces

        delete_namespaces(namespaces.name)


@pytest.fixture(scope="session")
def engine_namespaces(request: pytest.FixtureRequest) -> "Namespaces | None":
    """The session's engine namespace, or None where none could be made."""
    return request.config.stash.get(_ENGINE_NAMESPACES, None)


@pytest.fixture(scope="module")
def hf_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, torch.nn.Module]:
    """The tiny Hugging Face checkpoint the test module names in `HF_CASE` (a key of
    `engine_harness.HF_CASES`): its directory, and the `transformers` model saved there."""
    from engine_harness import make_hf_model

    case = request.module.HF_CASE
    path = tmp_path_factory.mktemp(case)
    return path, make_hf_model(case, path)


@pytest.fixture(scope="module")
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator["ServedEngine"]:
    """`weightbus serve --tp 2` for the test module, stopped after it: on the `hf_model`
    checkpoint when the module names an `HF_CASE`, else on the built-in tiny model. Modules
    that need other flags (an API token, TP 1) define their own `engine`."""
    from engine_harness import ServedEngine

    args: tuple[str, ...] = ("--tp", "2")
    if hasattr(request.module, "HF_CASE"):
        path, _ = request.getfixturevalue("hf_model")
        args = ("--model", str(path), *args)
    served = ServedEngine(*args, log_path=tmp_path_factory.mktemp("log") / "serve.log")
    yield served
    served.stop()
