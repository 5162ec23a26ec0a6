"""`weightbus bench serving` end to end on a small model: streamed completions run while a
trainer process pushes in each pause mode; no request is lost, every token's version is one
the pushes explain, drain and abort never serve a request across versions, an aborted
request says why; and the report's arithmetic on hand-made timelines."""

import json
import subprocess
import sys

import pytest

from weightbus.apps.bench.serving_load import RequestLog, read_generate_event
from weightbus.apps.bench.serving_pushes import push_figures
from weightbus.apps.bench.serving_report import stall_s, wrong_version_tokens
from weightbus.apps.bench.serving_trainer import PushRecord

MAX_TOKENS = 24
ORDER = ["no pushes", "drain", "in_place", "abort"]


@pytest.mark.e2e  # starts `weightbus serve` and a trainer process (through the bench)
def test_pushes_under_a_streamed_load_lose_no_request_in_any_mode(tmp_path):
    out = tmp_path / "serving.json"
    command = [sys.executable, "-m", "weightbus", "--log-level", "WARNING", "bench", "serving"]
    command += ["--size", "4MiB", "--streams", "4", "--group", "2", "--max-tokens"]
    command += [str(MAX_TOKENS), "--duration-s", "3", "--push-every-s", "1", "--warmup-s", "1"]
    # no prefix-cache row: a second engine's start-up for a ratio (tests/engines/reference/
    # engine/test_prefix_cache_server.py checks the cache itself)
    command += ["--prefix-rounds", "0", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["prefix_cache"] is None
    runs = {run["figures"]["mode"]: run for run in report["runs"]}
    assert list(runs) == ORDER
    start_version = runs["no pushes"]["requests"][0]["token_versions"][0]
    for mode, run in runs.items():
        figures, requests = run["figures"], run["requests"]
        assert figures["lost"] == figures["wrong_version_tokens"] == 0, mode
        assert figures["failed_pushes"] == 0, mode
        # pushes at 1 s and 2 s (a slow first push on a loaded machine may leave one)
        assert (mode == "no pushes") == (not run["pushes"]), mode
        assert figures["requests"] == len(requests) > 0
        start_s, end_s = run["window"]
        received = [t for r in requests for t in r["token_times_s"]]
        assert figures["tokens"] == sum(start_s <= t <= end_s for t in received), mode
        # the per-push breakdown: one row per push, its aborts and swaps those of the run
        per_push = run["per_push"]
        assert [p["version"] for p in per_push] == [p["version"] for p in run["pushes"]]
        assert [p["phases_s"] for p in per_push] == [p["phases"] for p in run["pushes"]]
        assert sum(p["aborted"] for p in per_push) == figures["aborted"], mode
        assert [p["stall_s"] for p in per_push] == figures["stalls_s"], mode
        assert sum(p["spanning"] for p in per_push) >= figures["spanning"], mode
        pushed = [p["version"] for p in run["pushes"]]
        served = set()
        for request in requests:
            assert request["error"] is None, request["error"]
            if request["finish_reason"] == "abort":
                assert mode == "abort", request
                assert "pause_mode abort" in request["abort_reason"], request
            else:  # every streamed token arrived: as many as asked
                assert request["finish_reason"] == "length", request
                assert len(request["token_versions"]) == MAX_TOKENS
            seen = set(request["token_versions"])
            assert len(seen) == 1 or mode == "in_place", (mode, request)
            served |= seen
        # what the run's start served, then what it pushed; in place, pushes land mid-load
        # (a drain or abort push near the run's end may serve no token before it ends)
        assert served <= {start_version, *pushed}, mode
        assert mode != "in_place" or served & set(pushed), mode
        start_version = pushed[-1] if pushed else start_version
    assert runs["abort"]["figures"]["aborted"] > 0


def _log(times: list[float], versions: list[str]) -> RequestLog:
    return RequestLog(0, 0.0, times, versions, "length")


def test_the_stall_is_the_longest_token_gap_that_overlaps_the_push():
    logs = [_log([0.0, 0.1, 0.9, 1.0], ["a"] * 4), _log([0.5, 0.6, 0.7], ["a"] * 3)]
    assert stall_s(logs, 0.2, 0.3) == pytest.approx(0.8)  # inside the gap 0.1 -> 0.9
    assert stall_s(logs, 0.65, 0.66) == pytest.approx(0.8)
    assert stall_s(logs, 2.0, 3.0) == 0.0  # no token gap overlaps it


def test_tokens_the_push_order_does_not_explain_are_counted():
    pushes = [PushRecord("v1", 1.0, 1.2), PushRecord("bad", 1.5, 1.6, error="x")]
    pushes.append(PushRecord("v2", 2.0, 2.2))
    good = _log([0.5, 1.1, 2.5], ["v0", "v1", "v2"])
    assert wrong_version_tokens([good], "v0", pushes) == 0
    before_its_push = _log([0.9], ["v1"])
    going_back = _log([1.3, 1.4], ["v1", "v0"])
    unknown = _log([3.0], ["bad"])
    assert wrong_version_tokens([before_its_push, going_back, unknown], "v0", pushes) == 3


def test_each_push_gets_its_stall_gap_aborts_and_swaps():
    pushes = [PushRecord("v1", 1.0, 1.2, {"commit_s": 0.01}), PushRecord("v2", 2.0, 2.2)]
    spanning = _log([0.9, 1.5, 1.6, 2.5], ["v0", "v1", "v1", "v2"])
    aborted = RequestLog(1, 0.0, [1.85, 1.9], ["v1", "v1"], "abort", "x", ended_s=2.1)
    rows = push_figures([spanning, aborted], pushes, run_start_s=0.5)
    assert [(r.version, r.at_s, r.aborted, r.spanning) for r in rows] == [
        ("v1", 0.5, 0, 1),
        ("v2", 1.5, 1, 1),
    ]
    assert rows[0].stall_s == pytest.approx(0.6)  # 0.9 -> 1.5
    assert rows[0].stall_gap_s == pytest.approx((-0.1, 0.5))
    assert rows[0].first_new_token_s == pytest.approx(0.5)
    assert rows[1].stall_s == pytest.approx(0.9)  # 1.6 -> 2.5
    assert rows[0].phases_s == {"commit_s": 0.01}


def test_vllm_tokens_take_their_versions_from_the_last_chunks_spans():
    log = RequestLog(0, 0.0)
    chunks = [
        {"choices": [{"token_ids": [5, 6], "finish_reason": None}]},
        {"choices": [{"token_ids": [7], "finish_reason": None}]},
        {
            "choices": [
                {
                    "token_ids": [8],
                    "finish_reason": "length",
                    "weight_versions": [
                        {"version": "v1", "start": 0, "end": 3},
                        {"version": "v2", "start": 3, "end": 4},
                    ],
                }
            ]
        },
        {"choices": [], "usage": {"completion_tokens": 4}},
    ]
    for chunk in chunks:
        read_generate_event(log, chunk)
    assert log.token_versions == ["v1", "v1", "v1", "v2"]
    assert len(log.token_times_s) == 4
    assert log.finish_reason == "length"
    unstamped = RequestLog(0, 0.0)
    read_generate_event(unstamped, {"choices": [{"token_ids": [5], "finish_reason": "abort"}]})
    assert unstamped.token_versions == [""]  # a version no push explains: counted as wrong
