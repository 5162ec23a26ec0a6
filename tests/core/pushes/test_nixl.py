"""`nixl` into real engines: one-sided writes of each rank's slices, across network namespaces
(UCX over TCP on a veth link, as between hosts) and on one host; a link cut mid-push; engines
joining and leaving with nothing to re-form; an engine that cannot take writes."""

from pathlib import Path

import pytest
from engine_harness import ServedEngine, started_together, stopped_together
from netns_harness import CutLinkAfterFirstBucket, Namespaces, link_up
from update_harness import KiB, engine_greedy, hf_greedy, trained_copy, weights_state

from weightbus import Publisher, PushError
from weightbus.core.transport.nixl.source import NO_MEMORY
from weightbus.core.transport.parts.shared_memory import ARENA_PREFIX
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import random_hf_weights

HF_CASE = "qwen2_untied"  # `hf_model` (tests/conftest.py)
LOGPROB_ATOL = 1e-4  # as in test_update_e2e.py: float32 engine vs transformers
BUCKET_BYTES = 64 * KiB
TOKEN = "nixl-test-token"


def _weights(seed: int) -> list:
    return list(random_hf_weights(tiny_config(), seed))


def _in_namespace(ns: Namespaces, tmp_path: Path, name: str, *args: str) -> ServedEngine:
    """An engine in `ns` whose UCX uses TCP only, as between two hosts (on the data link: the
    interface that reaches the publisher's `host`)."""
    ucx = ("env", "UCX_TLS=tcp")
    return ServedEngine(
        "--host", ns.engine_control_host, "--api-token", TOKEN, *args,
        log_path=tmp_path / f"{name}.log",
        prefix=("ip", "netns", "exec", ns.name, *ucx),
        token=TOKEN,
    )  # fmt: skip


def _across(ns: Namespaces, engines: list[ServedEngine], timeout_s: float) -> Publisher:
    options = {"host": ns.data_host, "ucx_tls": "tcp"}  # UCX on the data link: `host`'s
    return Publisher(
        [engine.url for engine in engines], transport="nixl", bucket_bytes=BUCKET_BYTES,
        timeout_s=timeout_s, token=TOKEN, transport_options=options,
    )  # fmt: skip


def _serves(engine: ServedEngine, model, fingerprint: str) -> None:
    """The engine serves `fingerprint` and decodes as transformers does on `model`."""
    assert weights_state(engine, TOKEN)["fingerprint"] == fingerprint
    tokens, logprobs = hf_greedy(model)
    choice = engine_greedy(engine)
    assert choice["token_ids"] == tokens
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=LOGPROB_ATOL)


def test_tp1_and_tp2_across_namespaces_bit_exact_atomic_and_in_place(
    namespaces, hf_model, tmp_path
):
    path, model = hf_model
    engines = started_together(
        lambda tp=tp: _in_namespace(
            namespaces, tmp_path, f"tp{tp}", "--model", str(path), "--tp", str(tp)
        )
        for tp in (1, 2)
    )
    try:
        with _across(namespaces, engines, timeout_s=60) as pub:
            for step, atomic in enumerate([True, False], start=1):
                trained = trained_copy(model, seed=step)
                result = pub.push(trained, version=f"step-{step}", atomic=atomic)
                assert result.mode == "nixl"
                assert result.fingerprint == pub.fingerprint(trained)
                for engine in engines:
                    _serves(engine, trained, result.fingerprint)
                total = sum(t.nbytes for t in trained.state_dict().values())
                shares = pub.sink.rank_bytes
                assert shares[(0, 0)] == total  # TP 1: the whole model, once
                # TP 2: each rank its part of every split tensor (norms are whole on both)
                halves = shares[(1, 0)], shares[(1, 1)]
                assert max(halves) < 0.6 * total < total < sum(halves) < 1.1 * total
    finally:
        stopped_together(engines)


def test_link_cut_mid_push_fails_both_sides_keeps_old_weights_then_pushes_again(
    namespaces, tmp_path
):
    engine = _in_namespace(namespaces, tmp_path, "engine", "--tp", "1")
    try:
        with _across(namespaces, [engine], timeout_s=5) as pub:
            good = pub.push(_weights(21), version="good")
            served = engine_greedy(engine)
            cutter = CutLinkAfterFirstBucket(namespaces.data_link)
            with pytest.raises(PushError) as failed:
                pub.push(_weights(22), version="cut", progress=cutter)
            assert cutter.cut
            assert failed.value.failures[engine.url].startswith("HTTP 504: rank 0: timed out")
            assert failed.value.transport_error.startswith("transport nixl: ")
            state = weights_state(engine, TOKEN)
            assert (state["status"], state["version"]) == ("NORMAL", "good")
            assert state["fingerprint"] == good.fingerprint
            assert engine_greedy(engine)["logprobs"] == served["logprobs"]
            link_up(namespaces.data_link)
            # nothing to re-form: the same Publisher reconnects on its next push
            result = pub.push(_weights(22), version="after-the-cut")
        assert weights_state(engine, TOKEN)["fingerprint"] == result.fingerprint
    finally:
        engine.stop()


def test_engines_join_and_leave_between_pushes(tmp_path):
    # the newcomer starts with the others (it waits for its first weights: nothing reaches it
    # before `add_engine`)
    flags = [("--tp", "1"), ("--tp", "2"), ("--wait-for-initial-weights",)]
    started = started_together(
        lambda index=index, args=args: ServedEngine(*args, log_path=tmp_path / f"{index}.log")
        for index, args in enumerate(flags)
    )
    try:
        with Publisher(
            [engine.url for engine in started[:2]], transport="nixl", bucket_bytes=BUCKET_BYTES,
            timeout_s=60,
        ) as pub:  # fmt: skip
            first = pub.push(_weights(1), version="v1")
            assert weights_state(started[2])["status"] == "WAITING"
            pub.add_engine(started[2].url, _weights(1))
            assert weights_state(started[2])["fingerprint"] == first.fingerprint
            second = pub.push(_weights(2), version="v2")
            pub.remove_engine(started[1].url)
            third = pub.push(_weights(3), version="v3")
            assert [e.url for e in third.engines] == [started[0].url, started[2].url]
        served = [weights_state(engine)["fingerprint"] for engine in started]
        assert served == [third.fingerprint, second.fingerprint, third.fingerprint]
    finally:
        stopped_together(started)


def test_an_engine_without_registered_memory_is_refused_naming_itself(tmp_path):
    engine = ServedEngine("--no-shm-weights", log_path=tmp_path / "engine.log")
    try:
        before = weights_state(engine)
        with (
            Publisher([engine.url], transport="nixl", timeout_s=30) as pub,
            pytest.raises(PushError) as failed,
        ):
            pub.push(_weights(1), version="refused")
        assert NO_MEMORY in failed.value.failures[engine.url]
        assert failed.value.transport_error == f"transport nixl: engine 0 rank 0: {NO_MEMORY}"
        state = weights_state(engine)
        assert (state["status"], state["fingerprint"]) == ("NORMAL", before["fingerprint"])
    finally:
        engine.stop()


def _rss_bytes(pids: list[int]) -> int:
    return sum(
        int(line.split()[1]) * 1024
        for pid in pids
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )


def _mapped_arenas(pids: list[int]) -> set[str]:
    """The parameter arenas the processes still map (deleted files included)."""
    return {
        line.split(maxsplit=5)[5]
        for pid in pids
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
        if ARENA_PREFIX in line
    }


def test_released_weights_memory_is_freed_though_it_was_registered(tmp_path):
    engine = ServedEngine(log_path=tmp_path / "engine.log")
    try:
        # one send buffer: each bucket packs only once the one before was written
        options = {"inflight_buckets": 1}
        with Publisher(
            [engine.url], transport="nixl", timeout_s=60, transport_options=options
        ) as pub:
            pub.push(_weights(1), version="v1")  # registers the staging arena too
            pub.push(_weights(2), version="v2")
            before = _rss_bytes(engine.worker_pids)
            assert len(_mapped_arenas(engine.worker_pids)) == 2  # live and staging
            released = engine.client.post("/v1/release_memory", json={"tags": ["weights"]})
            assert released.status_code == 200, released.text
            # both arenas (~12 MiB each, the tiny model in float32) are unmapped: with their
            # NIXL registrations kept alive ~2.5 MiB came back; with the staging model kept
            # alive by the last receive's loader, one arena stayed mapped (~15 MiB came back)
            assert _mapped_arenas(engine.worker_pids) == set()
            assert before - _rss_bytes(engine.worker_pids) > 20 * 2**20
            resumed = engine.client.post("/v1/resume_memory", json={"tags": ["weights"]})
            assert resumed.status_code == 200, resumed.text
            result = pub.push(_weights(3), version="v3")
        assert weights_state(engine)["fingerprint"] == result.fingerprint
    finally:
        engine.stop()
