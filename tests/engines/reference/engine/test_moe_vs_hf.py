"""A mixture-of-experts model computes what transformers computes under every layout of its
experts at 2 ranks: split over TP, expert parallel (linear, round-robin, with 2 redundant
slots), and after experts moved between ranks (`place_experts`). And both copies of a
replicated expert are used: corrupting either changes the logits.

TP 1 and TP 2 of the same checkpoint are `test_model_vs_hf.py`'s `qwen3_moe` case. Tolerance
as there (float32, 1e-4): expert parallelism only changes the order in which the experts'
weighted outputs are summed.
"""

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import moe_harness
import pytest
import torch
import torch.distributed as dist
from engine_harness import hf_reference, make_hf_model
from safetensors.torch import load_file

ATOL = RTOL = 1e-4
SCENARIOS = [
    "ep2_linear",
    "ep2_round_robin",
    "ep2_redundant",
    "tp2_moved",
    "ep2_moved_live",
    "ep2_moved_staging",
    "ep2_replicas_placed",
]


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.Tensor, list[int]]:
    """(saved directory, transformers' logits, transformers' greedy tokens)."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    logits, tokens = hf_reference(make_hf_model("qwen3_moe", path))
    return str(path), logits, tokens


@pytest.fixture(scope="module")
def ranks(hf_moe: tuple, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every scenario on 2 rank processes with a real gloo group: what each rank saved."""
    out_dir = tmp_path_factory.mktemp("moe2")
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    harness = Path(moe_harness.__file__)
    args = [[rank, 2, store.port, hf_moe[0], str(out_dir)] for rank in range(2)]
    procs = [subprocess.Popen([sys.executable, str(harness), json.dumps(a)]) for a in args]
    try:
        assert [proc.wait(timeout=120) for proc in procs] == [0, 0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    return [load_file(str(out_dir / f"rank{rank}.safetensors")) for rank in range(2)]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_moe_layout_matches_transformers(hf_moe: tuple, ranks: list, scenario: str) -> None:
    _, hf_logits, hf_tokens = hf_moe
    rank0, rank1 = ranks
    torch.testing.assert_close(rank0[f"{scenario}.logits"], hf_logits, atol=ATOL, rtol=RTOL)
    assert rank0[f"{scenario}.tokens"].tolist() == hf_tokens
    # the experts' partial sums are all-reduced in rank order: identical on both ranks
    assert torch.equal(rank0[f"{scenario}.logits"], rank1[f"{scenario}.logits"])


def test_each_replica_of_a_redundant_expert_is_used(hf_moe: tuple, ranks: list) -> None:
    # two experts held twice (`ep2_replicas_placed`: ones prompt tokens of both parities
    # reach); token i takes copy i % 2, so a corrupted copy (a stale one) shows in the logits
    _, hf_logits, _ = hf_moe
    corrupted = sorted(key for key in ranks[0] if key.startswith("corrupt_"))
    assert len(corrupted) == 4
    assert {key.rsplit("_rank", 1)[1] for key in corrupted} == {"0.logits", "1.logits"}
    for key in corrupted:
        difference = (ranks[0][key] - hf_logits).abs().max()
        assert difference > 0.1, (key, difference)
        assert torch.equal(ranks[0][key], ranks[1][key])
