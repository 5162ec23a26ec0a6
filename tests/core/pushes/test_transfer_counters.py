"""The transports' byte counters after a real push into a TP 2 and a TP 1 engine: what each
rank received (`EngineResult.rank_nbytes`, counted by the ranks' sources) and what the
publisher's sink sent (`PushResult.sent_bytes`), against the bytes of each rank's slices
computed here from the tensors' shapes."""

import math

import pytest
from engine_harness import ServedEngine

from weightbus import Publisher
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import random_hf_weights

pytestmark = pytest.mark.e2e

# 64 KiB buckets: the 512 KiB embedding and head travel in chunks over several buckets
BUCKET_BYTES = 64 * 1024
# Llama's tensor-parallel rule, by module: output features (rows) split over the ranks,
# input features (columns) split, vocabulary rows split in ranges of ceil(vocab / tp)
SPLIT_ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
SPLIT_COLUMNS = ("o_proj", "down_proj")
SPLIT_VOCAB = ("embed_tokens", "lm_head")


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, shared_processes) -> list[ServedEngine]:
    """A TP 2 and a TP 1 tiny-model engine to push into: the ones other modules share
    (tests/process_pool.py); each test's counters are its own push's."""
    log_dir = tmp_path_factory.mktemp("log")
    return [shared_processes.tiny_engine("--tp", str(tp), log_dir=log_dir) for tp in (2, 1)]


def _rank_numel(name: str, shape: tuple[int, ...], tp: int, rank: int) -> int:
    """Elements of tensor `name` that rank `rank` of a TP `tp` engine holds."""
    module = name.split(".")[-2]
    if module in SPLIT_VOCAB:
        per_rank = -(-shape[0] // tp)
        rows = min(shape[0], (rank + 1) * per_rank) - rank * per_rank
        return rows * shape[1]
    if module in SPLIT_ROWS:
        return shape[0] // tp * shape[1]
    if module in SPLIT_COLUMNS:
        return shape[0] * (shape[1] // tp)
    assert module.endswith("norm"), f"no rule for {name}"  # replicated
    return math.prod(shape)


def _slice_bytes(weights: list, tp: int) -> list[int]:
    """Per rank, the bytes of its slices of every tensor."""
    return [
        sum(_rank_numel(name, tuple(t.shape), tp, rank) * t.element_size() for name, t in weights)
        for rank in range(tp)
    ]


def _publisher(engines: list[ServedEngine], transport: str | tuple, options: dict) -> Publisher:
    """A Publisher over `transport`; a tuple routes engine i over `transport[i]`."""
    urls = [engine.url for engine in engines]
    if not isinstance(transport, str):
        transport = dict(zip(urls, transport, strict=True))
    return Publisher(
        urls,
        transport=transport,
        bucket_bytes=BUCKET_BYTES,
        timeout_s=60,
        transport_options=options,
    )


# (transport, sink options, push options, whether each rank gets only its slices)
CASES = {
    "shm-direct-atomic": ("shm", {"direct": True}, {}, True),
    "shm-direct-in-place": ("shm", {"direct": True}, {"atomic": False}, True),
    "shm-slots": ("shm", {"direct": False}, {}, False),
    "dist-broadcast": ("dist", {"mode": "broadcast"}, {}, False),
    "dist-parts": ("dist", {"mode": "parts"}, {"atomic": False}, True),
    "nixl": ("nixl", {}, {}, True),
    "disk": ("disk", {}, {}, False),
    # routed: the TP 2 engine over shm direct, the TP 1 engine over disk (its full tensors)
    "routed-shm-disk": (("shm", "disk"), {"shm": {"direct": True}}, {}, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_counters_match_each_ranks_slices(engines, case):
    transport, sink_options, push_options, sliced = CASES[case]
    config = tiny_config()
    assert config.num_key_value_heads % 2 == 0  # k/v heads split too, not replicated
    weights = list(random_hf_weights(config, seed=7))
    full_bytes = sum(tensor.nbytes for _, tensor in weights)
    with _publisher(engines, transport, sink_options) as pub:
        if transport == "dist":
            pub.init_weights_group("127.0.0.1", timeout_s=30)
        result = pub.push(weights, version=f"counters-{case}", **push_options)
    assert result.nbytes == full_bytes
    received = [engine_result.rank_nbytes for engine_result in result.engines]
    if sliced:
        tp2 = _slice_bytes(weights, 2)
        assert sum(tp2) < 1.1 * full_bytes  # the norms alone are on both ranks
        assert received == [tp2, [full_bytes]]
        assert result.sent_bytes == sum(tp2) + full_bytes  # into every rank of every engine
    else:
        assert received == [[full_bytes, full_bytes], [full_bytes]]
        assert result.sent_bytes == full_bytes  # once, whatever the number of receivers
    # rank 0's share is the engine's `bytes`
    assert [engine_result.nbytes for engine_result in result.engines] == [
        ranks[0] for ranks in received
    ]
