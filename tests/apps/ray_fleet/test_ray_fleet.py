"""Reference-engine replicas placed by Ray on a three-node cluster (`conftest.py`): every wrong
bundle list refused before anything starts; groups weightbus owns; ranks on the bundles the
caller chose, in its order; a trainer actor's push into both replicas (shm to its node, nixl
across); a rank actor killed mid-push; nothing left once the fleet and Ray are shut down.

The tests run in file order on one cluster, and the fleet tests on one fleet (starting one
takes ~10 s): the last test shuts both down and checks what is left.
"""

import logging
import re
import time
from pathlib import Path

import httpx
import pytest
import ray
import trainer_actor
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray_harness import arenas_of, engine_actors, node_ids, ray_processes

from weightbus.apps.ray import RayFleet, RayFleetConfig
from weightbus.engines.reference.server.launcher import ServeConfig

logger = logging.getLogger(__name__)

HF_CASE = "qwen2_untied"  # `hf_model` (tests/conftest.py)
TIMEOUT_S = 60.0
LOGPROB_ATOL = 1e-4  # as in test_update_e2e.py: float32 engine vs transformers


def _bundles() -> list[dict]:
    """Bundles pinned to nodes: 0 and 2 on n0, 1 on n2, 3 on n1."""
    return [{"CPU": 1, "n0": 1}, {"CPU": 1, "n2": 1}, {"CPU": 1, "n0": 1}, {"CPU": 1, "n1": 1}]


def _indices_against_sorting(nodes: dict[str, str]) -> list[list[int]]:
    """Replica 0 on n0 in descending bundle order; replica 1's rank 0 on whichever of n1/n2
    sorts last by node id, so sorting ranks by node (or by bundle) would change both."""
    n1_first = nodes["n1"] < nodes["n2"]
    return [[2, 0], [1, 3] if n1_first else [3, 1]]


@pytest.fixture(scope="module")
def placed(ray_cluster, hf_model):
    """Two TP-2 replicas on the caller's placement group, on the bundles it chose."""
    path, _ = hf_model
    group = placement_group(_bundles(), strategy="PACK")
    indices = _indices_against_sorting(node_ids())
    config = RayFleetConfig(
        engine=ServeConfig(model=str(path), tp_size=2),
        num_replicas=2,
        placement_group=group,
        bundle_indices=indices,
    )
    fleet = RayFleet.start(config)
    try:
        yield fleet, group, indices
    finally:
        if ray.is_initialized():  # else the last test shut everything down
            fleet.shutdown()
            remove_placement_group(group)


@pytest.fixture(scope="module")
def trainer(placed, hf_model):
    """The trainer actor, on node n0: replica 0 is on its node, replica 1 is not."""
    path, _ = hf_model
    actor_class = ray.remote(trainer_actor.Trainer)
    actor = actor_class.options(num_cpus=0, resources={"n0": 0.01}).remote(str(path), TIMEOUT_S)
    yield actor
    if ray.is_initialized():  # else the last test shut everything down
        ray.get(actor.close.remote(), timeout=TIMEOUT_S)
        ray.kill(actor)


@pytest.fixture(scope="module")
def served() -> list[dict]:
    """The outcomes of the pushes that landed, in order (the last one is what replicas serve)."""
    return []


@pytest.fixture(scope="module")
def v1(placed, trainer, served) -> dict:
    fleet, _, _ = placed
    outcome = ray.get(
        trainer.step_and_push.remote(fleet.handles, "v1", seed=1), timeout=2 * TIMEOUT_S
    )
    served.append(outcome)
    return outcome


def _state(fleet: RayFleet, url: str) -> dict:
    headers = {"Authorization": f"Bearer {fleet.api_token}"}
    response = httpx.get(f"{url}/v1/weights", headers=headers, timeout=10.0)
    assert response.status_code == 200, response.text
    return response.json()


def _greedy(url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1}
    response = httpx.post(f"{url}/v1/completions", json=body | {"ignore_eos": True}, timeout=60.0)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _decodes_as(url: str, greedy: tuple[list[int], list[float]]) -> None:
    from engine_harness import NUM_GREEDY_TOKENS, PROMPT

    tokens, logprobs = _greedy(url, PROMPT, NUM_GREEDY_TOKENS)
    assert tokens == greedy[0]
    assert logprobs == pytest.approx(greedy[1], abs=LOGPROB_ATOL)


OUT_OF_RANGE = "out of range for a placement group of 4 bundles (0..3)"
# (bundle_indices, the ValueError's message); bundle 3 holds half a CPU
REFUSALS = [
    ([[0, 1]], "bundle_indices: 1 lists for 2 replicas (one list of bundle indices per replica)"),
    (
        [[0, 1], [2]],
        "bundle_indices[1]: 1 indices for a replica of tp_size 2 (one bundle per rank)",
    ),
    ([[0, 1], [2, 4]], f"bundle_indices[1][1] = 4: {OUT_OF_RANGE}"),
    ([[0, -1], [2, 3]], f"bundle_indices[0][1] = -1: {OUT_OF_RANGE}"),
    ([[0, 1], [1, 3]], "bundle_indices[1][0] = 1: bundle 1 is already given to replica 0 rank 1"),
    ([[0, 1], [2, "3"]], "bundle_indices[1][1] = '3': a bundle index is an int"),
    (
        [[0, 1], [2, 3]],
        (
            "bundle_indices[1][1] = 3: bundle 3 holds {'CPU': 0.5, 'n1': 1.0} but a rank asks for "
            "{'CPU': 1.0}"
        ),
    ),
]


@pytest.mark.parametrize(("indices", "message"), REFUSALS)
def test_wrong_bundle_indices_are_refused_before_anything_starts(ray_cluster, indices, message):
    bundles = [{"CPU": 1, "n0": 1}, {"CPU": 1, "n2": 1}, {"CPU": 1, "n0": 1}, {"CPU": 0.5, "n1": 1}]
    group = placement_group(bundles, strategy="PACK")
    actors_before = engine_actors()
    try:
        config = RayFleetConfig(
            engine=ServeConfig(tp_size=2),
            num_replicas=2,
            placement_group=group,
            bundle_indices=indices,
        )
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            RayFleet.start(config)
        assert engine_actors() == actors_before  # nothing started
    finally:
        remove_placement_group(group)


def test_bundle_indices_with_a_group_weightbus_owns_are_refused():
    with pytest.raises(
        ValueError,
        match=r"^bundle_indices apply only to a placement group the caller owns: pass "
        "placement_group= as well",
    ):
        RayFleetConfig(engine=ServeConfig(tp_size=2), bundle_indices=[[0, 1]])


def test_owned_groups_pack_each_replica_and_are_removed(ray_cluster, hf_model):
    path, _ = hf_model
    config = RayFleetConfig(engine=ServeConfig(model=str(path), tp_size=2), num_replicas=1)
    fleet = RayFleet.start(config)
    try:
        (replica,) = fleet.replicas
        assert [rank.bundle_index for rank in replica.ranks] == [0, 1]
        assert len({rank.node_id for rank in replica.ranks}) == 1  # STRICT_PACK
        group_id = replica.ranks[0].placement_group_id
        assert placement_group_table()[group_id]["state"] == "CREATED"
    finally:
        fleet.shutdown()
    assert placement_group_table()[group_id]["state"] == "REMOVED"
    assert not arenas_of([rank.pid for rank in replica.ranks])


def test_each_rank_runs_on_the_bundle_it_was_given_in_order(placed):
    fleet, group, indices = placed
    bundle_nodes = placement_group_table(group)["bundles_to_node_id"]
    for replica, given in zip(fleet.replicas, indices, strict=True):
        seen = ray.get([actor.placement.remote() for actor in replica.actors], timeout=TIMEOUT_S)
        assert [rank.bundle_index for rank in seen] == given  # from inside each actor
        assert {rank.placement_group_id for rank in seen} == {group.id.hex()}
        assert [rank.node_id for rank in seen] == [bundle_nodes[i] for i in given]
        assert seen == replica.ranks
    # sorting the ranks by node would have changed the caller's order (replica 0's, given
    # in descending bundle order, is checked above)
    replica1 = fleet.replicas[1]
    by_node = sorted(replica1.ranks, key=lambda rank: rank.node_id)
    assert [rank.bundle_index for rank in by_node] != indices[1]
    assert len({rank.node_id for rank in replica1.ranks}) == 2  # a replica across two nodes


def test_trainer_actor_pushes_both_replicas_bit_exact(placed, v1):
    fleet, _, _ = placed
    replica0, replica1 = fleet.replicas
    # shm to the replica on the trainer's node, nixl to the one across nodes: one push
    assert v1["routes"] == {replica0.url: "shm", replica1.url: "nixl"}
    assert v1["mode"] == "nixl: nixl, shm: shm direct"
    assert v1["fingerprint"] == v1["local_fingerprint"]
    assert v1["engines"] == {replica0.url: v1["fingerprint"], replica1.url: v1["fingerprint"]}
    for replica in fleet.replicas:
        state = _state(fleet, replica.url)
        assert (state["version"], state["fingerprint"]) == ("v1", v1["fingerprint"])
        _decodes_as(replica.url, v1["greedy"])


def test_trainer_actor_pushes_across_nodes_over_dist_too(placed, trainer, v1, served):
    fleet, _, _ = placed
    replica0, replica1 = fleet.replicas
    outcome = ray.get(
        trainer.step_and_push.remote(fleet.handles, "v1-dist", seed=4, cross_node="dist"),
        timeout=2 * TIMEOUT_S,
    )
    assert outcome["routes"] == {replica0.url: "shm", replica1.url: "dist"}
    assert outcome["mode"] == "dist: dist parts, shm: shm direct"  # TP 2: each rank its share
    assert set(outcome["engines"].values()) == {outcome["local_fingerprint"]}
    served.append(outcome)
    for replica in fleet.replicas:
        _decodes_as(replica.url, outcome["greedy"])


def test_killed_rank_actor_fails_the_push_fast_and_the_other_replica_serves(
    placed, trainer, served
):
    fleet, _, _ = placed
    replica0, replica1 = fleet.replicas
    victim = replica0.actors[1]  # rank 1 of the replica on the trainer's node
    outcome = ray.get(
        trainer.step_and_push.remote(fleet.handles, "v2", seed=2, victim=victim),
        timeout=2 * TIMEOUT_S,
    )
    assert "error" in outcome, outcome
    # replica 1 only failed because of it, if at all (aborted while it still received)
    for url, reason in outcome["failures"].items():
        assert url == replica0.url or replica0.url in reason, outcome["failures"]
    # rank 0's collectives fail on its dead peer: the engine answers 503 with why
    assert outcome["failures"][replica0.url].startswith(
        "HTTP 503: engine unavailable: rank 0 failed: "
    ), outcome["failures"]
    logger.info("push failed %.2f s after the kill: %s", outcome["seconds_after_kill"], outcome)
    # failed once the rank was gone, not after the push's timeout
    assert outcome["seconds_after_kill"] < TIMEOUT_S / 2, outcome
    health = fleet.health()
    assert health[replica0.url][0].startswith("rank 0: rank 0 failed: ")  # its peer is gone
    assert health[replica0.url][1] == "rank 1: actor died"
    assert health[replica1.url] == []
    # two-phase: the other replica discarded what it staged and serves the last version
    last = served[-1]
    state = _state(fleet, replica1.url)
    assert state["fingerprint"] == last["local_fingerprint"]
    _decodes_as(replica1.url, last["greedy"])
    # the fleet goes on without the broken replica
    assert ray.get(trainer.remove_engine.remote(replica0.url), timeout=TIMEOUT_S) == [replica1.url]
    v3 = ray.get(trainer.step_and_push.remote(fleet.handles, "v3", seed=3), timeout=2 * TIMEOUT_S)
    assert v3["engines"] == {replica1.url: v3["local_fingerprint"]}
    _decodes_as(replica1.url, v3["greedy"])


def test_shutdown_leaves_no_process_group_or_shared_memory(ray_cluster, placed, trainer):
    fleet, group, _ = placed
    pids = [rank.pid for replica in fleet.replicas for rank in replica.ranks]
    assert arenas_of(pids)  # the live ranks' parameters (the killed one's too)
    ray.get(trainer.close.remote(), timeout=TIMEOUT_S)
    fleet.shutdown()
    remove_placement_group(group)
    assert not arenas_of(pids)
    assert placement_group_table(group)["state"] == "REMOVED"
    session_dir = ray_cluster.head_node.get_session_dir_path()
    ray.shutdown()
    ray_cluster.shutdown()
    deadline = time.monotonic() + 30.0  # processes exit asynchronously after their kill
    while ray_processes(session_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_processes(session_dir) == []
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]
