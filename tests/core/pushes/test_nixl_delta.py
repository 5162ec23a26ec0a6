"""Delta pushes over `nixl` into real bf16 engines (TP 2 and TP 1): whole tensors are written
into the ranks' parameters, the delta's payload tensors whole into each rank's inbox; every
engine ends on the new version bit-exactly, and less reaches each rank than in a whole push.

With 64 KiB buckets a payload spans several buckets (reassembled on the ranks) and the two
inbox slots of each rank are written many times over, each time after the rank released the
bucket the slot held (its `SlotAck`).
"""

import secrets
from collections.abc import Iterator

import pytest
from delta_harness import (
    assert_whole_push_serves_the_same,
    bf16_engines,
    initial_weights,
    next_version,
    served_fingerprints,
)
from engine_harness import ServedEngine
from update_harness import KiB

from weightbus import Publisher, PushError
from weightbus.core.transport.nixl.sink import NixlSink
from weightbus.core.transport.nixl.writes import BucketWrites

pytestmark = pytest.mark.e2e

MEMBERS = ("tp2", "tp1")


@pytest.fixture(scope="module")
def engines(
    tmp_path_factory: pytest.TempPathFactory, shared_processes
) -> Iterator[dict[str, ServedEngine]]:
    with bf16_engines(tmp_path_factory.mktemp("log"), shared_processes) as started:
        yield started


@pytest.mark.parametrize(
    ("bucket_bytes", "fraction", "max_share"),
    [(None, 0.02, 0.5), (64 * KiB, 0.1, 0.75)],
    ids=["default-buckets", "payloads-span-buckets"],
)
def test_deltas_over_nixl_land_bit_exactly_with_less_reaching_each_rank(
    engines, bucket_bytes, fraction, max_share, monkeypatch
):
    """`max_share`: at most this share of a whole push's bytes reaches any rank (every rank
    receives the whole payload, its slices of the tensors sent whole)."""
    acks_awaited = _count_ack_waits(monkeypatch)
    urls = [engines[name].url for name in MEMBERS]
    options = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    run = secrets.token_hex(2)
    weights = initial_weights(23)
    with Publisher(urls, transport="nixl", delta="always", **options) as pub:
        first = pub.push(weights, version=f"{run}-0")
        assert not first.delta.sent
        full_ranks = [engine.rank_nbytes for engine in first.engines]
        assert [len(ranks) for ranks in full_ranks] == [2, 1]
        for step in range(1, 4):
            weights = next_version(weights, seed=100 * step + len(run), fraction=fraction)
            # step 2 in place: the writes land in the live parameters, not a staged copy
            result = pub.push(weights, version=f"{run}-{step}", atomic=step != 2)
            assert result.delta.sent, result.delta.reason
            assert result.mode == "nixl"
            assert result.delta.tensors["sparse"] > 0
            assert result.delta.tensors["same"] == 1  # the embedding
            assert result.fingerprint == pub.fingerprint(weights)
            assert served_fingerprints(pub) == {result.fingerprint}
            for engine, full in zip(result.engines, full_ranks, strict=True):
                assert len(engine.rank_nbytes) == len(full)
                for got, whole in zip(engine.rank_nbytes, full, strict=True):
                    assert 0 < got < max_share * whole, (engine.url, engine.rank_nbytes, full)
        if bucket_bytes is not None:
            # the largest payload (a 688 x 256 MLP matrix's indices, >= 4 bytes each) spans
            # buckets, and the ranks' inbox slots were written again after their acks
            assert int(fraction * 688 * 256) * 4 > bucket_bytes
            assert acks_awaited
    # the same version pushed whole serves the same greedy logprobs
    assert_whole_push_serves_the_same(engines, MEMBERS, weights, transport="nixl")


def _count_ack_waits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(rank, bucket) of every inbox slot the publisher waited to see released."""
    awaited: list[tuple[str, int]] = []
    wait = BucketWrites._wait_ack

    def counted(self, rank, bucket_index):
        awaited.append((rank.describe(), bucket_index))
        wait(self, rank, bucket_index)

    monkeypatch.setattr(BucketWrites, "_wait_ack", counted)
    return awaited


def test_a_rank_that_never_releases_its_inbox_fails_the_delta_then_the_next_one_lands(
    engines, monkeypatch
):
    """The publisher stops reading the ranks' acks: it times out before overwriting an inbox
    slot, the engine keeps the base (atomic), and the same Publisher's next delta lands."""
    engine = engines["tp2"]
    run = secrets.token_hex(2)
    weights = initial_weights(23)
    with Publisher(
        [engine.url], transport="nixl", delta="always", bucket_bytes=64 * KiB, timeout_s=10
    ) as pub:
        base = pub.push(weights, version=f"{run}-0")
        with monkeypatch.context() as patch:
            patch.setattr(NixlSink, "_listen", lambda self, ranks: False)
            with pytest.raises(PushError) as failed:
                pub.push(next_version(weights, seed=7, fraction=0.1), version=f"{run}-lost")
        assert "did not release bucket" in str(failed.value.transport_error)
        assert served_fingerprints(pub) == {base.fingerprint}
        weights = next_version(weights, seed=8, fraction=0.1)
        result = pub.push(weights, version=f"{run}-1")
        assert result.delta.sent, result.delta.reason
        assert served_fingerprints(pub) == {result.fingerprint} == {pub.fingerprint(weights)}
