"""Hugging Face TRL's GRPOTrainer generating through `weightbus.integrations.trl` with a TP-2
reference engine: each step's completions come from the policy pushed at that step (versions,
fingerprints, the engine's logprobs against transformers on those weights), off-policy steps are
reported, two TRL processes push with a ShardedPublisher, and the example trains the demo's
task with the reward rising."""

import copy
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_harness import ServedEngine
from trl_harness import (
    NUM_GENERATIONS,
    PROMPTS,
    check_rollouts_came_from_their_step,
    run_grpo,
)
from vllm_harness import make_vllm_model

from weightbus import Publisher
from weightbus.core.digest import fingerprint
from weightbus.core.finite import NonFiniteWeightsError
from weightbus.core.lora import adapter_spec, adapter_tensors
from weightbus.core.publisher import normalize_weights
from weightbus.core.wire.adapter import served_fingerprint
from weightbus.integrations.trl import (
    EngineCompletionError,
    OffPolicyRolloutsError,
    WeightbusRollouts,
)
from weightbus.integrations.trl import rollouts as rollouts_module

REPO = Path(__file__).resolve().parents[2]
COMPLETIONS_PER_STEP = len(PROMPTS) * NUM_GENERATIONS


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


@pytest.fixture(scope="module")
def lora_engine(qwen2, tmp_path_factory: pytest.TempPathFactory):
    """A TP-1 engine on the same base that serves rank-4 adapters of q_proj and v_proj."""
    log_path = tmp_path_factory.mktemp("serve") / "serve-lora.log"
    flags = ("--lora-rank", "4", "--lora-targets", "q_proj,v_proj")
    served = ServedEngine("--model", str(qwen2[0]), *flags, log_path=log_path)
    yield served
    served.stop()


def test_a_peft_policy_pushes_its_adapter_only(lora_engine, qwen2, tmp_path):
    """GRPOTrainer with a `peft_config`: every step pushes the LoRA adapter alone onto the
    frozen base the engine serves, and each step's completions come from base + that step's
    adapter (versions, fingerprints, logprobs against peft)."""
    from peft import LoraConfig

    path, base = qwen2
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    with Publisher([lora_engine.url], transport="shm") as publisher:
        rollouts = WeightbusRollouts(publisher, version_prefix="lora-")
        try:
            run = run_grpo(copy.deepcopy(base).train(), path, tmp_path, rollouts, config)
            final = rollouts.sync(run.trainer)
        finally:
            rollouts.close()
    pushes = [step.push for step in rollouts.steps] + [final]
    spec = adapter_spec(config, fingerprint(normalize_weights(base)))
    held = [run.weights.by_step[s] for s in range(4)]  # base and adapter, peft's inner names
    adapters = [adapter_tensors({k: v for k, v in h.items() if ".lora_" in k}) for h in held]
    expected = [served_fingerprint(spec, fingerprint(a.items())) for a in adapters]
    assert [p.fingerprint for p in pushes] == expected
    assert len(set(expected)) == 4  # the adapter trained at every step
    history = _history(lora_engine)
    assert [history[p.version] for p in pushes] == expected
    served = lora_engine.client.get("/v1/weights").json()
    assert served["adapter"]["version"] == "lora-3"
    assert served["base_fingerprint"] == spec.base_fingerprint
    check_rollouts_came_from_their_step(run, "lora-")


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


def test_two_trl_processes_push_with_a_sharded_publisher(engine, qwen2, tmp_path):
    """accelerate on 2 CPU processes (DDP over gloo: accelerate runs FSDP on accelerators
    only): each process sends part of the model, nothing is gathered, and both see the same
    versions and fingerprints, those of the weights TRL held at each step."""
    path, base = qwen2
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
    # the tied head is not sent; the norms go to both TP ranks of the engine (each keeps them)
    norm_bytes = sum(p.nbytes for n, p in base.named_parameters() if n.endswith("norm.weight"))
    model_bytes = sum(p.nbytes for p in base.parameters()) + norm_bytes
    for push, expected in zip(ranks[0]["pushes"], ranks[0]["fingerprints"], strict=True):
        assert push["fingerprint"] == expected
        assert min(push["sent_bytes"]) > 0
        assert sum(push["sent_bytes"]) == model_bytes
    history = _history(engine)
    assert [history[p["version"]] for p in ranks[0]["pushes"]] == ranks[0]["fingerprints"]
    assert [r["off_policy"] for r in ranks] == [[0, 0, 0], [0, 0, 0]]


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
