"""An MoE engine's live expert map, read and re-placed over HTTP (`GET /v1/experts`,
`POST /v1/experts/place`), on one `weightbus serve --tp 2 --expert-parallel
--redundant-experts 2` shared by the module.

A re-placement moves weights, never changes what the engine computes: the same greedy tokens
before and after, a version pushed again after one serves what it served before (each expert
reached its new slots), and a rollback after one restores the previous version (the staging
memory's experts moved too). Refused while a push is in flight (409 naming the live map);
a bad map is refused naming the field. A `dist` push whose group registered the ranks' slice
maps before a re-placement is refused by the ranks, and the next push forms the group anew.
"""

import threading
import time
from pathlib import Path

import pytest
from engine_harness import ServedEngine
from update_harness import weights_state

from weightbus import Publisher, PushError
from weightbus.core.publisher.targets.http import EngineExperts, HttpEngineTarget
from weightbus.engines.reference.models.config import ModelConfig
from weightbus.engines.reference.models.loader import random_hf_weights

PROMPT = [4, 2, 42, 17, 99, 3]
NUM_TOKENS = 12
# under EP 2 with 2 redundant slots: 8 experts on 2 ranks x 5 slots
LINEAR = [[0, 1, 2, 3, 4], [4, 5, 6, 7, 0]]
ROUND_ROBIN = [[0, 2, 4, 6, 1], [1, 3, 5, 7, 0]]
# experts that change ranks, replicas elsewhere: no named placement gives it
CUSTOM = [[7, 5, 3, 1, 0], [6, 4, 2, 0, 1]]


@pytest.fixture(scope="module")
def moe_ep2(
    shared_processes, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ServedEngine, Path]:
    """The engine and its checkpoint directory (transformers' Qwen3-MoE, 8 experts, top 2):
    the one test_moe_pushes.py shares (`shared_processes.moe_engine`)."""
    flags = ("--tp", "2", "--expert-parallel", "--redundant-experts", "2")
    engine = shared_processes.moe_engine(*flags, log_dir=tmp_path_factory.mktemp("log"))
    return engine, shared_processes.moe_checkpoint()


def _weights(model_dir: Path, seed: int) -> list:
    return list(random_hf_weights(ModelConfig.from_hf_dir(model_dir), seed))


def _greedy(engine: ServedEngine) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0.0, "ignore_eos": True}
    response = engine.complete(**body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def _experts(engine: ServedEngine) -> dict:
    response = engine.client.get("/v1/experts")
    assert response.status_code == 200, response.text
    return response.json()


def _place(engine: ServedEngine, **body: object) -> dict:
    response = engine.client.post("/v1/experts/place", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _layout(engine: ServedEngine) -> dict:
    response = engine.client.get("/v1/weights/layout")
    assert response.status_code == 200, response.text
    return response.json()


def test_the_engine_reports_its_live_expert_map(moe_ep2):
    engine, _ = moe_ep2
    _place(engine, placement="linear")  # whatever the other tests left
    experts = _experts(engine)
    assert experts["expert_map"] == LINEAR
    assert (experts["placement"], experts["redundant_experts"], experts["num_experts"]) == (
        "linear",
        2,
        8,
    )
    layout = _layout(engine)
    assert layout["expert_map"] == experts
    with HttpEngineTarget(engine.url) as target:  # the publisher's read
        assert target.expert_map(timeout_s=10) == EngineExperts(**experts)
    # an EP rank takes bytes of its own experts only: the others' have slices of length 0
    rank1 = {name: length for name, _, _, length in layout["ranks"][1]}
    held = {name for name, length in rank1.items() if ".experts." in name and length}
    assert {name.split(".experts.")[1].split(".")[0] for name in held} == {"4", "5", "6", "7", "0"}


def test_a_replacement_keeps_the_tokens_and_moves_the_slice_maps(moe_ep2):
    engine, _ = moe_ep2
    before = _place(engine, placement="linear")
    tokens, layout = _greedy(engine), _layout(engine)
    placed = _place(engine, placement="round_robin")
    assert (placed["expert_map"], placed["placement"]) == (ROUND_ROBIN, "round_robin")
    assert placed["hash"] != before["hash"]
    assert _experts(engine) == placed
    moved = _layout(engine)
    assert moved["expert_map"]["hash"] == placed["hash"]
    assert moved["ranks"] != layout["ranks"]
    assert _greedy(engine) == tokens  # the same weights, other slots
    custom = _place(engine, expert_map=CUSTOM)
    assert (custom["expert_map"], custom["placement"]) == (CUSTOM, "custom")
    assert _greedy(engine) == tokens


@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_a_push_after_a_replacement_fills_the_new_slots(moe_ep2, transport):
    """Version A's tokens, a re-placement, version B, then A again: A's tokens come back.
    Over `dist` the group formed before the re-placement holds the old slice maps: the ranks
    refuse the push naming the expert map, and the next push forms the group anew."""
    engine, model_dir = moe_ep2
    _place(engine, placement="linear")
    with Publisher([engine.url], transport=transport, timeout_s=30) as pub:
        pub.push(_weights(model_dir, 1), version=f"{transport}-a")
        tokens = _greedy(engine)
        _place(engine, expert_map=CUSTOM)
        if transport == "dist":
            with pytest.raises(PushError, match="its expert map was re-placed"):
                pub.push(_weights(model_dir, 2), version="dist-stale")
        pub.push(_weights(model_dir, 2), version=f"{transport}-b")
        assert _greedy(engine) != tokens
        result = pub.push(_weights(model_dir, 1), version=f"{transport}-a-again")
    assert result.mode == {"shm": "shm direct", "dist": "dist parts"}[transport]
    assert weights_state(engine)["fingerprint"] == result.fingerprint
    assert _greedy(engine) == tokens


def _nudged(weights: list, step: int) -> list:
    """`weights` with a few elements of one expert changed: a version a delta carries."""
    name = "model.layers.0.mlp.experts.5.gate_proj.weight"
    out = [(n, t.clone() if n == name else t) for n, t in weights]
    dict(out)[name][0, :4] += 0.125 * step
    return out


def test_a_delta_encoded_for_the_old_expert_map_is_refused_and_the_whole_version_goes(moe_ep2):
    """A delta's slice digests follow the slice maps the publisher read: after a re-placement
    the engine refuses its base naming both maps, the publisher pushes the whole version, and
    reads the maps again for the next delta."""
    engine, model_dir = moe_ep2
    _place(engine, placement="linear")
    base = _weights(model_dir, 6)
    with Publisher([engine.url], transport="shm", delta="always", timeout_s=30) as pub:
        pub.push(base, version="delta-a")
        assert pub.push(_nudged(base, 1), version="delta-b").delta.sent
        moved = _place(engine, placement="round_robin")
        refused = pub.push(_nudged(base, 2), version="delta-c")
        assert not refused.delta.sent
        assert f"experts are placed as {moved['hash']} now" in refused.delta.reason
        assert weights_state(engine)["fingerprint"] == refused.fingerprint
        again = pub.push(_nudged(base, 3), version="delta-d")
    assert again.delta.sent, again.delta.reason
    assert weights_state(engine)["fingerprint"] == again.fingerprint


def test_a_rollback_after_a_replacement_serves_the_previous_version(moe_ep2):
    """The staging memory holds the previous version: its experts move with the live ones."""
    engine, model_dir = moe_ep2
    _place(engine, placement="linear")
    with Publisher([engine.url], transport="shm", timeout_s=30) as pub:
        previous = pub.push(_weights(model_dir, 4), version="rollback-a")
        tokens = _greedy(engine)
        pub.push(_weights(model_dir, 5), version="rollback-b")
        _place(engine, placement="round_robin")
        pub.rollback()
    state = weights_state(engine)
    assert (state["version"], state["fingerprint"]) == ("rollback-a", previous.fingerprint)
    assert _greedy(engine) == tokens


def test_a_replacement_is_refused_while_a_push_is_in_flight(moe_ep2):
    engine, model_dir = moe_ep2
    live = _experts(engine)
    version = f"in-flight-{time.monotonic_ns()}"
    # a drain push stays in flight while a sequence runs, and it runs until generation goes on
    running = threading.Thread(
        target=lambda: engine.complete(prompt=PROMPT, max_tokens=50, ignore_eos=True)
    )
    running.start()
    assert engine.complete(prompt=[1], max_tokens=1).status_code == 200  # the long one runs
    paused = engine.client.post("/v1/pause_generation", json={"mode": "in_place"})
    assert paused.status_code == 200, paused.text
    with Publisher([engine.url], transport="shm", timeout_s=60) as pub:
        pushing = threading.Thread(
            target=lambda: pub.push(_weights(model_dir, 3), version=version, pause_mode="drain")
        )
        pushing.start()
        deadline = time.monotonic() + 30
        while weights_state(engine)["status"] != "UPDATING":
            assert time.monotonic() < deadline, "the push never reached the engine"
        response = engine.client.post("/v1/experts/place", json={"placement": "round_robin"})
        assert engine.client.post("/v1/continue_generation").status_code == 200
        pushing.join(60)
    running.join(60)
    assert response.status_code == 409, response.text
    assert response.json()["error"]["message"] == (
        f"a push of {version!r} is in flight: the expert map stays {live['hash']}"
    )
    assert _experts(engine) == live
    assert weights_state(engine)["version"] == version


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        ({"expert_map": [[0, 1, 2, 3, 4]]}, 400, "expert_map", "expert_map has 1 ranks; "),
        (
            {"expert_map": [[0, 1, 2, 3], [4, 5, 6, 7]]},
            400,
            "expert_map",
            "expert_map rank 0 has 4 slots; every rank of this engine holds 5",
        ),
        (
            {"expert_map": [[0, 1, 2, 3, 9], [4, 5, 6, 7, 0]]},
            400,
            "expert_map",
            "expert map: rank 0 slot 4 holds expert 9, not in [0, 8)",
        ),
        (
            {"expert_map": [[0, 1, 2, 3, 4], [4, 5, 6, 0, 1]]},
            400,
            "expert_map",
            "expert map: experts [7] have no slot",
        ),
        (
            {"expert_map": [[0, 1, 2, 3, 3], [4, 5, 6, 7, 0]]},
            400,
            "expert_map",
            "expert map: expert 3 is held twice on rank 0",
        ),
        ({"placement": "random"}, 422, "placement", "invalid field 'placement'"),
        ({"expert_map": [["a"]]}, 422, "expert_map", "invalid field 'expert_map'"),
        ({}, 422, None, "invalid request body: Value error, give exactly one of"),
    ],
    ids=["ranks", "slots", "unknown-expert", "no-slot", "twice", "placement", "type", "neither"],
)
def test_a_bad_request_is_refused_naming_the_field(moe_ep2, body, status, param, message):
    engine, _ = moe_ep2
    live = _experts(engine)
    response = engine.client.post("/v1/experts/place", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["param"], error["message"][: len(message)]) == (param, message)
    assert _experts(engine) == live
