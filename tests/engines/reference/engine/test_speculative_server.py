"""`weightbus serve --draft-model tiny --num-speculative-tokens 3` end to end, TP 1 and TP 2.

Greedy completions of an engine with a draft must be token-identical to those of the same
engine without one, whatever the draft: the draft only changes how many tokens a step brings.
A draft with the model's own weights (`--draft-seed 0`, the model's seed) has every greedy
proposal accepted; a random one (`--draft-seed 1`) few.
"""

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from engine_harness import ServedEngine
from prometheus_client.parser import text_string_to_metric_families

# every test starts `weightbus serve` (tiers: tests/conftest.py)
pytestmark = pytest.mark.e2e

NUM_SPECULATIVE_TOKENS = 3
# prompts of different lengths; max_tokens not a multiple of a full step (K + 1 tokens)
GREEDY_REQUESTS = [
    {"prompt": "Hello", "max_tokens": 11},
    {"prompt": [[256, 5, 6], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], "max_tokens": 9},
    {"prompt": [256, 100, 200], "max_tokens": 2},
    {"prompt": [256, 42], "max_tokens": 7, "logprobs": 2},
]


def _start(tp: int, log_dir: Path, *draft_args: str) -> ServedEngine:
    name = "-".join(["tp", str(tp), *draft_args]).replace("--", "")
    return ServedEngine("--tp", str(tp), *draft_args, log_path=log_dir / f"{name}.log")


def _draft_args(draft_seed: int) -> tuple[str, ...]:
    return (
        "--draft-model",
        "tiny",
        "--draft-seed",
        str(draft_seed),
        "--num-speculative-tokens",
        str(NUM_SPECULATIVE_TOKENS),
    )


def _greedy(engine: ServedEngine, body: dict) -> list[dict]:
    response = engine.complete(**body, temperature=0, ignore_eos=True)
    assert response.status_code == 200, response.text
    return response.json()["choices"]


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def tp(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def reference(tp: int, log_dir: Path) -> list[list[dict]]:
    """Choices of GREEDY_REQUESTS from an engine without a draft."""
    engine = _start(tp, log_dir)
    try:
        return [_greedy(engine, body) for body in GREEDY_REQUESTS]
    finally:
        assert engine.stop() == 0


@pytest.fixture(scope="module", params=[0, 1], ids=["same_draft", "random_draft"])
def draft_seed(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture(scope="module")
def engine(tp: int, draft_seed: int, log_dir: Path) -> Iterator[ServedEngine]:
    engine = _start(tp, log_dir, *_draft_args(draft_seed))
    yield engine
    assert engine.stop() == 0


def spec_metrics(engine: ServedEngine) -> dict[str, float]:
    text = engine.client.get("/metrics").text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("weightbus_spec_")
    }


def _assert_same_choices(got: list[dict], expected: list[dict]) -> None:
    for choice, ref in zip(got, expected, strict=True):
        assert choice["token_ids"] == ref["token_ids"]
        assert choice["finish_reason"] == ref["finish_reason"] == "length"
        if ref["logprobs"] is None:
            continue
        logprobs, ref_logprobs = choice["logprobs"], ref["logprobs"]
        # the model's logprobs; one pass over several tokens rounds differently than one token
        assert logprobs["token_logprobs"] == pytest.approx(ref_logprobs["token_logprobs"], abs=1e-4)
        assert logprobs["top_token_ids"] == ref_logprobs["top_token_ids"]


def test_greedy_matches_an_engine_without_draft(
    engine: ServedEngine, draft_seed: int, reference: list[list[dict]]
) -> None:
    before = spec_metrics(engine)
    for body, expected in zip(GREEDY_REQUESTS, reference, strict=True):
        _assert_same_choices(_greedy(engine, body), expected)
    after = spec_metrics(engine)
    num_draft = (
        after["weightbus_spec_draft_tokens_total"] - before["weightbus_spec_draft_tokens_total"]
    )
    num_accepted = (
        after["weightbus_spec_accepted_tokens_total"]
        - before["weightbus_spec_accepted_tokens_total"]
    )
    assert num_draft > 0
    if draft_seed == 0:  # the model's own weights: every proposal is its argmax
        assert num_accepted == num_draft
        assert after["weightbus_spec_acceptance_rate"] == 1.0
    else:
        assert 0 <= num_accepted < num_draft
        assert after["weightbus_spec_acceptance_rate"] < 1.0


def test_concurrent_requests_match(engine: ServedEngine, reference: list[list[dict]]) -> None:
    # requests arrive while others decode: steps with a prefill run plainly, then speculate
    results: dict[int, list[dict]] = {}

    def run(index: int) -> None:
        with httpx.Client(base_url=engine.url, timeout=120.0) as client:
            body = {**GREEDY_REQUESTS[index], "temperature": 0, "ignore_eos": True}
            response = client.post("/v1/completions", json=body)
            results[index] = response.json()["choices"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(GREEDY_REQUESTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    for index, expected in enumerate(reference):
        _assert_same_choices(results[index], expected)


def test_seeded_sampling(engine: ServedEngine) -> None:
    def run(seed: int) -> list[int]:
        body = {"prompt": [256, 5, 6], "max_tokens": 10, "temperature": 1.0, "top_p": 0.9}
        response = engine.complete(**body, seed=seed, ignore_eos=True, logprobs=1)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
        assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
        return choice["token_ids"]

    first = run(1)
    assert first == run(1)
    assert first != run(2)
    assert len(first) == 10
    assert all(0 <= t < 512 for t in first)  # tiny's vocabulary
