"""`hf_dir`: reloading a Hugging Face checkpoint directory into a real TP-2 engine."""

import pytest
import torch
from engine_harness import ServedEngine
from update_harness import KiB, engine_greedy, hf_greedy, trained_copy, weights_state

from weightbus import Publisher

# `hf_model` and `engine` (tests/conftest.py): this checkpoint, served at TP 2
HF_CASE = "llama_tied_bias_sharded"
# float32 engine vs transformers: TP-2 partial sums round differently at ~1e-6 (see e2e tests)
LOGPROB_ATOL = 1e-4


def _update(engine: ServedEngine, source: dict, version: str) -> dict:
    body = {"version": version, "transport": "hf_dir", "source": source, "timeout_s": 30}
    response = engine.client.post("/v1/update_weights", json=body)
    return {"status": response.status_code, **response.json()}


def _assert_serves(engine: ServedEngine, model: torch.nn.Module) -> None:
    tokens, logprobs = hf_greedy(model)
    choice = engine_greedy(engine)
    assert choice["token_ids"] == tokens
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=LOGPROB_ATOL)


def test_publisher_push_over_hf_dir_serves_the_trained_weights(engine, hf_model):
    _, model = hf_model
    trained = trained_copy(model, seed=11)
    with Publisher([engine.url], transport="hf_dir", bucket_bytes=64 * KiB, timeout_s=30) as pub:
        result = pub.push(trained, version="hf-dir-push")
        assert result.fingerprint == pub.fingerprint(trained)
    state = weights_state(engine)
    assert (state["version"], state["fingerprint"]) == ("hf-dir-push", result.fingerprint)
    _assert_serves(engine, trained)


def test_reloading_a_checkpoint_directory_like_update_weights_from_disk(engine, hf_model, tmp_path):
    _, model = hf_model
    trained = trained_copy(model, seed=12)
    trained.save_pretrained(tmp_path, max_shard_size="40KB")  # several files and an index
    answer = _update(engine, {"path": str(tmp_path), "version": "ckpt-12"}, "ckpt-12")
    assert answer["status"] == 200, answer
    with Publisher([engine.url]) as pub:  # the fingerprint a trainer holding it computes
        assert answer["fingerprint"] == pub.fingerprint(trained)
    assert weights_state(engine)["fingerprint"] == answer["fingerprint"]
    _assert_serves(engine, trained)


def test_missing_directory_is_400_and_nothing_changes(engine, tmp_path):
    before = weights_state(engine)
    answer = _update(engine, {"path": str(tmp_path / "nowhere"), "version": "ghost"}, "ghost")
    assert answer["status"] == 400
    assert "no *.safetensors file in" in answer["error"]["message"]
    after = weights_state(engine)
    assert (after["version"], after["fingerprint"]) == (before["version"], before["fingerprint"])


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"path": "/x"}, "hf_dir source: Object missing required field `version`"),
        ({"path": 3, "version": "v"}, "Expected `str`, got `int` - at `source.path`"),
        ({"path": "/x", "version": "v", "shards": 2}, "unknown field `shards`"),
    ],
    ids=["missing", "wrong type", "unknown"],
)
def test_malformed_description_is_422_naming_the_field(engine, source, message):
    # the transport's typed description is decoded at the HTTP edge: nothing reaches the ranks
    before = weights_state(engine)
    answer = _update(engine, source, "malformed")
    assert answer["status"] == 422
    assert message in answer["error"]["message"]
    after = weights_state(engine)
    assert (after["version"], after["fingerprint"]) == (before["version"], before["fingerprint"])
