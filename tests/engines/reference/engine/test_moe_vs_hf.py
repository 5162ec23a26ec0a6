"""A mixture-of-experts model computes what transformers computes under every layout of its
experts at 2 ranks: split over TP, expert parallel (linear, round-robin, with 2 redundant
slots), and after experts moved between ranks (`place_experts`). And both copies of a
replicated expert are used: corrupting either changes the logits. Block-FP8 experts (16x16
blocks, so TP 2 splits them on block edges) compute what transformers computes on the
dequantized weights, at TP 1, TP 2 and after a move at EP 2 (scales move with their experts).

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
from engine_harness import NUM_GREEDY_TOKENS, PROMPT, greedy_generate, hf_reference, make_hf_model
from safetensors.torch import load_file, save_file

from weightbus.core.checkpoint import iter_safetensors
from weightbus.core.fp8 import Fp8Block, dequantize_weights, quantize_weights
from weightbus.engines.reference.engine.model_runner import ModelRunner
from weightbus.engines.reference.models.config import ModelConfig

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
FP8_SCENARIOS = ["tp2_fp8", "ep2_fp8_moved"]
BLOCK = Fp8Block(16, 16)


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.Tensor, list[int]]:
    """(saved directory, transformers' logits, transformers' greedy tokens)."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    logits, tokens = hf_reference(make_hf_model("qwen3_moe", path))
    return str(path), logits, tokens


@pytest.fixture(scope="module")
def hf_moe_fp8(
    hf_moe: tuple, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, torch.Tensor, list[int]]:
    """The checkpoint quantized to block FP8: (its directory, transformers' logits and greedy
    tokens on its dequantized weights)."""
    from transformers import Qwen3MoeForCausalLM

    source = Path(hf_moe[0])
    fp8 = dict(quantize_weights(iter_safetensors(str(source)), BLOCK))
    config = json.loads((source / "config.json").read_text())
    fp8_dir, dequantized_dir = tmp_path_factory.mktemp("fp8"), tmp_path_factory.mktemp("deq")
    save_file(fp8, str(fp8_dir / "model.safetensors"))
    fp8_config = config | {"quantization_config": BLOCK.hf_config()}
    (fp8_dir / "config.json").write_text(json.dumps(fp8_config))
    save_file(
        dict(dequantize_weights(fp8.items(), BLOCK)), str(dequantized_dir / "model.safetensors")
    )
    (dequantized_dir / "config.json").write_text(json.dumps(config))
    logits, tokens = hf_reference(Qwen3MoeForCausalLM.from_pretrained(dequantized_dir).eval())
    return str(fp8_dir), logits, tokens


@pytest.fixture(scope="module")
def ranks(hf_moe: tuple, hf_moe_fp8: tuple, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every scenario on 2 rank processes with a real gloo group: what each rank saved."""
    out_dir = tmp_path_factory.mktemp("moe2")
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    harness = Path(moe_harness.__file__)
    args = [[rank, 2, store.port, hf_moe[0], hf_moe_fp8[0], str(out_dir)] for rank in range(2)]
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


def test_fp8_experts_tp1_match_transformers_on_dequantized_weights(hf_moe_fp8: tuple) -> None:
    path, hf_logits, hf_tokens = hf_moe_fp8
    config = ModelConfig.from_hf_dir(path)
    assert config.quantization == BLOCK
    runner = ModelRunner(
        config=config, source=path, dtype=torch.float32, max_num_seqs=1, max_model_len=64
    )
    assert runner.model.model.layers[0].mlp.experts.w13_weight.dtype == torch.float8_e4m3fn
    logits, tokens = greedy_generate(runner, PROMPT, NUM_GREEDY_TOKENS)
    torch.testing.assert_close(logits, hf_logits, atol=ATOL, rtol=RTOL)
    assert tokens == hf_tokens


@pytest.mark.parametrize("scenario", FP8_SCENARIOS)
def test_fp8_experts_match_transformers(hf_moe_fp8: tuple, ranks: list, scenario: str) -> None:
    _, hf_logits, hf_tokens = hf_moe_fp8
    rank0, rank1 = ranks
    torch.testing.assert_close(rank0[f"{scenario}.logits"], hf_logits, atol=ATOL, rtol=RTOL)
    assert rank0[f"{scenario}.tokens"].tolist() == hf_tokens
    assert torch.equal(rank0[f"{scenario}.logits"], rank1[f"{scenario}.logits"])
