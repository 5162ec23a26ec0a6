"""FSDP2 ranks (real processes on a gloo mesh, AdamW steps) push what each holds over every
transport (`shm` direct and slots, `nixl`, `disk`, `dist`) into a two-engine fleet, with no
gather: one fingerprint, the single-process one, and each rank's bytes the planner's. A rank
that fails, raises or dies fails the push on every rank, naming it, while the engines keep
serving the previous version. (Every feature on every layout: test_layout_matrix.py.)"""

from sharded_harness import gathered, run_trainers
from update_harness import engine_greedy, weights_state

from weightbus.apps.capacity.shapes import model_tensors
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.capacity.traffic import traffic
from weightbus.apps.demo.trainer import hf_llama_config
from weightbus.core.digest import fingerprint
from weightbus.core.plan.planner import DEFAULT_BUCKET_BYTES as BUCKET
from weightbus.core.publisher import normalize_weights
from weightbus.engines.reference.models.config import tiny_config

SEED = 5  # `engines` (conftest.py): the shared tiny engines tp2 and tp1, and a reference
HF_CASE = "qwen2_tied_kv1_sharded"  # `hf_model` and `engine` (tests/conftest.py): at TP 2
LOGPROB_ATOL = 1e-4  # float32 engine vs transformers (test_update_e2e.py)
# the failing pushes' bound: a rank killed over shm is found silent after it (the others' pushes
# take under 0.7 s with the cores three times loaded)
TIMEOUT_S = 4


def test_fsdp2_ranks_push_to_a_two_engine_fleet_without_a_gather(engines, tmp_path):
    """2 FSDP2 ranks, pushes with training between (straight into the engines' parameters, then
    through the slots), then over nixl and disk, into engines of TP 2 and TP 1 (two-phase)."""
    fleet = [engines["tp2"].url, engines["tp1"].url]
    actions = [
        {"kind": "train", "steps": 2},
        {"kind": "push", "version": "fsdp-1", "save": True},
        {"kind": "train", "steps": 1},
        {"kind": "push", "version": "fsdp-2", "save": True, "direct": False},
        {"kind": "push", "version": "fsdp-3", "transport": "nixl"},
        {"kind": "push", "version": "fsdp-4", "transport": "disk"},
        {"kind": "push", "version": "fsdp-5", "transport": "dist"},
    ]
    records = run_trainers(2, "tiny", fleet, actions, tmp_path)
    assert all(len(r) == 5 and all(x["ok"] for x in r) for r in records), records
    for index, version in enumerate(["fsdp-1", "fsdp-2"]):
        weights = normalize_weights(gathered(tmp_path, version))
        expected = fingerprint(weights)
        assert {r[index]["fingerprint"] for r in records} == {expected}
        sent = records[0][index]["sent_bytes"]
        total = sum(t.nbytes for _, t in weights)
        norms = sum(t.nbytes for _, t in weights if t.dim() == 1)
        # no gather, no byte twice, each rank its half: straight into the parameters, each
        # engine's bytes (TP 2: the norms to both ranks); through the slots, the model once
        assert sum(sent) == (2 * total + norms if index == 0 else total)
        assert all(abs(s - sum(sent) / 2) <= sum(sent) / 8 for s in sent), sent
    # the planner's FSDP model of the same push: what each trainer rank sends, what each engine
    # rank receives (one plan per engine: TP 2, TP 1)
    config = tmp_path / "config"
    hf_llama_config(tiny_config()).save_pretrained(config)
    plans = [
        traffic(model_tensors(config, "float32"), EngineLayout(tp), transport, bucket_bytes=BUCKET,
                trainer_ranks=2, trainer_layout="fsdp")
        for transport in ("shm", "shm-slots") for tp in (2, 1)
    ]  # fmt: skip
    direct, slots, nixl, disk, over_dist = records[0]
    # dist: every rank sends each engine rank its parts over the weights group, as direct
    assert (over_dist["sent_bytes"], over_dist["rank_nbytes"]) == (
        direct["sent_bytes"],
        direct["rank_nbytes"],
    )
    assert {r[4]["fingerprint"] for r in records} == {slots["fingerprint"]}
    # disk: every rank writes its rows into the session's shards, each byte once
    assert disk["sent_bytes"] == slots["sent_bytes"]
    assert {r[3]["fingerprint"] for r in records} == {slots["fingerprint"]}
    # nixl: every rank posts its own WRITEs of the same pieces as direct; same fingerprint
    assert (nixl["sent_bytes"], nixl["rank_nbytes"]) == (
        direct["sent_bytes"],
        direct["rank_nbytes"],
    )
    assert {r[2]["fingerprint"] for r in records} == {slots["fingerprint"]}
    assert direct["rank_nbytes"] == [list(plans[0].receive_bytes), list(plans[1].receive_bytes)]
    assert slots["rank_nbytes"] == [list(plans[2].receive_bytes), list(plans[3].receive_bytes)]
    assert direct["sent_bytes"] == [
        a + b for a, b in zip(*(p.trainer_send_bytes for p in plans[:2]), strict=True)
    ]
    assert tuple(slots["sent_bytes"]) == plans[2].trainer_send_bytes  # packed once for both
    for engine in (engines["tp2"], engines["tp1"]):
        state = weights_state(engine)
        assert (state["version"], state["fingerprint"]) == ("fsdp-5", expected)


def test_a_failing_or_dead_trainer_rank_fails_the_push_everywhere_and_engines_keep_serving(
    engine, hf_model, tmp_path
):
    path, _ = hf_model
    actions = [
        {"kind": "push", "version": "base", "options": {"force": True}},
        {"kind": "train", "steps": 1},
        {"kind": "nan", "version": "nan", "on": 1},
        {"kind": "raise", "version": "raise", "on": 1},
        {"kind": "push", "version": "base"},  # served already: the engine answers 409
        {"kind": "kill", "version": "killed", "on": 1},
    ]
    records = run_trainers(2, str(path), [engine.url], actions, tmp_path, TIMEOUT_S)
    rank0, rank1 = records
    assert rank0[0]["ok"], records
    assert rank1[0]["ok"], records
    before = weights_state(engine), engine_greedy(engine)
    assert before[0]["version"] == "base"
    nan, raised, refused, killed = rank0[1:]
    for record in (nan, rank1[1]):
        assert record["error"] == "NonFiniteWeightsError"
        assert "model.norm.weight (1 NaN, 0 inf) on trainer rank 1" in record["message"]
        assert "on trainer rank 1" in record["message"]
    assert (raised["error"], rank1[2]["error"]) == ("TrainerRankError", "TypeError")
    assert "trainer rank 1 failed" in raised["message"]
    assert "'not.a.tensor'" in raised["message"]
    for record in (refused, rank1[3]):
        assert record["error"] == "PushError", record
        assert "409" in record["message"], record
    assert len(rank1) == 4  # rank 1 died in its copies
    assert killed["error"] == "PushError", killed
    assert "trainer rank 1 sent no " in killed["message"], killed
    # bounded by the push's timeout_s, not the 120 s default
    assert killed["seconds"] < TIMEOUT_S * 4
    state, choice = weights_state(engine), engine_greedy(engine)
    assert (state["status"], state["version"], state["fingerprint"]) == (
        "NORMAL",
        "base",
        before[0]["fingerprint"],
    )
    assert choice["token_ids"] == before[1]["token_ids"]
    assert choice["logprobs"]["token_logprobs"] == before[1]["logprobs"]["token_logprobs"]
    # over dist: the weights group forms on the first push, and again after a failed one (the
    # engine's 409); a rank killed mid-stream fails the push on rank 0 within the bound, naming
    # it, and the engine keeps what it served
    dist_actions = [
        {"kind": "train", "steps": 1},
        {"kind": "push", "version": "dist-1", "transport": "dist"},
        {"kind": "push", "version": "dist-1", "transport": "dist"},
        {"kind": "push", "version": "dist-2", "transport": "dist"},
        {"kind": "kill", "version": "dist-killed", "on": 1, "transport": "dist"},
    ]
    first, again, landed, killed = run_trainers(
        2, str(path), [engine.url], dist_actions, tmp_path / "dist", TIMEOUT_S
    )[0]
    assert first["ok"], first
    assert (again["error"], "409" in again["message"]) == ("PushError", True), again
    assert landed["ok"], landed
    assert killed["error"] == "PushError", killed
    assert "trainer rank 1 sent no report" in killed["message"], killed
    # bounded by the push's timeout_s, not the 120 s default
    assert killed["seconds"] < TIMEOUT_S * 4
    state = weights_state(engine)
    assert (state["status"], state["version"]) == ("NORMAL", "dist-2")
    assert state["fingerprint"] == landed["fingerprint"]
