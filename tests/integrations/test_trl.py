"""Hugging Face TRL's GRPOTrainer generating through `weightbus.integrations.trl` with a TP-2
reference engine: each step's completions come from the policy pushed at that step (versions,
fingerprints, the engine's logprobs against transformers on those weights), off-policy steps are
reported, two TRL processes train a Qwen3-MoE policy into an engine at EP 2, each with a
`Publisher(group=...)`, and the example trains the demo's task with the reward rising."""

import copy
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_harness import VOCAB_SIZE, ServedEngine
from trl_harness import (
    LOGPROB_ATOL,
    NUM_GENERATIONS,
    PROMPTS,
    check_rollouts_came_from_their_step,
    run_grpo,
)
from vllm_harness import make_vllm_model

from weightbus import Publisher
from weightbus.apps.capacity.shapes import ModelTensors
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.capacity.traffic import traffic
from weightbus.core.finite import NonFiniteWeightsError
from weightbus.core.meta import metas_of
from weightbus.core.plan.planner import DEFAULT_BUCKET_BYTES
from weightbus.core.weights import normalize_weights
from weightbus.engines.vllm.launch import write_word_tokenizer
from weightbus.integrations.trl import (
    EngineCompletionError,
    OffPolicyRolloutsError,
    WeightbusRollouts,
)
from weightbus.integrations.trl import rollouts as rollouts_module

REPO = Path(__file__).resolve().parents[2]
COMPLETIONS_PER_STEP = len(PROMPTS) * NUM_GENERATIONS
# test_expert_replacement.py's engine: 8 experts in 2 ranks x 5 slots (2 held twice)
EP2_REDUNDANT = ("--tp", "2", "--expert-parallel", "--redundant-experts", "2")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen2") / "model"
    return path, make_vllm_model("qwen2_tied", path, torch.float32)


@pytest.fixture(scope="module")
def engine(qwen2, tmp_path_factory: pytest.TempPathFactory):
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    served = ServedEngine("--model", str(qwen2[0]), "--tp", "2", log_path=log_path)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def moe_policy_engine(
    shared_processes, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ServedEngine, Path]:
    """transformers' tiny Qwen3-MoE (fused experts, 8 of them, top 2) served at TP 2 with
    `--expert-parallel` and 2 redundant slots (shared with test_expert_replacement.py:
    tests/process_pool.py), and a copy of its checkpoint with the word-level tokenizer TRL
    reads."""
    engine = shared_processes.moe_engine(*EP2_REDUNDANT, log_dir=tmp_path_factory.mktemp("log"))
    path = tmp_path_factory.mktemp("qwen3_moe") / "model"
    shutil.copytree(shared_processes.moe_checkpoint(), path)
    write_word_tokenizer(path, VOCAB_SIZE)
    return engine, path


def _history(engine: ServedEngine) -> dict[str, str]:
    weights = engine.client.get("/v1/weights").json()
    return {entry["version"]: entry["fingerprint"] for entry in weights["history"]}


@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_every_step_generates_from_the_policy_trl_held_at_that_step(
    engine, qwen2, transport, tmp_path
):
    path, base = qwen2
    model = copy.deepcopy(base).train()
    prefix = f"trl-{transport}-"
    with Publisher([engine.url], transport=transport) as publisher:
        if transport == "dist":
            publisher.init_weights_group("127.0.0.1", timeout_s=30)
        rollouts = WeightbusRollouts(publisher, version_prefix=prefix)
        try:
            run = run_grpo(model, path, tmp_path, rollouts)
            final = rollouts.sync(run.trainer)  # the third step's weights
        finally:
            rollouts.close()
            if transport == "dist":  # the engine is the module's: it leaves the group
                publisher.destroy_weights_group()
    pushes = [step.push for step in rollouts.steps] + [final]
    assert [p.version for p in pushes] == [f"{prefix}{s}" for s in range(4)]
    # what the engine committed at each step is what TRL held then, and training changed it
    fingerprints = [run.weights.fingerprint(s) for s in range(4)]
    assert [p.fingerprint for p in pushes] == fingerprints
    assert len(set(fingerprints)) == 4
    history = _history(engine)
    assert [history[p.version] for p in pushes] == fingerprints
    assert [step.off_policy for step in rollouts.steps] == [0, 0, 0]
    assert [sum(step.versions.values()) for step in rollouts.steps] == [COMPLETIONS_PER_STEP] * 3
    check_rollouts_came_from_their_step(run, prefix)


def test_steps_between_pushes_are_reported_off_policy_or_refused(engine, qwen2, tmp_path, caplog):
    """A fleet (the TP-2 engine and a TP-1 one) pushed every other step: the groups are spread
    over both engines, and the steps between pushes are counted, logged, or refused."""
    path = qwen2[0]
    second = ServedEngine("--model", str(path), "--tp", "1", log_path=tmp_path / "second.log")
    try:
        rollouts, refused = _fleet_pushed_every_other_step(engine, second, qwen2, tmp_path, caplog)
    finally:
        second.stop()
    assert [step.push is not None for step in rollouts.steps] == [True, False, True]
    half = COMPLETIONS_PER_STEP // 2
    assert [step.engines for step in rollouts.steps] == [{engine.url: half, second.url: half}] * 3
    assert [step.off_policy for step in rollouts.steps] == [0, COMPLETIONS_PER_STEP, 0]
    message = (
        f"TRL step 1: {COMPLETIONS_PER_STEP} of {COMPLETIONS_PER_STEP} completions were "
        "generated by another version than the policy's '{}-1' (versions: {{'{}-0': {}}})"
    )
    assert message.format("lag", "lag", COMPLETIONS_PER_STEP) in caplog.text
    assert str(refused.value) == message.format("strict", "strict", COMPLETIONS_PER_STEP)


def _fleet_pushed_every_other_step(engine, second, qwen2, tmp_path, caplog):
    path, base = qwen2
    with Publisher([engine.url, second.url], transport="shm") as publisher:
        rollouts = WeightbusRollouts(publisher, version_prefix="lag-", push_every_steps=2)
        with caplog.at_level(logging.WARNING, logger=rollouts_module.__name__):
            run_grpo(copy.deepcopy(base).train(), path, tmp_path / "warn", rollouts)
        strict = WeightbusRollouts(
            publisher, version_prefix="strict-", push_every_steps=2, off_policy="raise"
        )
        with pytest.raises(OffPolicyRolloutsError) as refused:
            run_grpo(copy.deepcopy(base).train(), path, tmp_path / "raise", strict)
        rollouts.close()
        strict.close()
    return rollouts, refused


def test_a_diverged_policy_is_refused_and_a_dead_engine_is_named(engine, qwen2, tmp_path):
    """NaN in the policy: the push is refused before a byte moves, TRL's step fails with the
    tensor named, and the engine keeps its version. An engine that does not answer fails the
    step naming its URL."""
    path, base = qwen2
    served = engine.client.get("/v1/weights").json()["version"]
    model = copy.deepcopy(base).train()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    with Publisher([engine.url], transport="shm") as publisher:
        rollouts = WeightbusRollouts(publisher, version_prefix="nan-")
        with pytest.raises(NonFiniteWeightsError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
            run_grpo(model, path, tmp_path / "nan", rollouts)
        assert engine.client.get("/v1/weights").json()["version"] == served
        dead = f"http://127.0.0.1:{_free_port()}"
        silent = WeightbusRollouts(publisher, engines=[dead], version_prefix="dead-", timeout_s=5)
        with pytest.raises(
            EngineCompletionError, match=f"^{dead}/v1/completions: unreachable \\(ConnectError"
        ):
            run_grpo(copy.deepcopy(base).train(), path, tmp_path / "dead", silent)
        rollouts.close()
        silent.close()


def test_two_trl_processes_train_an_moe_policy_into_an_expert_parallel_engine(
    moe_policy_engine, tmp_path
):
    """accelerate on 2 CPU processes (DDP over gloo: accelerate runs FSDP on accelerators
    only, so each process holds the whole policy) trains a Qwen3-MoE: each process sends part
    of the model, nothing is gathered, each expert reaches only the engine ranks holding it,
    and both processes see the same versions and fingerprints, those of the weights TRL held at
    each step; every completion came from its step's policy (its version, and transformers'
    logprobs on those weights)."""
    engine, path = moe_policy_engine
    script = Path(__file__).with_name("trl_ranks.py")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(_free_port()), str(script), str(path), engine.url, str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["pushes"] == ranks[1]["pushes"]
    assert {r["distributed_type"] for r in ranks} == {"MULTI_CPU"}
    # the processes sent the engine ranks' shares: dense slices and 5 expert slots each (every
    # expert to both ranks would be 1.73x this)
    planned = _ep2_redundant_receive_bytes(path)
    for push, expected in zip(ranks[0]["pushes"], ranks[0]["fingerprints"], strict=True):
        assert push["fingerprint"] == expected
        assert min(push["sent_bytes"]) > 0
        assert sum(push["sent_bytes"]) == sum(planned)
    history = _history(engine)
    assert [history[p["version"]] for p in ranks[0]["pushes"]] == ranks[0]["fingerprints"]
    assert [r["off_policy"] for r in ranks] == [[0, 0, 0], [0, 0, 0]]
    assert all(error < LOGPROB_ATOL for r in ranks for error in r["logprob_errors"]), ranks


def _ep2_redundant_receive_bytes(path: Path) -> list[int]:
    """`weightbus plan`'s bytes into each rank of the EP 2 engine (2 redundant slots) for one
    push of the checkpoint at `path` (training keeps the shapes)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    metas = tuple(metas_of(normalize_weights(model)))
    tensors = ModelTensors("tiny qwen3-moe", metas, model.config.to_dict())
    layout = EngineLayout(2, 2, "linear", 2)
    return list(traffic(tensors, layout, "shm", bucket_bytes=DEFAULT_BUCKET_BYTES).receive_bytes)


def test_the_example_trains_the_demo_task_and_the_reward_rises(tmp_path):
    record_path = tmp_path / "trl.json"
    command = [
        sys.executable, str(REPO / "examples" / "trl_grpo.py"),
        "--steps", "10", "--tp", "1", "--json", str(record_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(record_path.read_text())
    rewards = [row["reward"] for row in record["steps"]]
    assert sum(rewards[-3:]) / 3 > max(0.3, 3 * sum(rewards[:3]) / 3), rewards
    assert [row["version"] for row in record["steps"]] == [f"step-{s}" for s in range(10)]
    assert all(row["off_policy"] == 0 for row in record["steps"])
    assert record["served"] == {"version": "step-10", "fingerprint": record["trained_fingerprint"]}
    assert "engine serves step-10: trained weights yes" in done.stdout


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
