"""`dist` into real engines: one gloo weights group, TP 1 and 2, both modes, bit-exact; a push
one engine refuses, cancelled at once by the hand-shake, the group serving the next push; a data
link cut and an engine SIGKILLed mid-push; the next push re-forms the group by itself, without
a restart."""

import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import pytest
from engine_harness import ServedEngine
from fleet_harness import kill_midway
from netns_harness import CutLinkAfterFirstBucket, link_up
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore
from update_harness import weights_state

from weightbus import Publisher, PushError
from weightbus.core.store import serve_store
from weightbus.core.transport.distributed.group import WeightsGroup, get_group, group_names
from weightbus.core.transport.distributed.handshake import (
    PushCancelledError,
    join_stream,
    refuse_stream,
    start_stream,
)
from weightbus.core.transport.distributed.messages import WeightsGroupError
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import random_hf_weights

PROMPT = [4, 2, 42]
# `engines` (tests/core/pushes/conftest.py): the reference engine starts with these weights; the
# others receive them
SEED = 5
BUCKET_BYTES = 64 * 1024  # the 512 KiB embedding travels in chunks
# Far above pytest's own bound (pyproject.toml, `timeout = 300`): a push that waited out its
# timeout instead of stopping at a refusal fails the test.
WAIT_OUT_TIMEOUT_S = 600.0
# Bound of a hand-shake step in the in-process tests (nothing waits it out).
STEP_TIMEOUT_S = 30.0


def _greedy(engine: ServedEngine) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "logprobs": 2}
    response = engine.client.post("/v1/completions", json={**body, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _weights(seed: int) -> list:
    return list(random_hf_weights(tiny_config(), seed))


@contextlib.contextmanager
def socket_without_listener() -> Iterator[int]:
    """A port the OS gave us that refuses connections (bound, never listening)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.mark.parametrize("mode", ["broadcast", "parts"])
def test_one_group_carries_pushes_into_tp1_and_tp2_bit_exactly(engines, mode):
    targets = [engines["tp2"], engines["tp1"]]
    reference = engines["reference_tp2"]
    urls = [e.url for e in targets]
    options = {"mode": mode}
    with Publisher(
        urls, transport="dist", bucket_bytes=BUCKET_BYTES, timeout_s=60, transport_options=options
    ) as pub:
        info = pub.init_weights_group("127.0.0.1", timeout_s=30)
        assert (info.world_size, info.rank_offsets) == (4, {urls[0]: 1, urls[1]: 3})
        group = get_group(info.name)
        pub.push(_weights(SEED + 1), version=f"{mode}-0")
        result = pub.push(_weights(SEED), version=f"{mode}-1", atomic=False, pause_mode="in_place")
        assert get_group(info.name) is group  # created once, reused by every push
        sent_bytes = pub.sink.rank_sent_bytes
    assert info.name not in group_names()  # close() left the group
    full_bytes = sent_bytes[3]  # the TP 1 engine loads every byte in both modes
    assert full_bytes >= result.nbytes
    if mode == "parts":
        # TP 2 ranks get only their slices: half of the sharded tensors, the small norms whole
        assert sent_bytes[1] + sent_bytes[2] < 1.05 * full_bytes
    else:
        assert sent_bytes == dict.fromkeys([1, 2, 3], full_bytes)
    expected = weights_state(reference)["fingerprint"]
    assert result.fingerprint == expected
    assert [e.fingerprint for e in result.engines] == [expected, expected]
    # same weights, same TP: bit-identical logprobs; another TP size: the same tokens
    want = _greedy(reference)
    got_tp2, got_tp1 = _greedy(targets[0]), _greedy(targets[1])
    assert got_tp2["token_ids"] == want["token_ids"]
    assert got_tp2["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]
    assert got_tp1["token_ids"] == want["token_ids"]
    assert got_tp1["logprobs"]["token_logprobs"] == pytest.approx(
        want["logprobs"]["token_logprobs"], abs=1e-4
    )


def test_a_refused_push_is_cancelled_at_once_and_the_same_group_carries_the_next(engines):
    accepting, refusing = engines["tp2"], engines["tp1"]
    urls = [accepting.url, refusing.url]
    with Publisher(
        urls, transport="dist", bucket_bytes=BUCKET_BYTES, timeout_s=WAIT_OUT_TIMEOUT_S
    ) as pub:
        info = pub.init_weights_group("127.0.0.1", timeout_s=30)
        group = get_group(info.name)
        base = pub.push(_weights(SEED + 30), version="refusal-base")
        served = _greedy(accepting)
        released = refusing.client.post("/v1/release_memory", json={"tags": ["weights"]})
        assert released.status_code == 200, released.text
        with pytest.raises(PushError) as failed:
            pub.push(_weights(SEED + 31), version="refused")
        # the refusal (409: a two-phase push needs the weights memory), named with its reason
        refusal = "HTTP 409: the weights memory is released: resume it before a two-phase update"
        assert failed.value.failures[refusing.url] == refusal
        # the publisher cancelled before anything moved; the other engine's ranks heard why
        answered = f"engine {refusing.url} answered before the stream ended: {refusal}"
        assert failed.value.transport_error == (
            f"transport dist: push cancelled before anything was sent: {answered}"
        )
        assert refusing.url in failed.value.failures[accepting.url]
        assert refusal in failed.value.failures[accepting.url]
        state = weights_state(accepting)
        assert (state["status"], state["version"]) == ("NORMAL", "refusal-base")
        assert state["fingerprint"] == base.fingerprint
        assert _greedy(accepting)["logprobs"] == served["logprobs"]
        assert group.broken is None  # no collective started: the group is whole
        resumed = refusing.client.post("/v1/resume_memory", json={"tags": ["weights"]})
        assert resumed.status_code == 200, resumed.text
        result = pub.push(_weights(SEED + 31), version="after-refusal")
        assert get_group(info.name) is group  # the same group: never re-initialised
    fingerprints = [weights_state(e)["fingerprint"] for e in (accepting, refusing)]
    assert fingerprints == [result.fingerprint] * 2


def _gloo(store: TCPStore, group_rank: int, world_size: int) -> ProcessGroupGloo:
    options = ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=STEP_TIMEOUT_S)
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return ProcessGroupGloo(PrefixStore("handshake-test", store), group_rank, world_size, options)


def _member(master: TCPStore, group_rank: int, world_size: int) -> WeightsGroup:
    store = master
    if group_rank:
        timeout = timedelta(seconds=STEP_TIMEOUT_S)
        store = TCPStore("127.0.0.1", master.port, None, is_master=False, timeout=timeout)
    return WeightsGroup(
        name="handshake-test",
        group_rank=group_rank,
        world_size=world_size,
        timeout_s=STEP_TIMEOUT_S,
        pg=_gloo(store, group_rank, world_size),
        store=store,
    )


@contextlib.contextmanager
def threads_group(world_size: int) -> Iterator[list[WeightsGroup]]:
    """A weights group whose members are threads of this process (registered nowhere): the
    publisher (group rank 0) first."""
    master = serve_store("127.0.0.1", 0, world_size=None, timeout_s=STEP_TIMEOUT_S)
    with ThreadPoolExecutor(world_size) as pool:
        futures = [pool.submit(_member, master, rank, world_size) for rank in range(world_size)]
        members = [future.result(STEP_TIMEOUT_S) for future in futures]
    try:
        yield members
    finally:
        for member in members:
            member.pg.abort()


def _join(pool: ThreadPoolExecutor, member: WeightsGroup, session_id: str) -> Future:
    """The rank's hand-shake in the background: "start", or why it was cancelled."""

    def run() -> str:
        try:
            join_stream(member, session_id, time.monotonic() + STEP_TIMEOUT_S)
        except PushCancelledError as exc:
            return str(exc)
        return "start"

    return pool.submit(run)


def _start(publisher: WeightsGroup, session_id: str, timeout_s: float = STEP_TIMEOUT_S) -> None:
    start_stream(
        publisher,
        session_id,
        time.monotonic() + timeout_s,
        abandoned=lambda: None,
        describe_rank=lambda group_rank: f"group rank {group_rank}",
    )


@pytest.mark.e2e  # the group's store serves on a TCP port
def test_an_engine_killed_mid_stream_fails_the_push_and_the_group_reforms_without_it(
    engines, tmp_path
):
    survivor = engines["tp1"]
    victim = ServedEngine("--tp", "1", log_path=tmp_path / "victim.log")
    try:
        with Publisher(
            [survivor.url, victim.url], transport="dist", bucket_bytes=BUCKET_BYTES, timeout_s=5
        ) as pub:
            pub.init_weights_group("127.0.0.1", timeout_s=30)
            base = pub.push(_weights(SEED + 40), version="kill-base")
            served = _greedy(survivor)
            started = time.monotonic()
            with pytest.raises(PushError) as failed:
                pub.push(_weights(SEED + 41), version="killed", progress=kill_midway(victim, 3))
            failed_after_s = time.monotonic() - started
            assert victim.url in failed.value.failures
            assert failed.value.transport_error.startswith("transport dist: ")
            state = weights_state(survivor)
            assert (state["status"], state["fingerprint"]) == ("NORMAL", base.fingerprint)
            assert _greedy(survivor)["logprobs"] == served["logprobs"]
            # the next push re-forms the group first: the dead engine is named
            with pytest.raises(WeightsGroupError) as reform:
                pub.push(_weights(SEED + 41), version="with-the-dead")
            assert list(reform.value.failures) == [victim.url]
            assert str(reform.value).startswith("initialisation of weights group 'weightbus'")
            pub.remove_engine(victim.url)  # the group re-forms over the survivor
            result = pub.push(_weights(SEED + 41), version="without-the-dead")
        assert weights_state(survivor)["fingerprint"] == result.fingerprint
        # within the push's bound: timeout_s + the HTTP margin (docs/fleet.md)
        assert failed_after_s < 5 + 10
    finally:
        victim.stop()


def test_the_handshake_cancels_for_a_refusing_or_missing_rank_and_the_group_goes_on():
    cancelled = "push cancelled before anything was sent: by the publisher: "
    with threads_group(3) as (publisher, first, second), ThreadPoolExecutor(2) as pool:
        # rank 2 cannot take part (its side of the group is unusable): rank 1 hears why
        session = secrets.token_hex(16)
        joined = _join(pool, first, session)
        refused = "group rank 2 refused it: its group is broken"
        refuse_stream(second, session, "its group is broken")
        with pytest.raises(PushCancelledError, match=refused):
            _start(publisher, session)
        assert joined.result(STEP_TIMEOUT_S) == cancelled + refused
        # rank 2 does not come in time: rank 1 hears why, rank 2 too when it comes later
        session = secrets.token_hex(16)
        joined = _join(pool, first, session)
        missing = "timed out waiting for group rank 2 to join the push"
        with pytest.raises(TimeoutError, match=missing):
            _start(publisher, session, timeout_s=0.5)
        assert joined.result(STEP_TIMEOUT_S) == cancelled + missing
        assert _join(pool, second, session).result(STEP_TIMEOUT_S) == cancelled + missing
        # nothing moved: the group carries the next session
        session = secrets.token_hex(16)
        joined = [_join(pool, member, session) for member in (first, second)]
        _start(publisher, session)
        assert [future.result(STEP_TIMEOUT_S) for future in joined] == ["start", "start"]
        # the refusing rank's side was unusable: the publisher's next push forms the group anew
        assert [member.broken for member in (publisher, first, second)] == [refused, None, None]


def test_a_push_forms_the_group_and_the_group_needs_dist(engines):
    engine = engines["tp1"]
    with Publisher([engine.url], transport="dist", timeout_s=30) as pub:
        assert (
            pub.push(_weights(1), version="formed").fingerprint
            == (weights_state(engine)["fingerprint"])
        )
        assert "weightbus" in group_names()
    assert "weightbus" not in group_names()  # closing left it, here and on the engine
    with (
        Publisher([engine.url], transport="shm") as pub,
        pytest.raises(ValueError, match="init_weights_group needs transport 'dist', not 'shm'"),
    ):
        pub.init_weights_group("127.0.0.1")


def test_init_weights_group_refusals(engines):
    client = engines["tp2"].client
    body = {"master_addr": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 3}
    response = client.post("/v1/init_weights_group", json={**body, "backend": "nccl"})
    assert response.status_code == 422
    assert response.json()["error"]["param"] == "backend"
    response = client.post("/v1/init_weights_group", json={**body, "world_size": 2})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "rank_offset 1 + tp_size 2 exceeds world_size 2"
    # nobody serves the store: every rank gives up after timeout_s, the engine answers 504
    with socket_without_listener() as port:
        response = client.post(
            "/v1/init_weights_group", json={**body, "master_port": port, "timeout_s": 1.0}
        )
    assert response.status_code == 504
    message = response.json()["error"]["message"]
    assert f"rank 0: weights group 'weightbus': no store at 127.0.0.1:{port}" in message
    assert _greedy(engines["tp2"])["token_ids"]  # the engine serves on
    response = client.post("/v1/destroy_weights_group", json={})
    assert response.json() == {
        "action": "destroy_weights_group",
        "message": "left weights group 'weightbus'",
    }


@contextlib.contextmanager
def silent_store() -> Iterator[tuple[int, threading.Event]]:
    """A port that accepts connections and never answers (a store on a hung host); the event
    is set once a connection arrived."""
    connected, held = threading.Event(), []
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)

        def accept() -> None:
            with contextlib.suppress(OSError):  # the socket closes at the end of the test
                while True:
                    held.append(sock.accept()[0])
                    connected.set()

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        try:
            yield sock.getsockname()[1], connected
        finally:
            for connection in held:
                connection.close()


def test_the_engine_generates_while_its_ranks_wait_for_a_group(engines):
    engine = engines["tp2"]
    body = {"master_addr": "127.0.0.1", "rank_offset": 1, "world_size": 3, "timeout_s": 3.0}
    with silent_store() as (port, connected), ThreadPoolExecutor(1) as pool:
        init = pool.submit(
            engine.client.post, "/v1/init_weights_group", json={**body, "master_port": port}
        )
        assert connected.wait(30), "no rank reached the store"
        # the ranks wait for the store in the background: completions are served meanwhile
        for _ in range(3):
            assert _greedy(engine)["token_ids"]
        assert not init.done()
        response = init.result(60)
    # torch's store client waits for ever on a silent store: each rank gives up by itself
    assert response.status_code == 504
    assert "the init did not return within 8 s" in response.json()["error"]["message"]
    assert _greedy(engine)["token_ids"]
    assert engine.client.post("/v1/destroy_weights_group", json={}).status_code == 200


def test_repeated_init_and_destroy_of_the_group(engines):
    targets = [engines["tp2"], engines["tp1"]]
    urls = [e.url for e in targets]
    with Publisher(urls, transport="dist", bucket_bytes=BUCKET_BYTES, timeout_s=60) as pub:
        for round_index in range(4):
            info = pub.init_weights_group("127.0.0.1", timeout_s=30)
            if round_index % 2:  # re-forming a live group replaces it
                info = pub.init_weights_group("127.0.0.1", timeout_s=30)
            result = pub.push(_weights(SEED + 10 + round_index), version=f"reinit-{round_index}")
            assert [weights_state(e)["fingerprint"] for e in targets] == [result.fingerprint] * 2
            pub.destroy_weights_group()
            assert info.name not in group_names()
    for engine in targets:
        assert _greedy(engine)["token_ids"]  # every engine serves on


# --- across network namespaces ---


def test_link_cut_mid_push_fails_both_sides_keeps_old_weights_then_reinit(namespaces, tmp_path):
    token = "netns-test-token"
    engine = ServedEngine(
        "--host", namespaces.engine_control_host, "--api-token", token,
        log_path=tmp_path / "engine.log",
        prefix=("ip", "netns", "exec", namespaces.name),
        token=token,
    )  # fmt: skip
    try:
        with Publisher(
            [engine.url], transport="dist", bucket_bytes=BUCKET_BYTES, timeout_s=5, token=token
        ) as pub:
            pub.init_weights_group(namespaces.data_host, timeout_s=30)
            good = pub.push(_weights(21), version="good")
            served = _greedy(engine)
            cutter = CutLinkAfterFirstBucket(namespaces.data_link)
            with pytest.raises(PushError) as failed:
                pub.push(_weights(22), version="cut", progress=cutter)
            assert cutter.cut
            # the engine gave up by its own timeout and says so; the publisher's stream did too
            reason = failed.value.failures[engine.url]
            assert reason.startswith("HTTP 504: rank 0: timed out after 5 s")
            assert failed.value.transport_error.startswith(
                "transport dist: weights group 'weightbus': "
            )
            # its own timeout, or the engine's ranks leaving first (under load): either way a
            # failure of this group, within the push's timeout
            # atomic: nothing half-applied, the old version serves bit-exactly
            state = weights_state(engine, token)
            assert (state["status"], state["version"]) == ("NORMAL", "good")
            assert state["fingerprint"] == good.fingerprint
            assert _greedy(engine)["logprobs"] == served["logprobs"]
            assert get_group("weightbus").broken is not None
            link_up(namespaces.data_link)
            # the next push re-forms the broken group by itself
            result = pub.push(_weights(22), version="after-reinit")
            assert get_group("weightbus").broken is None
        assert weights_state(engine, token)["fingerprint"] == result.fingerprint
        assert _greedy(engine)["logprobs"] != served["logprobs"]
    finally:
        engine.stop()
