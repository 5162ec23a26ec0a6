"""Engine targets: one push reaches a reference engine (HTTP) and an `EngineTarget` that is
not one (an in-process CPU mirror built on the Receiver) together, bit-exactly."""

import re

import pytest
import torch

from helpers import MirrorTarget, assert_bit_identical
from weightbus import Publisher, PushError
from weightbus.core.transport.distributed.group import group_names
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import random_hf_weights

# `engines` (tests/core/pushes/conftest.py): `tp2` and `tp1` start with the tiny model's seed-0
# weights; `reference_tp2` with these
SEED = 11


def _zeros(weights: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(tensor) for name, tensor in weights}


@pytest.mark.parametrize(("transport", "mode"), [("shm", "shm slots"), ("disk", "disk")])
def test_one_push_reaches_an_http_engine_and_a_mirror(engines, transport, mode):
    weights = list(random_hf_weights(tiny_config(), SEED))
    mirror = MirrorTarget("mirror://cpu", _zeros(weights))
    version = f"mixed-{transport}"
    with Publisher(
        [engines["tp2"].url, mirror], transport=transport, bucket_bytes=64 * 1024, timeout_s=60
    ) as pub:
        result = pub.push(weights, version=version, pause_mode="in_place")
        served = pub.engine_weights()
    # the mirror offers no parameters in shared memory, so every engine reads the slots
    assert result.mode == mode
    assert [engine.url for engine in result.engines] == [engines["tp2"].url, "mirror://cpu"]
    assert {engine.fingerprint for engine in result.engines} == {result.fingerprint}
    assert [(w.version, w.fingerprint) for w in served] == [(version, result.fingerprint)] * 2
    for name, tensor in weights:
        assert_bit_identical(mirror.target.tensors[name], tensor)
    reference = engines["reference_tp2"].client.get("/v1/weights").json()
    assert reference["fingerprint"] == result.fingerprint  # same bytes as a fresh engine


def test_a_refusing_target_is_named_and_does_not_hold_the_push(engines):
    weights = list(random_hf_weights(tiny_config(), SEED + 1))
    refusing = MirrorTarget("mirror://refusing", _zeros(weights), refuse="no room for it")
    with (
        Publisher([engines["tp1"].url, refusing], transport="shm", timeout_s=60) as pub,
        pytest.raises(PushError) as caught,
    ):
        pub.push(weights, version="refused", pause_mode="in_place")
    assert caught.value.failures["mirror://refusing"] == "no room for it"


def test_each_engine_over_its_own_transport_in_one_push(engines):
    """Routes: shm direct into tp2, a dist group with tp1 alone; one two-phase push."""
    weights = list(random_hf_weights(tiny_config(), SEED))
    tp2, tp1 = engines["tp2"].url, engines["tp1"].url
    with Publisher(
        [tp2, tp1], transport={tp2: "shm", tp1: "dist"}, bucket_bytes=64 * 1024, timeout_s=60
    ) as pub:
        groups = pub.init_weights_group("127.0.0.1")
        result = pub.push(weights, version="routed")
        sent = dict(pub.sink.children["dist"].rank_sent_bytes)
        served = pub.engine_weights()
    assert list(groups) == ["dist"]  # the shm route has no set-up
    assert groups["dist"].world_size == 2  # the publisher and tp1's one rank
    assert list(sent) == [1]  # only tp1's rank received over dist: every bucket, padded
    assert result.nbytes <= sent[1] < result.nbytes + 64 * 1024
    assert result.two_phase
    assert result.mode == "dist: dist broadcast, shm: shm direct"
    reference = engines["reference_tp2"].client.get("/v1/weights").json()["fingerprint"]
    assert result.fingerprint == reference
    assert [(w.version, w.fingerprint) for w in served] == [("routed", reference)] * 2


def test_a_refusal_on_one_route_discards_what_the_other_staged(engines):
    weights = list(random_hf_weights(tiny_config(), SEED + 2))
    tp2, tp1 = engines["tp2"].url, engines["tp1"].url
    with Publisher([tp1], transport="shm", timeout_s=60) as pub:
        pub.push(weights, version="taken", pause_mode="in_place")
    before = engines["tp2"].client.get("/v1/weights").json()
    with (
        Publisher([tp2, tp1], transport={tp2: "shm", tp1: "disk"}, timeout_s=60) as pub,
        pytest.raises(PushError) as caught,
    ):
        pub.push(weights, version="taken")
    error = caught.value
    assert "taken" in error.failures[tp1], error
    # tp2 was told to discard: staged already (aborted), or still receiving (its failure
    # names tp1's answer)
    assert tp2 in error.aborted or tp1 in error.failures.get(tp2, ""), error
    after = engines["tp2"].client.get("/v1/weights").json()
    assert (after["version"], after["fingerprint"]) == (before["version"], before["fingerprint"])


@pytest.mark.parametrize(
    ("routes", "message"),
    [
        ({"http://a:1": "shm"}, "transport: no transport is given for engines ['http://b:2']"),
        (
            {"http://a:1": "shm", "http://b:2": "shm", "http://c:3": "disk"},
            "transport: routes name engines that are not given: ['http://c:3']",
        ),
        (
            {"http://a:1": "shm", "http://b:2/": "rdma"},
            "transport: unknown transport 'rdma'; registered: ['disk', 'dist', 'hf_dir',",
        ),
    ],
)
def test_routes_name_every_engine_and_known_transports(routes, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        Publisher(["http://a:1", "http://b:2"], transport=routes)


def test_routes_refuse_an_engine_given_twice():
    with pytest.raises(ValueError, match=re.escape("engines: ['http://a:1'] given twice")):
        Publisher(["http://a:1", "http://a:1/"], transport={"http://a:1": "shm"})


def test_routed_engines_leave_and_join_over_another_transport(engines):
    first, second = (list(random_hf_weights(tiny_config(), SEED + k)) for k in (3, 4))
    tp2, tp1 = engines["tp2"].url, engines["tp1"].url
    with Publisher(
        [tp2, tp1], transport={tp2: "shm", tp1: "dist"}, bucket_bytes=64 * 1024, timeout_s=60
    ) as pub:
        group = pub.init_weights_group("127.0.0.1")["dist"].name
        pub.push(first, version="routed-1")
        pub.remove_engine(tp1)  # the last dist engine: the group is torn down, no error
        assert group not in group_names()
        assert pub.transports == {"shm"}
        alone = pub.push(second, version="routed-2")
        with pytest.raises(ValueError, match=r"^transport: unknown transport 'rdma'"):
            pub.add_engine(tp1, second, transport="rdma")
        assert pub.engines == [tp2]
        caught_up = pub.add_engine(tp1, second, transport="disk")  # back, over disk
        both = pub.push(first, version="routed-3")
    assert alone.mode == "shm: shm direct"
    assert caught_up.fingerprint == alone.fingerprint
    assert both.mode == "disk: disk, shm: shm direct"
    assert [e.fingerprint for e in both.engines] == [both.fingerprint] * 2
