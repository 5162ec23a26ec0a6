"""Delta pushes into real bf16 engines (TP 2 and TP 1): bit-exact over every transport, refused
on another base with the whole version landing instead, failing closed when the result is not
the new version.

Bit-exactness is checked twice: each engine reports the new version's fingerprint only after
every rank verified its slices, and its greedy logprobs equal its own after the same version
arrives whole.
"""

import secrets
from collections.abc import Iterator
from dataclasses import replace

import pytest
from delta_harness import (
    assert_whole_push_serves_the_same,
    bf16_engines,
    initial_weights,
    next_version,
    served_fingerprints,
)
from engine_harness import ServedEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from update_harness import weights_state

from weightbus import Publisher
from weightbus.core.delta import RankBase
from weightbus.core.publisher import PushError
from weightbus.core.publisher.targets import HttpEngineTarget
from weightbus.core.wire.delta import DELTA_BASE_REFUSAL

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def engines(
    tmp_path_factory: pytest.TempPathFactory, shared_processes
) -> Iterator[dict[str, ServedEngine]]:
    with bf16_engines(tmp_path_factory.mktemp("log"), shared_processes) as started:
        yield started


@pytest.mark.parametrize(
    ("transport", "options", "members"),
    [
        ("disk", {}, ("tp2", "tp1")),
        ("shm", {}, ("tp2", "tp1")),
        ("hf_dir", {}, ("tp2", "tp1")),
        ("dist", {"mode": "broadcast"}, ("tp2", "tp1")),
        ("dist", {"mode": "parts"}, ("tp2",)),
    ],
)
def test_deltas_land_bit_exactly_over_each_transport(engines, transport, options, members):
    urls = [engines[name].url for name in members]
    run = secrets.token_hex(2)
    weights = initial_weights(11)
    with Publisher(urls, transport=transport, transport_options=options, delta="always") as pub:
        if transport == "dist":
            pub.init_weights_group("127.0.0.1")
        first = pub.push(weights, version=f"{run}-0")
        assert not first.delta.sent
        assert first.delta.reason == "no base: the first push with deltas on goes whole"
        assert pub.delta_base_nbytes == first.nbytes
        for step in range(1, 4):
            weights = next_version(weights, seed=step)
            result = pub.push(weights, version=f"{run}-{step}")
            assert result.delta.sent, result.delta.reason
            assert result.delta.tensors["same"] == 1  # the frozen embedding
            assert result.delta.tensors["sparse"] >= 20
            assert result.nbytes < first.nbytes / 5
            assert result.fingerprint == pub.fingerprint(weights)
            assert served_fingerprints(pub) == {result.fingerprint}
    assert_whole_push_serves_the_same(engines, members, weights)


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    fraction=st.sampled_from([0.0, 1e-4, 0.01, 0.3, 1.0]),
    frozen=st.sampled_from(["embed", "layers.0", "mlp", "nothing"]),
    seed=st.integers(0, 1000),
)
def test_random_changes_apply_bit_exactly_on_tp1_and_tp2(engines, fraction, frozen, seed):
    urls = [engines["tp2"].url, engines["tp1"].url]
    run = secrets.token_hex(2)
    weights = initial_weights(11)
    with Publisher(urls, transport="shm", delta="always") as pub:
        pub.push(weights, version=f"{run}-0")
        weights = next_version(weights, seed, fraction, frozen)
        result = pub.push(weights, version=f"{run}-1")
        assert result.delta.sent
        assert result.fingerprint == pub.fingerprint(weights)
        assert served_fingerprints(pub) == {result.fingerprint}


def test_an_engine_on_another_base_refuses_with_409(engines):
    engine = engines["tp1"]
    weights = initial_weights(11)
    with Publisher([engine.url], transport="disk", delta="always") as pub:
        pub.push(weights, version=secrets.token_hex(3))
    served = weights_state(engine)
    stale = "f" * 32
    body = {
        "version": "next",
        "transport": "disk",
        "source": {"path": "/nonexistent"},
        "delta": {
            "base_version": "old",
            "base_fingerprint": stale,
            "fingerprint": stale,
            "tensors": [],
            "rank_digests": [[]],
        },
    }
    malformed = {**body, "delta": {"base_version": "old"}}
    response = engine.client.post("/v1/update_weights", json=malformed)
    assert response.status_code == 422, response.text
    assert "missing required field `base_fingerprint`" in response.json()["error"]["message"]
    response = engine.client.post("/v1/update_weights", json=body)
    assert response.status_code == 409, response.text
    assert response.json()["error"]["message"] == (
        f"{DELTA_BASE_REFUSAL} 'old' ({stale}) is not served here: this engine serves "
        f"{served['version']!r} ({served['fingerprint']})"
    )


def test_an_engine_pushed_by_someone_else_gets_the_whole_version(engines):
    weights = initial_weights(11)
    run = secrets.token_hex(2)
    urls = [engines["tp2"].url, engines["tp1"].url]
    with Publisher(urls, transport="shm", delta="always") as pub:
        pub.push(weights, version=f"{run}-0")
        with Publisher([engines["tp1"].url], transport="disk") as other:
            other.push(next_version(weights, seed=5), version=f"{run}-other")
        weights = next_version(weights, seed=6)
        result = pub.push(weights, version=f"{run}-1")
        assert not result.delta.sent
        assert (
            result.delta.reason == f"engine {engines['tp1'].url} does not serve the base '{run}-0'"
        )
        assert served_fingerprints(pub) == {pub.fingerprint(weights)}
        # the base is the pushed version again: the next push is a delta
        weights = next_version(weights, seed=7)
        assert pub.push(weights, version=f"{run}-2").delta.sent


class _StaleReads(HttpEngineTarget):
    """Reads the engine's version from before another publisher's push (the race between
    the Publisher's check and its order)."""

    served: str | None = None

    def weights(self, timeout_s: float):
        state = super().weights(timeout_s)
        return state if self.served is None else replace(state, fingerprint=self.served)


def test_a_delta_refused_in_flight_is_followed_by_the_whole_version(engines):
    weights = initial_weights(11)
    run = secrets.token_hex(2)
    stale = _StaleReads(engines["tp1"].url)
    with Publisher([engines["tp2"].url, stale], transport="disk", delta="always") as pub:
        base = pub.push(weights, version=f"{run}-0")
        with Publisher([engines["tp1"].url], transport="disk") as other:
            other.push(next_version(weights, seed=5), version=f"{run}-other")
        stale.served = base.fingerprint
        weights = next_version(weights, seed=6)
        result = pub.push(weights, version=f"{run}-1")
        assert not result.delta.sent
        assert result.delta.reason.startswith("refused: ")
        assert DELTA_BASE_REFUSAL in result.delta.reason
        stale.served = None
        assert served_fingerprints(pub) == {pub.fingerprint(weights)}


def _corrupting_encode(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Encodings whose indices of `name` point one element further (still increasing and in
    range): the stream's digests match what is sent, only the result is wrong."""
    encode = RankBase.encode

    def corrupted(self, *args, **options):
        changes = encode(self, *args, **options)
        changes[name][-1].indices[-1] += 1  # the last changed element: the next is never changed
        return changes

    monkeypatch.setattr(RankBase, "encode", corrupted)


@pytest.mark.parametrize("atomic", [True, False])
def test_a_corrupted_index_fails_closed(engines, monkeypatch, atomic):
    weights = initial_weights(11)
    run = secrets.token_hex(2)
    name = "model.layers.1.self_attn.o_proj.weight"  # split by columns at TP 2
    urls = [engines["tp2"].url, engines["tp1"].url]
    with Publisher(urls, transport="shm", delta="always") as pub:
        base = pub.push(weights, version=f"{run}-0")
        with monkeypatch.context() as patch:
            _corrupting_encode(patch, name)
            new = next_version(weights, seed=3)
            new[name].view(-1)[-1] = weights[name].view(-1)[-1]  # room for the shifted index
            with pytest.raises(PushError) as raised:
                pub.push(new, version=f"{run}-1", atomic=atomic)
        assert f"delta of {name!r}: this rank's slice is not the new one" in str(raised.value)
        states = pub.engine_weights()
        if atomic:  # the base still serves, bit-exactly
            assert {state.fingerprint for state in states} == {base.fingerprint}
        else:  # some rank wrote its slice: the engines refuse to serve
            assert {state.status for state in states} == {"FAILED"}
        # the base did not advance: the next delta (or, after FAILED, the whole version) lands
        result = pub.push(new, version=f"{run}-2")
        assert result.delta.sent == atomic
        assert served_fingerprints(pub) == {pub.fingerprint(new)}


def test_auto_sends_a_delta_only_where_it_pays(engines):
    weights = initial_weights(11)
    run = secrets.token_hex(2)
    with Publisher([engines["tp1"].url], transport="disk", delta="auto") as pub:
        pub.push(weights, version=f"{run}-0")
        weights = next_version(weights, seed=1)
        assert pub.push(weights, version=f"{run}-1").delta.sent  # 2%: a delta
        weights = next_version(weights, seed=2, fraction=1.0, frozen="nothing")
        dense = pub.push(weights, version=f"{run}-2")
        assert not dense.delta.sent
        assert dense.delta.reason.startswith("a delta would carry ")
        assert dense.delta.reason.endswith(" of the bytes (auto: at most 50%)")
        # a whole push by request still becomes the base: the next one is a delta again
        weights = next_version(weights, seed=3)
        assert not pub.push(weights, version=f"{run}-3", delta="never").delta.sent
        weights = next_version(weights, seed=4)
        assert pub.push(weights, version=f"{run}-4").delta.sent
        assert served_fingerprints(pub) == {pub.fingerprint(weights)}
    with Publisher([engines["tp1"].url], transport="shm", delta="auto") as pub:
        pub.push(weights, version=f"{run}-5")
        local = pub.push(next_version(weights, seed=5), version=f"{run}-6")
    assert not local.delta.sent
    assert local.delta.reason == (
        "auto: shm copies at memory speed, a delta would cost more than it saves"
    )
