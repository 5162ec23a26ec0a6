"""`weightbus demo` end to end, bounded: real engine processes, HTTP, shm pushes."""

import json
import subprocess
import sys

import pytest

from helpers import assert_demo_passed
from weightbus.core.units import format_bytes

# every test runs `weightbus demo` and engine processes (tiers: tests/conftest.py)
pytestmark = pytest.mark.e2e


def _demo(*args: str, tmp_path) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "demo.json"
    result = subprocess.run(
        [sys.executable, "-m", "weightbus", "demo", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    return result, json.loads(out.read_text())


def test_demo_on_a_running_engine_pushes_the_initial_weights_first(tmp_path, shared_processes):
    """The running engine is the TP 1 tiny-model engine other modules share
    (tests/process_pool.py): whatever it served before, the demo's first push is its own."""
    engine = shared_processes.tiny_engine("--tp", "1", log_dir=tmp_path)
    result, record = _demo(
        "--steps", "1", "--engine", engine.url, "--transport", "disk", tmp_path=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert record["tp"] is None
    assert record["steps"][0]["fingerprint_matched"]
    assert "-init' serves the trainer's weights" in result.stdout


def test_demo_with_engines_placed_by_ray(tmp_path):
    result, record = _demo(
        "--ray", "--replicas", "2", "--steps", "2", "--tp", "2", "--seed", "3", tmp_path=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert_demo_passed(record, result.stdout, num_steps=2)
    assert record["transport"] == "shm (Ray)"
    # one placement group per replica, rank r on bundle r
    assert "replica 0: http://" in result.stdout
    assert "replica 1: http://" in result.stdout
    assert result.stdout.count("ranks on bundles [0, 1]") == 2


def test_ten_consecutive_delta_pushes_keep_the_engine_on_the_trainer(tmp_path):
    result, record = _demo(
        "--steps", "10", "--tp", "2", "--delta", "always", "--seed", "4", tmp_path=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert_demo_passed(record, result.stdout, num_steps=10)
    assert [step["push_delta"] for step in record["steps"]] == [True] * 10
    assert "deltas:         10/10 pushes sent as changes to the last one" in result.stdout


def test_demo_with_an_fp8_engine_quantizes_every_push_and_checks_the_served_policy(tmp_path):
    result, record = _demo("--fp8", "--steps", "3", "--delta", "always", tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # the on-policy check ran against the quantized policy (the float32 trainer's own logprobs
    # differ from the FP8 engine's by far more than its 1e-3) and every fingerprint matched
    assert_demo_passed(record, result.stdout, num_steps=3)
    assert (record["transport"], record["tp"]) == ("shm, fp8-block", 1)
    assert [step["push_delta"] for step in record["steps"]] == [True] * 3
    assert "--quantization fp8-block" in result.stdout


def test_demo_with_a_draft_pushes_both_models_every_step(tmp_path):
    result, record = _demo(
        "--steps", "4", "--tp", "2", "--draft", "--delta", "always", "--seed", "5",
        tmp_path=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # each step: the engine serves the trainer's policy and draft as the step's version
    assert_demo_passed(record, result.stdout, num_steps=4)
    assert [step["push_delta"] for step in record["steps"]] == [True] * 4
    for step in record["steps"]:
        for name in ("draft_acceptance", "draft_in_step", "draft_frozen"):
            assert 0.0 <= step[name] <= 1.0, (step["step"], name)
    # the policy moved away from the step-0 draft; the draft kept in step followed it
    last = record["steps"][-1]
    assert last["draft_in_step"] > last["draft_frozen"]
    assert "draft:          accepted " in result.stdout
    assert "frozen at step 0" in result.stdout


def test_demo_with_lora_pushes_only_the_adapter_onto_the_served_base(tmp_path):
    result, record = _demo("--lora", "--steps", "3", "--seed", "6", tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # each step the engine serves the step's adapter on the base it started from: base and
    # adapter's fingerprint as the trainer computed it, the peft model's logprobs
    assert_demo_passed(record, result.stdout, num_steps=3)
    assert (record["lora_rank"], record["tp"]) == (8, 2)
    assert "--lora-rank 8" in result.stdout
    for step in record["steps"]:
        assert step["push_adapter"]
        assert step["push_bytes"] * 10 < record["full_model_bytes"]
    assert "adapter:        rank 8, " in result.stdout


def test_demo_with_qwen3_moe_on_two_expert_parallel_trainer_ranks(tmp_path, capsys):
    """transformers' Qwen3MoeForCausalLM (fused 3-D experts) trained with FSDP2 on two
    processes, which cuts the fused experts by expert: each trainer rank holds 4 of the 8
    experts and sends them (no gather) into an engine at TP 2 with expert parallelism, where
    each rank holds 4 experts and receives only those, plus its share of the dense weights.
    (The single-process trainer runs in the tests above; the sharded loop is the same for the
    tiny Llama, whose FSDP2 pushes tests/core/pushes/test_layout_matrix.py checks.)"""
    result, record = _demo(
        "--model", "qwen3-moe", "--trainer-ranks", "2", "--steps", "3", "--seed", "7",
        tmp_path=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert_demo_passed(record, result.stdout, num_steps=3)
    assert (record["model"], record["tp"]) == ("qwen3-moe", 2)
    assert "--tp 2 --expert-parallel; 2 trainer processes" in result.stdout
    assert "engine: TP 2, expert parallel: 4 experts per rank" in result.stdout
    model_bytes, expert_bytes = record["full_model_bytes"], record["expert_bytes"]
    assert 0 < expert_bytes < model_bytes
    # each trainer rank sends what `weightbus plan --trainer-layout ep` plans, every step
    planned = _planned_trainer_sends(tmp_path, capsys)
    assert record["planned_trainer_rank_bytes"] == planned
    for step in record["steps"]:
        assert step["push_trainer_rank_bytes"] == planned, step["step"]
        [rank_bytes] = step["push_rank_bytes"]  # one engine, by rank
        assert len(rank_bytes) == 2
        assert all(0 < nbytes < model_bytes for nbytes in rank_bytes)
    sent = " / ".join(format_bytes(nbytes) for nbytes in planned)
    each_step = f"trainer ranks sent {sent} (no gather); engine ranks received "
    assert result.stdout.count(each_step) == 3
    summary = f"trainer ranks:  sent {sent} (last push, by rank, no gather); weightbus plan: "
    assert summary + sent in result.stdout
    assert "(last push, by rank); the whole model is " in result.stdout


def _planned_trainer_sends(tmp_path, capsys) -> list[int]:
    """Each trainer rank's bytes, as `weightbus plan --model <the demo's qwen3-moe> --dtype
    float32 --engine-tp 2 --engine-ep 2 --trainer-ranks 2 --trainer-layout ep --transport shm`
    plans them."""
    from weightbus.apps.cli import main
    from weightbus.apps.demo.trainer import DEMO_MODELS

    DEMO_MODELS["qwen3-moe"].hf_config().to_json_file(tmp_path / "config.json")
    flags = {"--dtype": "float32", "--engine-tp": "2", "--engine-ep": "2", "--trainer-ranks": "2",
             "--trainer-layout": "ep", "--transport": "shm"}  # fmt: skip
    assert main(["plan", "--model", str(tmp_path), *sum(flags.items(), ()), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["traffic"]["trainer_send_bytes"]


@pytest.mark.parametrize(
    "flags", [["--engine", "http://127.0.0.1:9"], ["--engine", "vllm"]], ids=["engine-url", "vllm"]
)
def test_demo_refuses_qwen3_moe_with_what_it_cannot_combine(flags, capsys):
    from weightbus.apps.cli import main

    assert main(["demo", "--model", "qwen3-moe", *flags]) == 2
    assert capsys.readouterr().err == (
        "weightbus demo: error: --model qwen3-moe trains for the engines the demo starts: leave "
        "out --engine\n"
    )


@pytest.mark.parametrize(
    "flags",
    [
        ["--fp8"],
        ["--engine", "vllm"],
        ["--ray"],
        ["--draft"],
        ["--trainer-ranks", "2"],
        ["--delta", "always"],
        ["--lora-rank", "0"],
    ],
    ids=["fp8", "vllm", "ray", "draft", "trainer-ranks", "delta-always", "rank-0"],
)
def test_demo_refuses_lora_with_what_it_cannot_combine(flags, capsys):
    from weightbus.apps.cli import main

    assert main(["demo", "--lora", *flags]) == 2
    assert "weightbus demo: error: --lora" in capsys.readouterr().err
