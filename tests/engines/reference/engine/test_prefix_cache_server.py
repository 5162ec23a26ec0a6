"""Prefix caching end to end at TP 2: a GRPO-like group shares its prompt's KV, and a push of
other weights drops it (tokens compared with transformers on each version's weights)."""

import json
import threading
from pathlib import Path

import httpx
import pytest
from engine_harness import ServedEngine, make_hf_model
from prometheus_client.parser import text_string_to_metric_families
from update_harness import hf_greedy

from weightbus import Publisher

# every test starts `weightbus serve` (tiers: tests/conftest.py)
pytestmark = pytest.mark.e2e

CASE = "llama3_rope_kv1"
# 70 tokens (4 whole blocks of 16 can come from the cache), within the model's 128 positions
PROMPT = [(7 * i + 3) % 101 for i in range(70)]
NUM_TOKENS = 12
GROUP = 8


def _complete(url: str) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=120) as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def _group(url: str) -> list[list[int] | None]:
    results: list[list[int] | None] = [None] * GROUP
    barrier = threading.Barrier(GROUP)

    def send(i: int) -> None:
        barrier.wait(timeout=30)  # the group arrives together
        results[i] = _complete(url)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(GROUP)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


def _counts(engine: ServedEngine) -> tuple[float, float]:
    """(queries, hits) of the prefix cache, from `/metrics`."""
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(engine.client.get("/metrics").text)
        for sample in family.samples
    }
    return (
        samples["weightbus_prefix_cache_queries_total"],
        samples["weightbus_prefix_cache_hits_total"],
    )


def test_a_group_shares_its_prompt_and_a_push_drops_it(tmp_path: Path) -> None:
    old = make_hf_model(CASE, tmp_path / "old", seed=0)
    new = make_hf_model(CASE, tmp_path / "new", seed=1)
    old_tokens = hf_greedy(old, PROMPT, NUM_TOKENS)[0]
    new_tokens = hf_greedy(new, PROMPT, NUM_TOKENS)[0]
    assert old_tokens != new_tokens  # else stale KV could pass unseen
    engine = ServedEngine(
        "--model", str(tmp_path / "old"), "--tp", "2", log_path=tmp_path / "serve.log"
    )
    try:
        assert _counts(engine) == (0, 0)
        assert _group(engine.url) == [old_tokens] * GROUP
        queries, hits = _counts(engine)
        assert queries == GROUP * len(PROMPT)
        assert hits >= (GROUP - 1) * 64  # all but the first took 4 blocks from the cache

        with Publisher([engine.url], transport="shm", timeout_s=60) as pub:
            pub.push(new, version="new")
            # the old weights' KV is not reused: transformers' tokens on the new weights
            assert _complete(engine.url) == new_tokens
            assert _counts(engine) == (queries + len(PROMPT), hits)
            # the new weights' own KV is
            assert _complete(engine.url) == new_tokens
            assert _counts(engine) == (queries + 2 * len(PROMPT), hits + 64)
            # a push that keeps the cache keeps it (the KV is the new weights', now stale)
            pub.push(old, version="old-again", keep_prefix_cache=True)
            _complete(engine.url)
            assert _counts(engine)[1] == hits + 128
    finally:
        assert engine.stop() == 0


def _stream_across_a_push(engine: ServedEngine, push) -> list[dict]:
    """A streamed completion frozen after its first token (`pause_generation`) while `push()`
    runs, then resumed: its chunks."""
    body = {"prompt": PROMPT[:8], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    chunks = []
    with (
        httpx.Client(base_url=engine.url, timeout=120) as client,
        client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream,
    ):
        lines = (line for line in stream.iter_lines() if line.startswith("data: {"))
        chunks.append(json.loads(next(lines).removeprefix("data: ")))
        paused = client.post("/v1/pause_generation", json={"mode": "in_place"})
        assert paused.status_code == 200, paused.text
        push()
        assert client.post("/v1/continue_generation", json={}).status_code == 200
        chunks += [json.loads(line.removeprefix("data: ")) for line in lines]
    return [chunk["choices"][0] for chunk in chunks]


def _teacher_forced_greedy(model, ids: list[int]) -> list[int]:
    """transformers' greedy choice after every prefix of `ids`."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return logits.argmax(-1).tolist()


def test_in_place_running_kv_recompute_shows_in_the_stream_and_uses_the_new_weights(
    tmp_path: Path,
) -> None:
    make_hf_model(CASE, tmp_path / "old", seed=0)  # the checkpoint the engine starts from
    new = make_hf_model(CASE, tmp_path / "new", seed=1)
    engine = ServedEngine(
        "--model", str(tmp_path / "old"), "--tp", "2", log_path=tmp_path / "serve.log"
    )
    try:
        with Publisher([engine.url], transport="shm", timeout_s=60) as pub:
            choices = _stream_across_a_push(
                engine,
                lambda: pub.push(new, version="new", pause_mode="in_place", running_kv="recompute"),
            )
    finally:
        assert engine.stop() == 0
    tokens = [c["token_ids"][0] for c in choices if c["token_ids"]]
    versions = [c["weight_version"] for c in choices if c["token_ids"]]
    swap = versions.index("new")
    assert swap > 0, versions
    assert set(versions[swap:]) == {"new"}, versions
    # the first token on the new weights says its KV was recomputed; no other does
    recomputed = [i for i, c in enumerate(choices) if c.get("kv_recomputed")]
    assert recomputed == [swap], choices
    # every token from the swap on is the new model's greedy choice given all before it
    ids = PROMPT[:8] + tokens
    greedy = _teacher_forced_greedy(new, ids)
    assert tokens[swap:] == greedy[len(PROMPT[:8]) + swap - 1 : -1]
    assert choices[-1]["finish_reason"] == "length"
