"""Every feature for every trainer layout, through the one Publisher: one process holding every
tensor (a group of one), 2 FSDP2 ranks (uneven shards: the vocabulary is odd) and a 2x2 FSDP x
TP mesh (4 ranks; row-parallel layers split by columns) each push -- whole, as a delta, with a
probe that fails (the engine rolls back) and one that passes, `rollback()`, an engine joining
(every rank sends it what it holds), `hf_dir`, a draft model, a LoRA adapter and block FP8 --
into real engines. Fingerprints equal the gathered model's, tokens transformers', each rank's
bytes the planner's; what a layout cannot do is refused, naming why (FP8 shards off block
edges). One tiny model, one trainer run per layout, the same four engines for all."""

import copy
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from engine_harness import ServedEngine, make_hf_model
from layout_parts import ADAPTER_CONFIG, PROMPT, adapter_state, draft_weights

from weightbus.apps.capacity.shapes import model_tensors
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.capacity.traffic import traffic
from weightbus.core.digest import fingerprint
from weightbus.core.fp8 import Fp8Block, quantize_weights
from weightbus.core.lora import adapter_spec
from weightbus.core.plan.planner import DEFAULT_BUCKET_BYTES as BUCKET
from weightbus.core.weights import normalize_weights
from weightbus.core.wire.adapter import served_fingerprint
from weightbus.engines.vllm.launch import free_port

pytestmark = pytest.mark.e2e
HF_CASE = "qwen2_tied_kv1_sharded"  # tied head, biases, one KV head, vocabulary of 101
TRAINER = Path(__file__).with_name("layout_trainer.py")
LAYOUTS = {"plain": 1, "fsdp": 2, "fsdp_tp": 4}


@pytest.fixture(scope="module")
def served(hf_model, tmp_path_factory):
    """`main` (TP 2), `join` (TP 1, adapters: `--lora-rank 4`), `draft` (TP 2 with a draft
    model) and `fp8` (TP 1, block FP8), all from the module's checkpoint, started together."""
    path, _ = hf_model
    logs = tmp_path_factory.mktemp("logs")
    draft_dir = tmp_path_factory.mktemp("draft")
    make_hf_model("llama3_rope_kv1", draft_dir, seed=1)
    flags = {
        "main": ("--tp", "2"),
        "join": ("--tp", "1", "--lora-rank", "4", "--lora-targets", "q_proj,v_proj"),
        "draft": ("--tp", "2", "--draft-model", str(draft_dir), "--num-speculative-tokens", "2"),
        "fp8": ("--tp", "1", "--quantization", "fp8-block"),
    }

    def start(name: str) -> ServedEngine:
        return ServedEngine("--model", str(path), *flags[name], log_path=logs / f"{name}.log")

    with ThreadPoolExecutor(len(flags)) as pool:
        engines = dict(zip(flags, pool.map(start, flags), strict=True))
    yield engines, draft_dir
    for engine in engines.values():
        engine.stop()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, served, hf_model, tmp_path_factory):
    """One trainer run of layout `request.param`: each step's record (rank 0's, and every
    rank's), the gathered weights it pushed, and the planner's bytes of a whole push."""
    engines, draft_dir = served
    path, model = hf_model
    layout, world = request.param, LAYOUTS[request.param]
    out = tmp_path_factory.mktemp(layout)
    args = {
        "layout": layout,
        "model_dir": str(path),
        "draft_dir": str(draft_dir),
        "engines": {name: engine.url for name, engine in engines.items()},
        "out": str(out),
    }
    port = free_port()
    procs = [_start(rank, world, port, json.dumps(args)) for rank in range(world)]
    for proc in procs:
        proc.wait(timeout=600)
    records = [_records(out / f"rank{rank}.jsonl") for rank in range(world)]
    plan = traffic(model_tensors(path, "float32"), EngineLayout(2), "shm", bucket_bytes=BUCKET,
                   trainer_ranks=world, trainer_layout="fsdp")  # fmt: skip
    return _Run(layout, records, out, model, plan)


def _start(rank: int, world: int, port: int, argument: str) -> subprocess.Popen:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    return subprocess.Popen([sys.executable, str(TRAINER), argument], env={**os.environ, **env})


def _records(path: Path) -> dict[str, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


class _Run:
    def __init__(self, layout, records, out, model, plan) -> None:
        self.layout, self.records, self.out, self.model, self.plan = (
            layout, records, out, model, plan,
        )  # fmt: skip

    def step(self, name: str) -> dict:
        """Rank 0's record of step `name`; every rank must have returned the same."""
        ranks = [records[name] for records in self.records]
        same = {"ok", "fingerprint", "error"}
        assert all({k: r.get(k) for k in same} == {k: ranks[0].get(k) for k in same}
                   for r in ranks), ranks  # fmt: skip
        return ranks[0]

    def gathered(self, name: str) -> torch.nn.Module:
        model = copy.deepcopy(self.model)
        model.load_state_dict(torch.load(self.out / f"{name}.pt"))
        return model.eval()


@torch.no_grad()
def _greedy(model: torch.nn.Module, max_tokens: int = 8) -> list[int]:
    ids = torch.tensor([PROMPT])
    for _ in range(max_tokens):
        ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    return ids[0, len(PROMPT) :].tolist()


def _serves(run: _Run, name: str) -> None:
    """The step landed: the main engine serves the gathered weights as transformers does."""
    record, model = run.step(name), run.gathered(name)
    assert record["ok"], record
    assert record["fingerprint"] == fingerprint(model)
    assert record["served"]["fingerprint"] == record["fingerprint"]
    assert record["served"]["tokens"] == _greedy(model)


def test_a_whole_push_sends_each_rank_what_it_holds(run):
    _serves(run, "whole")
    record = run.step("whole")
    assert not record["delta"]  # the first push with deltas on goes whole
    if run.layout == "fsdp_tp":  # replicated parts leave once: every engine byte, once
        assert sum(record["sent_bytes"]) == sum(run.plan.trainer_send_bytes)
    else:
        assert tuple(record["sent_bytes"]) == run.plan.trainer_send_bytes
    assert record["rank_nbytes"] == [list(run.plan.receive_bytes)]


def test_a_delta_from_every_rank_lands(run):
    _serves(run, "delta")
    assert run.step("delta")["delta"]


def test_an_engine_joins_caught_up_by_every_rank(run):
    record = run.step("join")
    assert record["ok"], record
    assert record["fingerprint"] == fingerprint(run.gathered("delta"))
    assert run.step("leave")["ok"]


def test_a_failed_probe_rolls_back_and_rollback_swaps_back(run):
    bad = run.step("probe-bad")
    assert (bad["ok"], bad["error"]) == (False, "PushError"), bad
    assert "probe" in bad["message"]
    assert bad["served"]["fingerprint"] == fingerprint(run.gathered("delta"))
    _serves(run, "probe-good")
    back = run.step("rollback")
    assert back["ok"], back
    assert (
        back["fingerprint"] == back["served"]["fingerprint"] == fingerprint(run.gathered("delta"))
    )


def test_hf_dir_from_every_rank(run):
    _serves(run, "hf_dir")


def test_a_draft_travels_with_the_model(run, served):
    _, draft_dir = served
    record = run.step("draft")
    assert record["ok"], record
    weights = {**dict(normalize_weights(run.gathered("draft"))), **draft_weights(draft_dir)}
    assert record["fingerprint"] == fingerprint(weights)


def test_an_adapter_from_every_rank(run):
    record = run.step("lora")
    assert record["ok"], record
    base = fingerprint(run.gathered("delta"))
    spec = adapter_spec(ADAPTER_CONFIG, base)
    assert record["fingerprint"] == served_fingerprint(
        spec, fingerprint(adapter_state(run.model.config))
    )


def test_fp8_quantizes_where_shards_cover_whole_blocks(run):
    record = run.step("fp8")
    if run.layout == "plain":
        assert record["ok"], record
        tensors = normalize_weights(run.gathered("fp8"))
        assert record["fingerprint"] == fingerprint(quantize_weights(tensors, Fp8Block()))
        return
    assert (record["ok"], record["error"]) == (False, "ValueError"), record
    assert "not whole 128x128 blocks" in record["message"]
