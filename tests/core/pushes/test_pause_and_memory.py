"""Pause modes keep every request; memory release frees memory; an engine on the tiny model."""

import threading
from pathlib import Path

import pytest
from engine_harness import ServedEngine
from update_harness import weights_state

from weightbus import Publisher
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import random_hf_weights

PROMPT = [5, 6, 7, 8]
# Long enough that the sequences are still running when the push lands, with a wide margin on a
# loaded machine (at 120 tokens a loaded CI run lost the race; max_model_len is 1024).
RUNNING_TOKENS = 400


def _tiny_weights(seed: int) -> list:
    return list(random_hf_weights(tiny_config(), seed))


def _start_completions(engine: ServedEngine, count: int, max_tokens: int) -> tuple[list, list]:
    results: list = []
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(
                engine.complete(
                    prompt=[*PROMPT, i], max_tokens=max_tokens, temperature=0.0, ignore_eos=True
                ).json()
            )
        )
        for i in range(count)
    ]
    for thread in threads:
        thread.start()
    # requests are admitted in order: when a later one-token request is done, all are running
    assert engine.complete(prompt=[1], max_tokens=1).status_code == 200
    return threads, results


def _push(engine: ServedEngine, tmp_path: Path, seed: int, version: str, **kw) -> None:
    with Publisher([engine.url], timeout_s=60, transport_options={"root": tmp_path}) as pub:
        pub.push(_tiny_weights(seed), version=version, **kw)


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in_place_load"])
def test_in_place_update_continues_sequences_and_reports_version_spans(engine, tmp_path, atomic):
    _push(engine, tmp_path, 0, f"before-{atomic}", force=True)
    after = _tiny_weights(1)  # made, and the publisher opened, before the sequences start
    with Publisher([engine.url], timeout_s=60, transport_options={"root": tmp_path}) as pub:
        threads, results = _start_completions(engine, count=4, max_tokens=RUNNING_TOKENS)
        pub.push(after, version=f"after-{atomic}", pause_mode="in_place", atomic=atomic)
    for thread in threads:
        thread.join(60)
    assert len(results) == 4
    for result in results:
        choice = result["choices"][0]
        assert choice["finish_reason"] == "length"
        assert len(choice["token_ids"]) == RUNNING_TOKENS
        spans = choice["weight_versions"]
        assert [s["version"] for s in spans] == [f"before-{atomic}", f"after-{atomic}"]
        assert spans[0]["start"] == 0
        assert spans[0]["end"] == spans[1]["start"]
        assert spans[1]["end"] == RUNNING_TOKENS
        assert choice["weight_version"] == f"after-{atomic}"


def test_abort_mode_ends_running_requests_with_a_reason(engine, tmp_path):
    _push(engine, tmp_path, 0, "abort-before", force=True)
    after = _tiny_weights(2)  # made, and the publisher opened, before the sequences start
    with Publisher([engine.url], timeout_s=60, transport_options={"root": tmp_path}) as pub:
        threads, results = _start_completions(engine, count=3, max_tokens=RUNNING_TOKENS)
        pub.push(after, version="abort-after", pause_mode="abort")
    for thread in threads:
        thread.join(60)
    assert len(results) == 3
    for result in results:
        choice = result["choices"][0]
        assert choice["finish_reason"] == "abort"
        assert choice["abort_reason"] == "weights update to 'abort-after' (pause_mode abort)"
        assert len(choice["token_ids"]) < RUNNING_TOKENS
        assert {s["version"] for s in choice["weight_versions"]} == {"abort-before"}
    after = engine.complete(prompt=PROMPT, max_tokens=3, temperature=0.0).json()
    assert after["choices"][0]["weight_version"] == "abort-after"


def _worker_rss_bytes(engine: ServedEngine) -> int:
    total = 0
    for pid in engine.worker_pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def test_release_weights_frees_memory_and_an_update_brings_them_back(engine, tmp_path):
    _push(engine, tmp_path, 0, "mem-before", force=True)
    expected = engine.complete(prompt=PROMPT, max_tokens=8, temperature=0.0).json()
    rss_before = _worker_rss_bytes(engine)
    released = engine.client.post("/v1/release_memory", json={"tags": ["weights", "kv_cache"]})
    assert released.status_code == 200, released.text
    state = weights_state(engine)
    assert state["status"] == "CLEARED"
    assert state["released"] == ["kv_cache", "weights"]
    # the tiny model's weights are ~12 MiB per TP rank in float32 (both ranks hold half)
    assert rss_before - _worker_rss_bytes(engine) > 8 * 2**20
    refused = engine.complete(prompt=PROMPT, max_tokens=2)
    assert refused.status_code == 503
    assert "memory released" in refused.json()["error"]["message"]

    assert engine.client.post("/v1/resume_memory", json={"tags": ["kv_cache"]}).status_code == 200
    _push(engine, tmp_path, 0, "mem-after")  # into released weights: fresh allocation
    state = weights_state(engine)
    assert state["released"] == ["weights"] or state["status"] == "NORMAL"
    resumed = engine.client.post("/v1/resume_memory", json={"tags": ["weights"]})
    assert resumed.status_code == 200
    assert weights_state(engine)["status"] == "NORMAL"
    again = engine.complete(prompt=PROMPT, max_tokens=8, temperature=0.0).json()
    assert again["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]


def test_pause_and_continue_generation(engine):
    paused = engine.client.post("/v1/pause_generation", json={"mode": "in_place"})
    assert paused.status_code == 200
    assert weights_state(engine)["generation"] == "paused"
    results: list = []
    waiting = threading.Thread(
        target=lambda: results.append(engine.complete(prompt=PROMPT, max_tokens=2))
    )
    waiting.start()
    waiting.join(0.5)
    assert results == []  # queued, not lost
    assert engine.client.post("/v1/continue_generation", json={}).status_code == 200
    waiting.join(30)
    assert results[0].status_code == 200
    assert weights_state(engine)["generation"] == "running"


def test_metrics_count_updates(engine, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    _push(engine, tmp_path, 3, "metrics-1", force=True)
    text = engine.client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    updates = families["weightbus_weight_updates"].samples
    assert any(s.name == "weightbus_weight_updates_total" and s.value >= 1 for s in updates)
    info = families["weightbus_weights_info"].samples
    assert any(s.labels.get("version") == "metrics-1" for s in info)
