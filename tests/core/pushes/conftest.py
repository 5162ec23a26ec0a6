"""Fixtures of the live-update tests."""

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from moe_fleet import LAYOUTS
from netns_harness import namespaces  # noqa: F401 - the fixture, for the modules here

if TYPE_CHECKING:
    from engine_harness import ServedEngine

    from process_pool import SharedProcesses


@pytest.fixture(scope="module")
def engines(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    shared_processes: "SharedProcesses",
) -> dict[str, "ServedEngine"]:
    """Tiny-model engines: `tp2` and `tp1` to push into, and `reference_tp2`, started with the
    tiny weights of the module's `SEED` (what the targets should serve after receiving them;
    `update_harness.targets_and_reference` starts the same three). All are shared with the
    modules that use the same (tests/process_pool.py): `tp2` is the tiny-model
    `engine` of tests/conftest.py; the modules push first, then compare with the reference."""
    log_dir = tmp_path_factory.mktemp("log")
    flags = {
        "tp2": ("--tp", "2"),
        "tp1": ("--tp", "1"),
        "reference_tp2": ("--tp", "2", "--seed", str(request.module.SEED)),
    }
    return {
        name: shared_processes.tiny_engine(*args, log_dir=log_dir) for name, args in flags.items()
    }


@pytest.fixture(scope="module")
def hf_moe(shared_processes: "SharedProcesses") -> tuple[Path, torch.nn.Module]:
    """The shared MoE engines' checkpoint and transformers' model of it."""
    path = shared_processes.moe_checkpoint()
    from transformers import Qwen3MoeForCausalLM

    return path, Qwen3MoeForCausalLM.from_pretrained(path).float().eval()


@pytest.fixture(scope="module")
def moe_engines(
    shared_processes: "SharedProcesses", hf_moe: tuple, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, "ServedEngine"]:
    """The tiny MoE served in every layout of `LAYOUTS` (shared with test_expert_replacement.py:
    `ep2_redundant`), its experts placed linearly (what another module left may differ)."""
    log_dir = tmp_path_factory.mktemp("log")
    started = {
        name: shared_processes.moe_engine(*flags, log_dir=log_dir)
        for name, flags in LAYOUTS.items()
    }
    for name in ("ep2", "ep2_redundant"):
        response = started[name].client.post("/v1/experts/place", json={"placement": "linear"})
        assert response.status_code == 200, response.text
    return started
