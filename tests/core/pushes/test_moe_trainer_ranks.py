"""Expert-parallel trainers: 2 FSDP2 ranks (real processes, a gloo mesh, AdamW steps) each
holding half of the tiny Qwen3-MoE's experts (transformers 5's fused expert tensors cut by
expert) push into engines at EP 2 (with and without redundant slots) and TP 2, in one
two-phase fleet, over `shm` direct and `dist` parts.

Each rank sends each expert it holds straight to the engine ranks (slots) serving it, and
nothing it does not hold: no DTensor is gathered during a push (the trainer makes a gather
raise), and each rank's bytes are `weightbus plan --trainer-layout ep`'s. The experts go as
FSDP2 holds them, declared (`DeclaredShard`s, Megatron-style) or as the checkpoint's per-expert
tensors: one fingerprint, the gathered model's; tokens transformers'. A rank SIGKILLed mid-push
fails the push on the other, naming it, and no engine commits.
"""

import copy

import pytest
import torch
from moe_fleet import LONG_PROMPT
from sharded_harness import gathered, run_trainers
from update_harness import engine_greedy, hf_greedy, weights_state

from weightbus.apps.capacity.shapes import ModelTensors
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.capacity.traffic import traffic
from weightbus.core.digest import fingerprint
from weightbus.core.meta import metas_of
from weightbus.core.plan.planner import DEFAULT_BUCKET_BYTES
from weightbus.core.weights import normalize_weights

pytestmark = pytest.mark.e2e

FLEET = {  # engine -> its layout in `weightbus plan`
    "ep2": EngineLayout(2, 2),
    "ep2_redundant": EngineLayout(2, 2, "linear", 2),
    "tp2": EngineLayout(2),
}
FORMS = {"fsdp": "shm", "declared": "dist", "per_expert": "shm"}  # experts' form -> transport
LOGPROB_ATOL = 1e-4


def _planned_sends(model: torch.nn.Module, weights: list) -> list[int]:
    """Each trainer rank's bytes into the fleet, as `weightbus plan --trainer-layout ep`."""
    tensors = ModelTensors("tiny qwen3-moe", tuple(metas_of(weights)), model.config.to_dict())
    plans = [
        traffic(tensors, layout, "shm", trainer_ranks=2, trainer_layout="ep",
                bucket_bytes=DEFAULT_BUCKET_BYTES)
        for layout in FLEET.values()
    ]  # fmt: skip
    return [sum(plan.trainer_send_bytes[rank] for plan in plans) for rank in range(2)]


def test_expert_parallel_ranks_send_each_expert_from_its_holder(moe_engines, hf_moe, tmp_path):
    path, model = hf_moe
    fleet = [moe_engines[name].url for name in FLEET]
    actions = []
    for form, transport in FORMS.items():
        push = {"version": f"ep-{form}", "experts": form, "transport": transport, "save": True}
        actions += [{"kind": "train", "steps": 1}, {"kind": "push", **push}]
    actions.append({"kind": "kill", "version": "ep-killed", "on": 1})
    records = run_trainers(2, str(path), fleet, actions, tmp_path, timeout_s=8)
    assert all(all(r["ok"] for r in rank[:3]) for rank in records), records
    expected_sends = None
    for index, form in enumerate(FORMS):
        weights = normalize_weights(gathered(tmp_path, f"ep-{form}"))
        assert {rank[index]["fingerprint"] for rank in records} == {fingerprint(weights)}, form
        expected_sends = expected_sends or _planned_sends(model, weights)
        sent = records[0][index]["sent_bytes"]
        assert sent == expected_sends, form  # each expert once per slot, from its holder
    last = copy.deepcopy(model)
    last.load_state_dict(gathered(tmp_path, "ep-per_expert"))
    tokens, logprobs = hf_greedy(last, LONG_PROMPT)
    for name in FLEET:
        choice = engine_greedy(moe_engines[name], LONG_PROMPT)
        assert choice["token_ids"] == tokens, name
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=LOGPROB_ATOL)
    # rank 1 dies as its copies start: rank 0 fails the push naming it, no engine commits
    killed = records[0][3]
    assert len(records[1]) == 3, records[1]
    assert killed["error"] == "PushError", killed
    assert "trainer rank 1 sent no " in killed["message"], killed
    assert killed["seconds"] < 8 * 4  # bounded by the push's timeout_s
    for name in FLEET:
        state = weights_state(moe_engines[name])
        assert (state["status"], state["version"]) == ("NORMAL", "ep-per_expert"), name
        assert state["fingerprint"] == records[0][2]["fingerprint"], name
