"""Engine targets: one push reaches a reference engine (HTTP) and an `EngineTarget` that is
not one (an in-process CPU mirror built on the Receiver) together, bit-exactly."""

import pytest
import torch

from helpers import MirrorTarget, assert_bit_identical
from weightbus import Publisher, PushError
from weightbus.models.config import tiny_config
from weightbus.models.loader import random_hf_weights

# `engines` (tests/update/conftest.py): `tp2` and `tp1` start with the tiny model's seed-0
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
