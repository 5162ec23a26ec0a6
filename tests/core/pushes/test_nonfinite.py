"""NaN and inf weights: the Publisher refuses them before a byte is sent and the engine's verify
pass refuses them too, unless the push allows them (a real engine, TP 2, `disk`)."""

import math
from pathlib import Path

import pytest
import torch
from update_harness import KiB, engine_greedy, trained_copy, weights_state

from weightbus import Publisher
from weightbus.core.finite import NonFiniteWeightsError, nonfinite_counts
from weightbus.core.publisher import SessionFactory, normalize_weights
from weightbus.core.transport import encode_description, make_sink

# `hf_model` and `engine` (tests/conftest.py): this checkpoint, served at TP 2 in float32
HF_CASE = "qwen2_untied"
BAD_TENSOR = "model.norm.weight"


@pytest.fixture
def publisher(engine, tmp_path: Path):
    with Publisher(
        [engine.url], bucket_bytes=64 * KiB, timeout_s=30, transport_options={"root": tmp_path}
    ) as pub:
        yield pub


def _with_bad_value(model: torch.nn.Module, value: float, dtype: torch.dtype) -> dict:
    weights = {name: t.detach().to(dtype).clone() for name, t in model.state_dict().items()}
    weights[BAD_TENSOR].view(-1)[3] = value
    return weights


def _served(engine) -> tuple:
    state = weights_state(engine)
    return state["status"], state["version"], state["fingerprint"], engine_greedy(engine)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=str)
def test_a_nonfinite_push_is_refused_before_a_byte_is_sent(
    engine, hf_model, publisher, dtype, value
):
    _, model = hf_model
    before = _served(engine)
    bad = _with_bad_value(model, value, dtype)
    counts = "1 NaN, 0 inf" if math.isnan(value) else "0 NaN, 1 inf"
    with pytest.raises(NonFiniteWeightsError) as raised:
        publisher.push(bad, version=f"bad-{value}-{dtype}")
    assert f"non-finite values in 1 tensor(s): {BAD_TENSOR} ({counts}); nothing was sent" in str(
        raised.value
    )
    assert _served(engine) == before


def test_allow_nonfinite_lets_it_through_and_a_good_push_recovers(engine, hf_model, publisher):
    _, model = hf_model
    bad = _with_bad_value(trained_copy(model, seed=31), float("nan"), torch.float32)
    result = publisher.push(bad, version="nan-allowed", allow_nonfinite=True)
    assert weights_state(engine)["fingerprint"] == result.fingerprint
    good = trained_copy(model, seed=32)
    result = publisher.push(good, version="after-nan")
    assert weights_state(engine)["fingerprint"] == publisher.fingerprint(good)


def _post_prepared(engine, tmp_path: Path, weights: dict, version: str, **extra) -> dict:
    """An update whose stream the test wrote itself (no Publisher check before it)."""
    sink = make_sink("disk", root=tmp_path / "manual")
    named = normalize_weights(weights)
    session = SessionFactory(64 * KiB).session(named, version, None)
    source = encode_description(sink.prepare(session, dict(named)))
    body = {"version": version, "transport": "disk", "source": source, "timeout_s": 20, **extra}
    response = engine.client.post("/v1/update_weights", json=body)
    return {"status": response.status_code, **response.json()}


def test_the_engine_refuses_nonfinite_bytes_in_its_verify_pass(engine, hf_model, tmp_path):
    _, model = hf_model
    before = _served(engine)
    bad = _with_bad_value(trained_copy(model, seed=33), float("inf"), torch.float32)
    answer = _post_prepared(engine, tmp_path, bad, "inf-unchecked")
    assert answer["status"] == 400
    assert f"non-finite values in {BAD_TENSOR} (0 NaN, 1 inf)" in answer["error"]["message"]
    assert answer["names"] == [BAD_TENSOR]
    assert _served(engine) == before
    allowed = _post_prepared(engine, tmp_path, bad, "inf-allowed", allow_nonfinite=True)
    assert allowed["status"] == 200, allowed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_counts_are_exact_also_when_a_finite_sum_overflows(dtype):
    big = torch.full((4096,), torch.finfo(dtype).max / 2, dtype=dtype)
    assert nonfinite_counts(big) is None  # the sum overflows; the values are finite
    big[[1, 7, 9]] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
    assert nonfinite_counts(big) == (1, 2)
    assert nonfinite_counts(torch.arange(5)) is None  # integers hold no NaN
