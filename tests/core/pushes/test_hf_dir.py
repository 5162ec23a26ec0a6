"""`hf_dir`: reloading a Hugging Face checkpoint directory into a real TP-2 engine."""

import copy
import re

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


def _clone(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict cloned tensor by tensor: the tied head no longer shares memory."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_a_tied_model_its_state_dict_a_deepcopy_and_a_clone_have_one_fingerprint(hf_model):
    _, model = hf_model
    trained = trained_copy(model, seed=13)
    with Publisher(["http://127.0.0.1:9"]) as pub:  # fingerprints are computed locally
        prints = {
            pub.fingerprint(weights)
            for weights in (trained, trained.state_dict(), copy.deepcopy(trained.state_dict()))
        }
        prints.add(pub.fingerprint(_clone(trained)))
    assert len(prints) == 1


def test_a_clone_is_a_delta_base_and_pushes_into_the_tied_engine(engine, hf_model):
    _, model = hf_model
    start = trained_copy(model, seed=14)
    with Publisher([engine.url], transport="disk", bucket_bytes=64 * KiB, delta="always") as pub:
        pub.push(_clone(start), version="tied-clone-0", force=True)
        pub.set_delta_base(_clone(start), version="tied-clone-0")
        nxt = trained_copy(start, seed=15)
        result = pub.push(_clone(nxt), version="tied-clone-1")
        assert result.delta.sent, result.delta.reason
        assert result.fingerprint == pub.fingerprint(nxt)
    assert weights_state(engine)["fingerprint"] == result.fingerprint
    _assert_serves(engine, nxt)


def test_a_module_tying_its_head_that_holds_another_one_is_refused_naming_both(hf_model):
    _, model = hf_model
    untied = copy.deepcopy(model)
    assert untied.config.tie_word_embeddings
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach() + 1)
    message = (
        "'lm_head.weight' differs from 'model.embed_tokens.weight', but the model's config ties "
        "them (tie_word_embeddings): untie the config or the tensors"
    )
    with (
        Publisher(["http://127.0.0.1:9"]) as pub,
        pytest.raises(ValueError, match=re.escape(message)),
    ):
        pub.fingerprint(untied)
