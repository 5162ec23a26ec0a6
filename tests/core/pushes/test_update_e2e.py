"""Live updates through a real engine (TP 2, HF checkpoint) over HTTP with the disk transport
(and `shm`, for the NaN/inf check its copies run)."""

import math
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_harness import PROMPT, ServedEngine
from update_harness import KiB, engine_greedy, hf_greedy, trained_copy, weights_state

from helpers import sending_of
from sessions import SessionFactory
from weightbus import Publisher, PushError
from weightbus.core.finite import (
    NOTHING_SENT,
    NOTHING_SERVED,
    NonFiniteWeightsError,
    nonfinite_counts,
)
from weightbus.core.transport import encode_description, make_sink
from weightbus.core.transport.disk import MANIFEST_NAME
from weightbus.core.weights import normalize_weights

# `hf_model` and `engine` (tests/conftest.py): this checkpoint, served at TP 2
HF_CASE = "qwen2_untied"
# float32 engine vs transformers on the same weights: fused projections and the TP-2 split
# sums round differently at ~1e-6; logprobs of a 101-token vocabulary stay within 1e-4.
LOGPROB_ATOL = 1e-4


@pytest.fixture
def publisher(engine: ServedEngine, tmp_path: Path):
    with Publisher(
        [engine.url], bucket_bytes=64 * KiB, timeout_s=30, transport_options={"root": tmp_path}
    ) as pub:
        yield pub


@pytest.fixture
def shm_publisher(engine: ServedEngine):
    with Publisher([engine.url], transport="shm", bucket_bytes=64 * KiB, timeout_s=30) as pub:
        yield pub


def _serving(engine: ServedEngine) -> tuple[dict, dict]:
    return weights_state(engine), engine_greedy(engine)


def assert_unchanged(engine: ServedEngine, before: tuple[dict, dict]) -> None:
    """The engine still serves exactly what it served before a failed update."""
    state, choice = _serving(engine)
    assert state["status"] == "NORMAL"
    assert (state["version"], state["fingerprint"]) == (
        before[0]["version"],
        before[0]["fingerprint"],
    )
    assert choice["token_ids"] == before[1]["token_ids"]
    assert choice["logprobs"]["token_logprobs"] == before[1]["logprobs"]["token_logprobs"]


def test_trained_weights_serve_like_transformers(engine, hf_model, publisher):
    _, model = hf_model
    trained = trained_copy(model, seed=1)
    result = publisher.push(trained, version="train-1", step=1)
    assert result.fingerprint == publisher.fingerprint(trained)
    assert [e.fingerprint for e in result.engines] == [result.fingerprint]
    state = weights_state(engine)
    assert (state["version"], state["step"], state["fingerprint"]) == (
        "train-1",
        1,
        result.fingerprint,
    )
    assert state["history"][-1]["version"] == "train-1"

    tokens, logprobs = hf_greedy(trained)
    choice = engine_greedy(engine)
    assert choice["token_ids"] == tokens
    assert choice["weight_version"] == "train-1"
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=LOGPROB_ATOL)
    # the update changed the model: the old weights decode differently
    assert hf_greedy(model) != (tokens, logprobs)


def test_repushing_the_served_version_is_409_unless_forced(engine, hf_model, publisher):
    _, model = hf_model
    publisher.push(model, version="same", force=True)
    with pytest.raises(PushError, match=r"HTTP 409: version 'same' is already being served"):
        publisher.push(model, version="same")
    assert publisher.push(model, version="same", force=True).version == "same"


def test_step_must_increase(engine, hf_model, publisher):
    _, model = hf_model
    publisher.push(model, version="step-100", step=100)
    with pytest.raises(PushError, match="HTTP 409: step 100 is not above the current step 100"):
        publisher.push(model, version="step-100b", step=100)


@pytest.mark.parametrize(
    ("edit", "message", "names"),
    [
        (
            lambda w: [*w, ("model.extra.weight", torch.zeros(3))],
            "unknown tensors",
            ["model.extra.weight"],
        ),
        (
            lambda w: [p for p in w if p[0] != "model.norm.weight"],
            "missing tensors",
            ["model.norm.weight"],
        ),
        (
            lambda w: [(n, t[:-1] if n == "model.norm.weight" else t) for n, t in w],
            "tensor 'model.norm.weight': expected float32[64], got float32[63]",
            ["model.norm.weight"],
        ),
        (
            lambda w: [(n, t.double() if n == "model.norm.weight" else t) for n, t in w],
            "tensor 'model.norm.weight': expected float32[64], got float64[64]",
            ["model.norm.weight"],
        ),
    ],
    ids=["unknown", "missing", "wrong shape", "wrong dtype"],
)
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in_place"])
def test_bad_layout_is_400_naming_tensors_and_nothing_changes(
    engine, hf_model, publisher, edit, message, names, atomic
):
    _, model = hf_model
    before = _serving(engine)
    weights = edit(normalize_weights(trained_copy(model, seed=2)))
    with pytest.raises(PushError) as raised:
        publisher.push(weights, version="bad-layout", atomic=atomic)
    reason = raised.value.failures[engine.url]
    assert reason.startswith("HTTP 400: ")
    assert message in reason
    assert f"(tensors: {names})" in reason
    assert_unchanged(engine, before)


def test_duplicated_names_are_refused_before_anything_is_sent(engine, hf_model, publisher):
    _, model = hf_model
    before = _serving(engine)
    weights = normalize_weights(trained_copy(model, seed=2))
    name, tensor = weights[-1]
    with pytest.raises(ValueError, match=f"duplicate tensor name '{name}'"):
        publisher.push([*weights, (name, tensor.clone())], version="duplicated")
    assert_unchanged(engine, before)


def _prepared_session(tmp_path: Path, weights, version: str) -> tuple[dict, str]:
    sink = make_sink("disk", root=tmp_path / "manual")
    session = SessionFactory(64 * KiB).session(normalize_weights(weights), version, None)
    description = sink.prepare(session, sending_of(weights))
    return encode_description(description), session.plan.plan_hash


def _post_update(engine: ServedEngine, source: dict, version: str, **extra) -> dict:
    body = {"version": version, "transport": "disk", "source": source, "timeout_s": 20, **extra}
    response = engine.client.post("/v1/update_weights", json=body)
    return {"status": response.status_code, **response.json()}


def test_stream_version_must_equal_requested_version(engine, hf_model, tmp_path):
    _, model = hf_model
    before = _serving(engine)
    source, _ = _prepared_session(tmp_path, trained_copy(model, seed=3), "written-as-a")
    answer = _post_update(engine, source, "requested-b")
    assert answer["status"] == 400
    assert "stream version 'written-as-a' != requested 'requested-b'" in answer["error"]["message"]
    assert_unchanged(engine, before)


def test_stale_plan_hash_is_400(engine, hf_model, tmp_path):
    _, model = hf_model
    before = _serving(engine)
    source, _ = _prepared_session(tmp_path, trained_copy(model, seed=3), "stale")
    answer = _post_update(engine, source, "stale", plan_hash="0" * 32)
    assert answer["status"] == 400
    assert "stale plan" in answer["error"]["message"]
    assert_unchanged(engine, before)


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in_place"])
def test_corrupted_shard_is_caught_by_digest(engine, hf_model, tmp_path, atomic):
    _, model = hf_model
    before = _serving(engine)
    source, _ = _prepared_session(tmp_path, trained_copy(model, seed=4), f"corrupt-{atomic}")
    shard = min(Path(source["path"]).glob("shard-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x40  # the last byte of the shard's last tensor
    shard.write_bytes(bytes(data))
    answer = _post_update(engine, source, f"corrupt-{atomic}", atomic=atomic)
    assert answer["status"] == 400
    assert "digest mismatch for tensor" in answer["error"]["message"]
    assert len(answer["names"]) == 1
    if atomic:
        assert_unchanged(engine, before)
        return
    # in place: the half-written model is never served; a good update brings it back
    state = weights_state(engine)
    assert state["status"] == "FAILED"
    refused = engine.complete(prompt=PROMPT, max_tokens=2)
    assert refused.status_code == 503
    good, _ = _prepared_session(tmp_path, model, "recovered")
    assert _post_update(engine, good, "recovered", atomic=False)["status"] == 200
    assert weights_state(engine)["status"] == "NORMAL"


def test_missing_manifest_is_400(engine, tmp_path):
    before = _serving(engine)
    answer = _post_update(engine, {"path": str(tmp_path / "nowhere")}, "ghost")
    assert answer["status"] == 400
    assert f"no manifest at {tmp_path / 'nowhere' / MANIFEST_NAME}" in answer["error"]["message"]
    assert_unchanged(engine, before)


def _long_completion(engine: ServedEngine, results: list) -> threading.Thread:
    def run() -> None:
        results.append(
            engine.complete(prompt=PROMPT, max_tokens=100, temperature=0.0, ignore_eos=True).json()
        )

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_until_admitted(engine: ServedEngine) -> None:
    """Requests are admitted in arrival order: once a later one-token request has finished,
    every earlier request is running."""
    time_limit = time.monotonic() + 30
    while time.monotonic() < time_limit:
        # the long request may still be in flight to the server: retry until it is queued first
        if engine.complete(prompt=[1, 2], max_tokens=1).status_code == 200:
            return
    raise AssertionError("a one-token request never completed")


def _wait_for_status(engine: ServedEngine, status: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if weights_state(engine)["status"] == status:
            return
    raise AssertionError(f"engine never reached status {status}")


def test_concurrent_push_is_409_and_drain_finishes_running_requests_on_the_old_version(
    engine, hf_model, publisher, tmp_path
):
    _, model = hf_model
    old_version = publisher.push(model, version="drain-old", force=True).version
    completions: list = []
    running = _long_completion(engine, completions)
    _wait_until_admitted(engine)
    first: list = []
    pushing = threading.Thread(
        target=lambda: first.append(
            publisher.push(trained_copy(model, seed=5), version="drain-new")
        )
    )
    pushing.start()
    _wait_for_status(engine, "UPDATING")
    with (
        Publisher(
            [engine.url], timeout_s=30, transport_options={"root": tmp_path / "second"}
        ) as other,
        pytest.raises(PushError, match="HTTP 409: an update to 'drain-new' is already running"),
    ):
        other.push(model, version="intruder")
    pushing.join(60)
    running.join(60)
    assert first
    assert first[0].version == "drain-new"
    choice = completions[0]["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 100
    assert choice["weight_version"] == old_version
    assert [span["version"] for span in choice["weight_versions"]] == [old_version]


# NaN and inf weights: refused before a byte is sent (or, atomic over shm, by the copies while
# the engine stages), and by the engine's verify pass
BAD_TENSOR = "model.norm.weight"


def _with_bad_value(model: torch.nn.Module, value: float, dtype: torch.dtype) -> dict:
    weights = {name: t.detach().to(dtype).clone() for name, t in model.state_dict().items()}
    weights[BAD_TENSOR].view(-1)[3] = value
    return weights


def _served(engine) -> tuple:
    state = weights_state(engine)
    return state["status"], state["version"], state["fingerprint"], engine_greedy(engine)


# (publisher fixture, how its refusal ends): `disk` checks before sending; an atomic `shm` push
# checks in its copy pass, and the engine discards what it staged
REFUSERS = [("publisher", NOTHING_SENT), ("shm_publisher", NOTHING_SERVED)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize(("refuser", "outcome"), REFUSERS, ids=["disk", "shm-in-copy"])
def test_a_nonfinite_push_is_refused_before_anything_is_served(
    engine, hf_model, request, refuser, outcome, dtype, value
):
    _, model = hf_model
    before = _served(engine)
    bad = _with_bad_value(model, value, dtype)
    counts = "1 NaN, 0 inf" if math.isnan(value) else "0 NaN, 1 inf"
    with pytest.raises(NonFiniteWeightsError) as raised:
        request.getfixturevalue(refuser).push(bad, version=f"bad-{refuser}-{value}-{dtype}")
    message = f"non-finite values in 1 tensor(s): {BAD_TENSOR} ({counts}); {outcome}"
    assert message in str(raised.value)
    assert _served(engine) == before  # not paused, same version, fingerprint and output


@pytest.fixture
def nixl_publisher(engine: ServedEngine):
    with Publisher([engine.url], transport="nixl", bucket_bytes=64 * KiB, timeout_s=30) as pub:
        yield pub


# the copies that check NaN/inf as they go, and how each reports its mode
IN_STREAM_CHECKS = [("shm_publisher", "shm direct"), ("nixl_publisher", "nixl")]


@pytest.mark.parametrize(("streaming", "mode"), IN_STREAM_CHECKS, ids=["shm", "nixl"])
def test_a_nan_in_the_last_tensor_copied_leaves_the_engine_unchanged(
    engine, hf_model, request, streaming, mode
):
    _, model = hf_model
    publisher = request.getfixturevalue(streaming)
    before = _served(engine)
    trained = trained_copy(model, seed=34).state_dict()
    weights = {name: t.detach().clone() for name, t in trained.items()}
    last = min(weights, key=lambda name: weights[name].nbytes)
    weights[last] = weights.pop(last)  # last in the plan, and the last copy to start
    weights[last].view(-1)[-1] = float("nan")
    copied = []
    with pytest.raises(NonFiniteWeightsError) as raised:
        publisher.push(weights, version="nan-last", progress=copied.append)
    assert publisher.sink.mode == mode
    assert sum(copied) > 0  # the other tensors reached the engine's staging memory first
    assert f"{last} (1 NaN, 0 inf); {NOTHING_SERVED}" in str(raised.value)
    assert _served(engine) == before


@pytest.mark.parametrize("how", ["in_place", "delta"])
def test_shm_pushes_that_could_serve_part_of_the_version_are_checked_before_sending(
    engine, hf_model, shm_publisher, how
):
    _, model = hf_model
    before = _served(engine)
    bad = _with_bad_value(model, float("nan"), torch.float32)
    push = {"atomic": False, "pause_mode": "in_place"}
    if how == "delta":  # a delta streams encoded bits: its copies cannot judge the weights
        shm_publisher.set_delta_base(model, version=before[1])
        push = {"delta": "always"}
    with pytest.raises(NonFiniteWeightsError) as raised:
        shm_publisher.push(bad, version=f"bad-{how}", **push)
    assert f"{BAD_TENSOR} (1 NaN, 0 inf); {NOTHING_SENT}" in str(raised.value)
    assert _served(engine) == before


def test_allow_nonfinite_lets_it_through_and_a_good_push_recovers(engine, hf_model, publisher):
    _, model = hf_model
    bad = _with_bad_value(trained_copy(model, seed=31), float("nan"), torch.float32)
    result = publisher.push(bad, version="nan-allowed", allow_nonfinite=True)
    assert weights_state(engine)["fingerprint"] == result.fingerprint
    good = trained_copy(model, seed=32)
    result = publisher.push(good, version="after-nan")
    assert weights_state(engine)["fingerprint"] == publisher.fingerprint(good)


def test_the_engine_refuses_nonfinite_bytes_in_its_verify_pass(engine, hf_model, tmp_path):
    _, model = hf_model
    before = _served(engine)
    bad = _with_bad_value(trained_copy(model, seed=33), float("inf"), torch.float32)
    source, _ = _prepared_session(tmp_path, bad, "inf-unchecked")
    answer = _post_update(engine, source, "inf-unchecked")
    assert answer["status"] == 400
    assert f"non-finite values in {BAD_TENSOR} (0 NaN, 1 inf)" in answer["error"]["message"]
    assert answer["names"] == [BAD_TENSOR]
    assert _served(engine) == before
    source, _ = _prepared_session(tmp_path, bad, "inf-allowed")
    allowed = _post_update(engine, source, "inf-allowed", allow_nonfinite=True)
    assert allowed["status"] == 200, allowed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_counts_are_exact_also_when_a_finite_sum_overflows(dtype):
    big = torch.full((4096,), torch.finfo(dtype).max / 2, dtype=dtype)
    assert nonfinite_counts(big) is None  # the sum overflows; the values are finite
    big[[1, 7, 9]] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
    assert nonfinite_counts(big) == (1, 2)
    assert nonfinite_counts(torch.arange(5)) is None  # integers hold no NaN
