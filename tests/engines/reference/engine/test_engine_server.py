"""`weightbus serve` end to end: a real server process, real workers, real HTTP."""

import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from engine_harness import (
    NUM_GREEDY_TOKENS,
    PROMPT,
    ServedEngine,
    children_of,
    hf_reference,
    is_alive,
    make_hf_model,
)

from weightbus.core.transport.parts.shared_memory import ARENA_PREFIX, SHM_DIR

# every test starts `weightbus serve` or another process (tiers: tests/conftest.py)
pytestmark = pytest.mark.e2e


def weightbus_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("weightbus-*")}


@pytest.fixture(scope="module")
def tiny_tp2(tmp_path_factory: pytest.TempPathFactory):
    engine = ServedEngine("--tp", "2", log_path=tmp_path_factory.mktemp("logs") / "tp2.log")
    yield engine
    assert engine.stop() == 0
    assert not [pid for pid in engine.worker_pids if is_alive(pid)]


def test_health_and_models(tiny_tp2: ServedEngine) -> None:
    assert tiny_tp2.client.get("/health").json() == {
        "status": "ok",
        "weight_version": "init",
        "weights_status": "NORMAL",
        "generation": "running",
        "waiting_for_initial_weights": False,
        "rollback_version": None,
    }
    models = tiny_tp2.client.get("/v1/models").json()
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("tiny", 1024)]
    assert len(tiny_tp2.worker_pids) == 2


def test_text_and_token_prompts(tiny_tp2: ServedEngine) -> None:
    body = tiny_tp2.complete(prompt=["Hello", [256, 72, 101]], max_tokens=5, temperature=0)
    assert body.status_code == 200, body.text
    result = body.json()
    choices = result["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    # the byte-level tokenizer of `tiny` prefixes BOS (256): "Hello" is [256, 72, 101, 108, ...]
    assert result["usage"] == {"prompt_tokens": 6 + 3, "completion_tokens": 10, "total_tokens": 19}
    for choice in choices:
        assert len(choice["token_ids"]) == 5
        assert choice["finish_reason"] == "length"
        assert choice["weight_version"] == "init"
        assert choice["text"] == bytes(t for t in choice["token_ids"] if t < 256).decode(
            errors="replace"
        )


def test_logprobs(tiny_tp2: ServedEngine) -> None:
    choice = tiny_tp2.complete(prompt=[1, 2, 3], max_tokens=4, temperature=0, logprobs=3).json()[
        "choices"
    ][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4
    rows = zip(
        choice["token_ids"],
        logprobs["token_logprobs"],
        logprobs["top_logprobs"],
        logprobs["top_token_ids"],
        logprobs["top_token_logprobs"],
        strict=True,
    )
    for token_id, chosen, top_by_text, top_ids, top_lps in rows:
        assert chosen <= 0
        # greedy picks the most likely token; alternatives come best first
        assert (top_ids[0], top_lps[0]) == (token_id, chosen)
        assert len(top_ids) == 3
        assert top_lps == sorted(top_lps, reverse=True)
        assert max(top_by_text.values()) == chosen  # several ids may decode to one text


def test_seeded_sampling_repeats(tiny_tp2: ServedEngine) -> None:
    def run(seed: int) -> list[int]:
        body = {"prompt": [5, 6], "max_tokens": 8, "temperature": 1.0, "top_p": 0.9}
        return tiny_tp2.complete(**body, seed=seed).json()["choices"][0]["token_ids"]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_stop_string_truncates(tiny_tp2: ServedEngine) -> None:
    prompt = "The quick brown fox"
    full = tiny_tp2.complete(prompt=prompt, max_tokens=40, temperature=0, ignore_eos=True).json()
    text = full["choices"][0]["text"]
    # the random model writes mostly non-ASCII bytes: stop at its first ASCII letter after
    # the first character
    match = re.search(r"[A-Za-z]", text[1:])
    assert match is not None, text
    stop = match.group(0)
    cut = tiny_tp2.complete(prompt=prompt, max_tokens=40, temperature=0, stop=["@@", stop]).json()
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == text[: text.index(stop)]
    assert choice["token_ids"] == full["choices"][0]["token_ids"][: len(choice["token_ids"])]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "x", "temperature": 3.0}, "temperature"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "top_p": 0.0}, "top_p"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": [], "max_tokens": 1}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"max_tokens": 3}, "prompt"),
        # values of another JSON type are not coerced
        ({"prompt": [True, 2]}, "prompt"),
        ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
        ({"prompt": "x", "temperature": False}, "temperature"),
        ({"prompt": "x", "seed": False}, "seed"),
        ({"prompt": "x", "max_tokens": 4.0}, "max_tokens"),
        ({"prompt": "x", "n": True}, "n"),
        ({"prompt": "x", "stream": 0}, "stream"),
        # text no tokenizer can encode
        ({"prompt": "\ud800"}, "prompt"),
        ({"prompt": "x", "stop": "\udfff"}, "stop"),
    ],
)
def test_invalid_fields_are_422_naming_the_field(
    tiny_tp2: ServedEngine, body: dict, field: str
) -> None:
    # ensure_ascii: lone surrogates travel as JSON escapes, as any client may send them
    content = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    response = tiny_tp2.client.post("/v1/completions", content=content, headers=headers)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert f"invalid field '{field}'" in error["message"]


def test_over_context_length_is_400(tiny_tp2: ServedEngine) -> None:
    response = tiny_tp2.complete(prompt=[7] * 1000, max_tokens=25)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "maximum context length is 1024 tokens" in error["message"]
    assert error["param"] == "max_tokens"
    response = tiny_tp2.complete(prompt=[7] * 1024, max_tokens=1)
    assert (response.status_code, response.json()["error"]["param"]) == (400, "prompt")
    response = tiny_tp2.complete(prompt=[512], max_tokens=1)
    assert response.status_code == 400
    assert "vocab_size 512" in response.json()["error"]["message"]
    assert tiny_tp2.complete(prompt="ok", model="other").status_code == 404


def test_32_concurrent_requests_equal_their_solo_runs(tiny_tp2: ServedEngine) -> None:
    rng = random.Random(0)
    lengths = [1, 3, 17, 60, 150, 300]
    requests = [
        {
            "prompt": [rng.randrange(256) for _ in range(rng.choice(lengths))],
            "max_tokens": rng.randrange(4, 17),
            "temperature": 0,
            "logprobs": 2,
        }
        for _ in range(32)
    ]
    solo = [tiny_tp2.complete(**r).json()["choices"][0] for r in requests]
    # Batching changes float32 rounding (~1e-6: matmul kernels depend on the row count).
    # Greedy choices stay identical because the tiny model's best token always leads the
    # second by far more; check that premise so a failure here is never a near tie.
    gaps = [top[0] - top[1] for choice in solo for top in choice["logprobs"]["top_token_logprobs"]]
    assert min(gaps) > 1e-3

    results: list[dict | None] = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def send(i: int) -> None:
        with httpx.Client(base_url=tiny_tp2.url, timeout=120) as client:
            barrier.wait(timeout=30)  # all 32 in flight together
            results[i] = client.post("/v1/completions", json=requests[i]).json()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for i, result in enumerate(results):
        assert result is not None, f"request {i} did not complete"
        choice = result["choices"][0]
        assert choice["token_ids"] == solo[i]["token_ids"], f"request {i}"
        assert choice["finish_reason"] == solo[i]["finish_reason"]


def test_hf_directory_tp2_greedy_matches_transformers(tmp_path: Path) -> None:
    model = make_hf_model("llama3_rope_kv1", tmp_path / "model")
    _, hf_tokens = hf_reference(model)
    engine = ServedEngine(
        "--model", str(tmp_path / "model"), "--tp", "2", log_path=tmp_path / "serve.log"
    )
    try:
        response = engine.complete(prompt=PROMPT, max_tokens=NUM_GREEDY_TOKENS, temperature=0)
        assert response.json()["choices"][0]["token_ids"] == hf_tokens
        assert engine.client.get("/v1/models").json()["data"][0]["id"] == "model"
    finally:
        assert engine.stop() == 0


def test_tokenizer_json_is_used(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    model_dir = tmp_path / "qwen"
    model = make_hf_model("qwen2_untied", model_dir)
    vocab = {f"w{i}": i for i in range(101)} | {"[UNK]": 100}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    words = " ".join(f"w{i}" for i in PROMPT)
    _, hf_tokens = hf_reference(model)  # of PROMPT, which `words` encodes to
    engine = ServedEngine("--model", str(model_dir), log_path=tmp_path / "serve.log")
    try:
        body = engine.complete(prompt=words, max_tokens=NUM_GREEDY_TOKENS, temperature=0).json()
        choice = body["choices"][0]
        assert body["usage"]["prompt_tokens"] == len(PROMPT)
        assert choice["token_ids"] == hf_tokens
        assert choice["text"] == tokenizer.decode(hf_tokens)
    finally:
        assert engine.stop() == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_everything(tmp_path: Path, sig: signal.Signals) -> None:
    before = weightbus_dirs()
    engine = ServedEngine("--tp", "2", log_path=tmp_path / "serve.log")
    assert engine.complete(prompt="hi", max_tokens=2).status_code == 200
    workers = engine.worker_pids
    assert len(workers) == 2
    assert all(is_alive(pid) for pid in workers)
    arenas = [path for pid in workers for path in SHM_DIR.glob(f"{ARENA_PREFIX}{pid}-*")]
    assert len(arenas) == 2, "each rank keeps its parameters in a shared-memory arena"
    assert engine.stop(sig) == 0
    assert not [pid for pid in workers if is_alive(pid)], "orphan worker"
    assert weightbus_dirs() <= before, "socket directory left behind"
    assert not [path for path in arenas if path.exists()], "parameter arena left behind"


# An intermediate parent: runs the server command it is given and waits for it.
RUN_AS_PARENT = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def _wait_for_exits(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := [pid for pid in pids if is_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def test_exit_with_parent_stops_everything_when_the_parent_is_killed(tmp_path: Path) -> None:
    parent = ServedEngine(
        "--tp", "2", log_path=tmp_path / "serve.log", prefix=(sys.executable, "-c", RUN_AS_PARENT)
    )
    [server_pid] = parent.worker_pids  # the harness's "workers" are the parent's children
    workers = children_of(server_pid)
    arenas = [path for pid in workers for path in SHM_DIR.glob(f"{ARENA_PREFIX}{pid}-*")]
    assert len(workers) == 2
    assert len(arenas) == 2
    try:
        parent.proc.kill()
        parent.proc.wait(timeout=10)
        assert not _wait_for_exits([server_pid, *workers], timeout_s=60), "orphaned engine"
    finally:
        parent.stop()
        for pid in [server_pid, *workers]:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert f"parent process {parent.proc.pid} exited: stopping" in parent.log_path.read_text()
    assert not [path for path in arenas if path.exists()], "parameter arena left behind"


def test_worker_death_stops_the_server(tmp_path: Path) -> None:
    engine = ServedEngine("--tp", "2", log_path=tmp_path / "serve.log")
    workers = engine.worker_pids
    try:
        os.kill(workers[1], signal.SIGKILL)
        assert engine.proc.wait(timeout=60) == 1
    finally:
        engine.stop()
    assert not [pid for pid in workers if is_alive(pid)], "orphan worker"
    assert "worker rank 1 exited with code -9" in engine.log_path.read_text()
