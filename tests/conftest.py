"""Fixtures shared across test directories, and the test tiers (markers `unit`, `e2e`, `gpu`).

The harnesses (`helpers`, `engine_harness`, `update_harness`...) are importable by name: the
directories holding them are pytest's `pythonpath` (pyproject.toml).
"""

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from process_pool import SharedProcesses

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
        "moe_ep2",  # `weightbus serve` of an MoE model at EP 2 (test_expert_replacement.py)
        "moe_engines",  # `weightbus serve` of an MoE model, 4 layouts (test_moe_pushes.py)
        "rig",  # uvicorn on a real port, a rank 0 on ZMQ sockets (test_admin_roundtrip.py)
        "namespaces",  # network namespaces via `ip` (tests/core/pushes/netns_harness.py)
        "tied_tp1",  # a vLLM server (tests/engines/vllm_backend/conftest.py)
        "moe_tp2",  # a vLLM server of a Qwen3-MoE, TP 2 (tests/engines/vllm_backend/conftest.py)
        "ray_cluster",  # a Ray cluster of three nodes (tests/apps/ray_fleet/conftest.py)
        "shared_processes",  # servers shared by several modules (tests/process_pool.py)
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
# Servers shared by several test modules (tests/process_pool.py), made once collection shows
# which tests use them: each is stopped after the last module of those.
_SHARED = pytest.StashKey[SharedProcesses]()


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[_SHARED] = SharedProcesses(session.items)
    if any("namespaces" in getattr(item, "fixturenames", ()) for item in session.items):
        from netns_harness import create_namespaces

        session.config.stash[_ENGINE_NAMESPACES] = create_namespaces()


def pytest_sessionfinish(session: pytest.Session) -> None:
    shared = session.config.stash.get(_SHARED, None)
    if shared is not None:
        shared.close_all()
    namespaces = session.config.stash.get(_ENGINE_NAMESPACES, None)
    if namespaces is not None:
        from netns_harness import delete_namespaces

        delete_namespaces(namespaces.name)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:  # after the item's fixtures: a module's last test tore down its module fixtures
        shared = item.config.stash.get(_SHARED, None)
        if shared is not None:
            shared.release_after(item, nextitem)


@pytest.fixture(scope="session")
def shared_processes(request: pytest.FixtureRequest) -> SharedProcesses:
    """The servers test modules share (`SharedProcesses`)."""
    return request.config.stash[_SHARED]


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
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    shared_processes: SharedProcesses,
) -> Iterator["ServedEngine"]:
    """`weightbus serve --tp 2`: on the `hf_model` checkpoint when the module names an
    `HF_CASE` (started for the module, stopped after it), else on the built-in tiny model,
    shared with the other modules that use it (`shared_processes`; `engines["tp2"]` of
    tests/core/pushes is the same engine). Modules that need other flags (an API token, TP 1)
    or a fresh engine define their own `engine`."""
    from engine_harness import ServedEngine

    log_dir = tmp_path_factory.mktemp("log")
    if not hasattr(request.module, "HF_CASE"):
        yield shared_processes.tiny_engine("--tp", "2", log_dir=log_dir)
        return
    path, _ = request.getfixturevalue("hf_model")
    served = ServedEngine("--model", str(path), "--tp", "2", log_path=log_dir / "serve.log")
    yield served
    served.stop()
