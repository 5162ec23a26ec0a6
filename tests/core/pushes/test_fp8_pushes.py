"""Block-FP8 pushes into a reference engine at TP 2 serving FP8 (`--quantization fp8-block`):
the Publisher quantizes in the push (`quantize="fp8-block"`), the wire carries the fp8
matrices and their scales, and the engine computes what transformers computes on the
dequantized weights, over each transport, atomic and in place, as a delta; a corrupted scale
fails closed, NaN is refused before quantizing, unquantized weights are refused by name."""

import copy
from pathlib import Path

import pytest
import torch
from engine_harness import PROMPT, ServedEngine, fp8_block_llama
from sharded_harness import run_trainers
from update_harness import (
    ByteFlippingTarget,
    engine_greedy,
    hf_greedy,
    trained_copy,
    weights_state,
)
from weightbus.core.sharded.holdings import holdings_of
from weightbus.core.sharded.quantize import quantized_holdings

from weightbus import Publisher, PushError
from weightbus.core.finite import NonFiniteWeightsError
from weightbus.core.fp8 import Fp8Block, dequantized_state, quantize, quantize_weights
from weightbus.core.publisher.probe import LogprobProbe
from weightbus.core.publisher.targets import HttpEngineTarget
from weightbus.core.sharded import DeclaredShard
from weightbus.core.weights import normalize_weights

# float32 engine vs transformers on the same (dequantized) weights, as test_update_e2e.py
LOGPROB_ATOL = 1e-4
BLOCK = Fp8Block()


def _hf_model(path: Path) -> torch.nn.Module:
    model = fp8_block_llama()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("fp8")
    return path, _hf_model(path)


@pytest.fixture(scope="module")
def engine(hf_model, tmp_path_factory):
    path, _ = hf_model
    log = tmp_path_factory.mktemp("log") / "serve.log"
    served = ServedEngine(
        "--model", str(path), "--tp", "2", "--quantization", "fp8-block", log_path=log
    )
    yield served
    served.stop()


@pytest.fixture(scope="module")
def tp1(engine, hf_model, tmp_path_factory):
    """A TP-1 engine on the same checkpoint, for two-phase fleet pushes (used with `engine`)."""
    path, _ = hf_model
    log = tmp_path_factory.mktemp("log") / "serve-tp1.log"
    served = ServedEngine("--model", str(path), "--quantization", "fp8-block", log_path=log)
    yield served
    served.stop()


def served_as(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with the weights an FP8 engine serves after a push of it."""
    fake = copy.deepcopy(model)
    fake.load_state_dict(dequantized_state(normalize_weights(model), BLOCK))
    return fake


def assert_serves(engine: ServedEngine, model: torch.nn.Module, version: str) -> None:
    tokens, logprobs = hf_greedy(served_as(model))
    choice = engine_greedy(engine)
    assert (choice["weight_version"], choice["token_ids"]) == (version, tokens)
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=LOGPROB_ATOL)


def test_the_engine_quantizes_its_checkpoint_as_a_push_does(engine, hf_model):
    _, model = hf_model
    with Publisher([engine.url], transport="shm", quantize="fp8-block") as publisher:
        assert weights_state(engine)["fingerprint"] == publisher.fingerprint(model)
    assert_serves(engine, model, "init")


@pytest.mark.parametrize(
    ("transport", "atomic"),
    [("shm", True), ("shm", False), ("disk", True), ("nixl", True)],
    ids=["shm-atomic", "shm-in-place", "disk", "nixl"],
)
def test_fp8_pushes_serve_what_transformers_serves_on_the_dequantized_weights(
    engine, tp1, hf_model, tmp_path, transport, atomic
):
    """A fleet of a TP-2 and a TP-1 FP8 engine: atomic pushes are two-phase."""
    _, model = hf_model
    options = {"root": tmp_path} if transport == "disk" else None
    step = max(weights_state(e)["step"] or 0 for e in (engine, tp1))
    with Publisher(
        [engine.url, tp1.url], transport=transport, transport_options=options,
        quantize="fp8-block",
    ) as publisher:  # fmt: skip
        trained = trained_copy(model, seed=step + 1)
        version = f"fp8-{transport}-{step + 1}"
        result = publisher.push(trained, version=version, step=step + 1, atomic=atomic)
    assert (result.quantization, result.two_phase) == ("fp8-block 128x128", atomic)
    assert [e.fingerprint for e in result.engines] == [result.fingerprint] * 2
    dense_bytes = sum(t.nbytes for _, t in normalize_weights(trained))
    assert result.nbytes < 0.5 * dense_bytes  # float32 here: fp8 matrices are a quarter
    assert_serves(engine, trained, version)
    assert_serves(tp1, trained, version)


def test_a_delta_between_two_fp8_versions_lands_bit_exactly(engine, hf_model):
    _, model = hf_model
    step = weights_state(engine)["step"] or 0
    base = trained_copy(model, seed=20)
    small = trained_copy(base, seed=21, lr=1e-4)
    with Publisher([engine.url], transport="shm", delta="always", quantize=BLOCK) as publisher:
        publisher.push(base, version="fp8-base", step=step + 1)
        result = publisher.push(small, version="fp8-delta", step=step + 2)
        assert result.delta.sent, result.delta
        assert result.delta.stream_bytes < result.delta.full_bytes
        assert weights_state(engine)["fingerprint"] == publisher.fingerprint(small)
    assert_serves(engine, small, "fp8-delta")


def test_fsdp2_ranks_quantize_their_own_shards_into_what_a_publisher_sends(
    engine, hf_model, tmp_path
):
    path, _ = hf_model
    step = weights_state(engine)["step"] or 0
    for transport in ("shm", "nixl"):
        actions = [
            {"kind": "train", "steps": 1},
            {"kind": "push", "version": f"fp8-fsdp-{transport}", "transport": transport,
             "quantize": "fp8-block", "save": True, "options": {"step": step + 1}},
        ]  # fmt: skip
        records = run_trainers(2, str(path), [engine.url], actions, tmp_path / transport)
        assert all(r[0]["ok"] for r in records), records
        gathered = torch.load(tmp_path / transport / f"fp8-fsdp-{transport}.pt")
        with Publisher([engine.url], quantize="fp8-block") as publisher:
            expected = publisher.fingerprint(gathered)
        # every block quantized on the rank holding it: the whole model's quantization
        assert {r[0]["fingerprint"] for r in records} == {expected}
        assert {r[0]["quantization"] for r in records} == {"fp8-block 128x128"}
        assert weights_state(engine)["fingerprint"] == expected
        step += 1
    trained = copy.deepcopy(hf_model[1])
    trained.load_state_dict(gathered)
    assert_serves(engine, trained, "fp8-fsdp-nixl")


def test_a_shard_off_block_edges_is_refused_naming_the_tensor():
    name = "model.layers.0.mlp.up_proj.weight"
    held, _ = holdings_of({name: DeclaredShard(torch.ones(100, 256), (200, 256), (100, 0))})
    with pytest.raises(ValueError, match="not whole 128x128 blocks") as refused:
        quantized_holdings(held, BLOCK)
    assert str(refused.value) == (
        f"fp8-block: tensor {name!r}: this rank holds rows 100:200 and columns 0:256 of "
        "(200, 256), not whole 128x128 blocks: each rank quantizes its own shard, so shards "
        "must split on block edges (or push the gathered model from one process)"
    )
    # a shard on block edges quantizes into exactly its part of the whole matrix's
    full = torch.randn(256, 300)
    whole_fp8, whole_scales = quantize(name, full, BLOCK)
    part = quantized_holdings(
        holdings_of({name: DeclaredShard(full[128:].clone(), (256, 300), (128, 0))})[0], BLOCK
    )
    fp8, scales = (holding.local for holding in part)
    assert torch.equal(fp8.view(torch.uint8), whole_fp8[128:].reshape(-1).view(torch.uint8))
    assert torch.equal(scales, whole_scales[1:].reshape(-1))


def test_a_probe_passes_a_good_fp8_push_and_rolls_back_one_with_misplaced_scales(engine, hf_model):
    _, model = hf_model
    step = weights_state(engine)["step"] or 0
    good = trained_copy(model, seed=40)
    probe = LogprobProbe.of_quantized_model(good, PROMPT, BLOCK)
    assert 1e-4 < probe.tolerance < 0.1  # a tenth of what quantizing does to these logprobs
    with Publisher([engine.url], transport="shm", quantize=BLOCK) as publisher:
        publisher.push(good, version="fp8-probed", step=step + 1, probe=probe)
    # the engine's teacher-forced logprobs (`prompt_logprobs`) are transformers' on the
    # dequantized weights, to float32 rounding
    target = HttpEngineTarget(engine.url)
    assert target.score(PROMPT) == pytest.approx(probe.logprobs, abs=LOGPROB_ATOL)
    target.close()
    # the fault: a matrix whose blocks differ in scale (its first 128 rows 8x the rest), its
    # scales loaded into the wrong blocks (their rows swapped); the bytes verify
    bad = trained_copy(model, seed=41)
    name = "model.layers.0.mlp.down_proj.weight"
    with torch.no_grad():
        dict(bad.named_parameters())[name][:128] *= 8
    served = dict(quantize_weights(normalize_weights(bad), BLOCK))
    served[name + "_scale_inv"] = served[name + "_scale_inv"].flip(0).contiguous()
    probe = LogprobProbe.of_quantized_model(bad, PROMPT, BLOCK)
    with (
        Publisher([engine.url], transport="shm") as publisher,  # sends the tensors as given
        pytest.raises(PushError) as failed,
    ):
        publisher.push(served, version="fp8-misplaced", step=step + 2, probe=probe)
    reason = failed.value.failures[engine.url]
    assert "logprob probe failed after loading 'fp8-misplaced': engine and trainer differ" in reason
    assert reason.endswith("rolled back to 'fp8-probed'"), reason
    assert_serves(engine, good, "fp8-probed")


SCALE = "model.layers.1.mlp.down_proj.weight_scale_inv"


def _serving(engine):
    return weights_state(engine)["fingerprint"], engine_greedy(engine)


def test_a_corrupted_scale_fails_closed(engine, hf_model, tmp_path):
    _, model = hf_model
    before = _serving(engine)
    target = ByteFlippingTarget(engine.url, SCALE)
    with (
        Publisher(
            [target], transport="disk", transport_options={"root": tmp_path}, quantize="fp8-block"
        ) as publisher,
        pytest.raises(PushError) as failed,
    ):
        publisher.push(trained_copy(model, seed=30), version="fp8-corrupted", force=True)
    reason = failed.value.failures[engine.url]
    assert f"digest mismatch for tensor '{SCALE}'" in reason, reason
    assert _serving(engine) == before


def test_nan_is_refused_before_quantizing_and_unquantized_weights_by_name(engine, hf_model):
    _, model = hf_model
    before = _serving(engine)
    broken = trained_copy(model, seed=31)
    name = "model.layers.0.self_attn.o_proj.weight"
    with torch.no_grad():
        dict(broken.named_parameters())[name][5, 7] = float("nan")
    nan = f"fp8-block: {name} \\(1 NaN, 0 inf\\)"
    with (
        Publisher([engine.url], transport="shm", quantize="fp8-block") as publisher,
        pytest.raises(NonFiniteWeightsError, match=nan),
    ):
        publisher.push(broken, version="fp8-nan", force=True)
    with (
        Publisher([engine.url], transport="shm") as publisher,  # no quantize
        pytest.raises(PushError) as refused,
    ):
        publisher.push(trained_copy(model, seed=32), version="fp8-missing", force=True)
    reason = refused.value.failures[engine.url]
    # the cause leads, before the 14 scales it lacks
    assert reason.startswith(
        "HTTP 400: rank 0: this engine serves 14 tensors in float8 (block FP8, with their "
        "weight_scale_inv scales) that the push sends unquantized: push with "
        "Publisher(quantize='fp8-block') (docs/fp8.md); rank 0: missing tensors: "
    ), reason
    assert f"tensor '{name}': expected float8_e4m3fn[256, 256], got float32[256, 256]" in reason
    assert _serving(engine) == before
