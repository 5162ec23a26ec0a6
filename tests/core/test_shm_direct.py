"""shm direct mode: the publisher writes each rank's slices straight into its parameters.

Real TP-sharded models (ranks as threads) hold their parameters in shared-memory arenas; real
ZMQ sockets carry the messages. After a push each rank's parameters equal what `load_weights`
of the same weights gives, bit for bit.
"""

import os
import threading
import time

import msgspec
import numpy as np
import pytest
import torch

from helpers import all_dtype_tensors, assert_bit_identical, random_tensor, receive_order
from sessions import SessionFactory
from weightbus.core.digest import tensor_digest
from weightbus.core.finite import NonFiniteWeightsError
from weightbus.core.meta import TensorMeta, metas_of
from weightbus.core.plan import plan_buckets
from weightbus.core.plan.shard import ShardCopy
from weightbus.core.receiver import RankResult, Receiver
from weightbus.core.transport import make_sink, open_source
from weightbus.core.transport.parts.arena import ParamArena, direct_placement
from weightbus.core.transport.parts.shared_memory import (
    ARENA_PREFIX,
    SHM_DIR,
    SLOT_PREFIX,
    remove_stale_slots,
)
from weightbus.core.transport.shm import direct as shm_direct
from weightbus.core.transport.shm.description import ShmDescription
from weightbus.core.transport.shm.direct import DirectWriter, MappedTarget
from weightbus.core.transport.shm.source import ShmSource
from weightbus.core.weights import normalize_weights
from weightbus.engines.reference.layers.parallel import TPContext, tp_context
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.llama import LlamaForCausalLM, hf_weight_shapes
from weightbus.engines.reference.models.loader import create_model, random_hf_weights

KiB = 1024
TIMEOUT_S = 30.0


class _Rank:
    """One engine rank: a sharded model whose parameters live in a shared-memory arena."""

    def __init__(self, config, tp_rank: int, tp_size: int, group: int, *, arena: bool) -> None:
        with tp_context(TPContext(tp_rank=tp_rank, tp_size=tp_size)):
            self.model: LlamaForCausalLM = create_model(config)
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group
        self.arena = ParamArena(self.model.named_parameters()) if arena else None
        self.placement = None
        if self.arena is not None:
            self.arena.adopt(self.model)
            self.placement = direct_placement(self.arena, self.model.shard_copies())

    def expected(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's parameters after `load_weights` of `weights`."""
        with tp_context(TPContext(tp_rank=self.tp_rank, tp_size=self.tp_size)):
            reference = create_model(self.model.config)
        reference.load_weights(weights.items())
        return dict(reference.named_parameters())

    def receive(
        self, description: ShmDescription, version: str, verify: str = "full"
    ) -> RankResult:
        receiver = Receiver(
            load_weights=self.model.load_weights,
            expected={meta.name: meta for meta in _metas(self.model)},
            rank=self.tp_rank,
            tp_size=self.tp_size,
        )
        source = open_source(
            "shm",
            msgspec.structs.replace(description, group=self.group),
            rank=self.tp_rank,
            tp_size=self.tp_size,
            direct=self.placement,
        )
        return receiver.receive(source, receive_order("shm", version=version, verify=verify))

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()


def _metas(model: LlamaForCausalLM):
    dtype = next(model.parameters()).dtype
    return [TensorMeta(n, dtype, s) for n, s in hf_weight_shapes(model.config).items()]


def _push(sink, ranks: list[_Rank], weights: dict, version: str, verify: str = "full", **stream):
    """Push to rank threads (`stream`: keyword arguments of the process's `Sending`); returns
    the session and the ranks' results.

    Raises:
        _StreamFailedError: the sink's stream raised (it carries the ranks' results).
    """
    factory = SessionFactory(64 * KiB)
    session = factory.session(
        normalize_weights(weights), version, None, receivers=len({r.group for r in ranks})
    )
    sending = factory.sending(list(weights.items()), **stream)
    description = sink.prepare(session, sending)
    results: dict[int, RankResult] = {}

    def run(index: int) -> None:
        results[index] = ranks[index].receive(description, version, verify)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ranks))]
    for thread in threads:
        thread.start()
    try:
        sink.stream(session, sending, TIMEOUT_S)
    except ValueError as exc:
        for thread in threads:
            thread.join(TIMEOUT_S)
        raise _StreamFailedError([results[i] for i in range(len(ranks))]) from exc
    for thread in threads:
        thread.join(TIMEOUT_S)
    return session, [results[i] for i in range(len(ranks))]


class _StreamFailedError(Exception):
    def __init__(self, results: list[RankResult]) -> None:
        super().__init__("the stream failed")
        self.results = results


@pytest.fixture
def config():
    config = tiny_config()
    config.num_key_value_heads = 1  # replicated KV heads at TP 2
    config.__post_init__()
    return config


def _ranks(config, layout: list[tuple[int, int]], *, arena: bool = True) -> list[_Rank]:
    """Ranks for engines given as `(group, tp_size)`."""
    return [
        _Rank(config, rank, tp_size, group, arena=arena)
        for group, tp_size in layout
        for rank in range(tp_size)
    ]


@pytest.mark.parametrize("verify", ["full", "none"])
def test_direct_push_fills_every_rank_of_two_engines_bit_exactly(config, verify):
    ranks = _ranks(config, [(0, 2), (1, 1)])
    sink = make_sink("shm")
    try:
        for seed in (1, 2):  # twice: the second push reuses the mapped layouts
            weights = dict(random_hf_weights(config, seed=seed))
            session, results = _push(sink, ranks, weights, f"v{seed}", verify)
            for rank, result in zip(ranks, results, strict=True):
                assert result.ok, result.errors
                assert result.touched
                assert result.fingerprint == session.fingerprint
                want = rank.expected(weights)
                for name, param in rank.model.named_parameters():
                    assert torch.equal(param.data, want[name]), name
                    assert param.data.data_ptr() == rank.arena.views[name].data_ptr()
        # every byte went straight to the parameters: no slot was even created
        assert sink.slots == []
        assert not list(SHM_DIR.glob(f"{SLOT_PREFIX}{os.getpid()}-*"))
    finally:
        sink.close()
        for rank in ranks:
            rank.close()


def test_a_rank_without_an_arena_makes_the_session_use_slots(config):
    ranks = [*_ranks(config, [(0, 1)]), *_ranks(config, [(1, 1)], arena=False)]
    sink = make_sink("shm")
    try:
        weights = dict(random_hf_weights(config, seed=5))
        _, results = _push(sink, ranks, weights, "v5")
        assert all(result.ok for result in results), [r.errors for r in results]
        assert any(int(slot.tensor.count_nonzero()) for slot in sink.slots)
        for rank in ranks:
            want = rank.expected(weights)
            for name, param in rank.model.named_parameters():
                assert torch.equal(param.data, want[name]), name
    finally:
        sink.close()
        for rank in ranks:
            rank.close()


def test_a_corrupted_slice_is_caught_by_the_rank(config, monkeypatch):
    from weightbus.core.transport.shm import direct as shm_direct

    original = shm_direct._write_tensor

    def corrupting(full, dests, *options):
        digest, slices = original(full, dests, *options)
        if full.dim() == 2 and dests:
            dests[0].region.view(np.uint8).reshape(-1)[0] ^= 0x10  # the rank's parameter
        return digest, slices

    monkeypatch.setattr(shm_direct, "_write_tensor", corrupting)
    ranks = _ranks(config, [(0, 1)])
    sink = make_sink("shm")
    try:
        _, (result,) = _push(sink, ranks, dict(random_hf_weights(config, seed=6)), "v6")
        assert not result.ok
        assert result.touched
        assert any(
            "slice written into this rank's parameters is corrupted" in e for e in result.errors
        )
    finally:
        sink.close()
        for rank in ranks:
            rank.close()


def test_a_corrupted_byte_in_a_slot_is_caught_by_the_rank(config, monkeypatch):
    original = DirectWriter.pack

    def corrupting(writer, buffer, bucket, tensors, hashers, **options):
        digests = original(writer, buffer, bucket, tensors, hashers, **options)
        if bucket.index == 3:  # after packing and digesting: a byte flips in shared memory
            entry = bucket.entries[0]
            buffer[entry.offset + entry.nbytes - 1] ^= 0x01
        return digests

    monkeypatch.setattr(DirectWriter, "pack", corrupting)
    ranks = _ranks(config, [(0, 1)], arena=False)
    sink = make_sink("shm")
    try:
        weights = dict(random_hf_weights(config, seed=8))
        _, (result,) = _push(sink, ranks, weights, "v8")
        assert sink.mode == "shm slots"
        assert not result.ok
        assert len(result.errors) == 1
        assert result.errors[0].startswith("digest mismatch for tensor ")
        assert result.errors[0].endswith(": its bytes are corrupted")
    finally:
        sink.close()
        for rank in ranks:
            rank.close()


def test_an_inconsistent_offer_falls_back_to_slots(config):
    from msgspec.structs import replace

    ranks = _ranks(config, [(0, 1)])
    target = ranks[0].placement.target
    # the first parameter claims to lie past the end of the file
    bad_region = replace(target.params[0], offset=target.nbytes)
    ranks[0].placement = type(ranks[0].placement)(
        replace(target, params=[bad_region, *target.params[1:]]), ranks[0].placement.regions
    )
    sink = make_sink("shm")
    try:
        weights = dict(random_hf_weights(config, seed=7))
        _, (result,) = _push(sink, ranks, weights, "v7")
        assert result.ok, result.errors
        assert any(int(slot.tensor.count_nonzero()) for slot in sink.slots)
    finally:
        sink.close()
        for rank in ranks:
            rank.close()


def test_arenas_are_private_and_removed(config):
    (rank,) = _ranks(config, [(0, 1)])
    path = SHM_DIR / rank.arena.name
    assert path.stat().st_mode & 0o777 == 0o600
    assert rank.arena.name.startswith(ARENA_PREFIX)
    rank.close()
    assert not path.exists()
    assert rank.arena.name not in remove_stale_slots()


def test_a_failing_publisher_aborts_the_ranks_at_once(config, monkeypatch):

    def failing(full, dests, *options):
        raise ValueError("disk on fire")

    monkeypatch.setattr(shm_direct, "_write_tensor", failing)
    ranks = _ranks(config, [(0, 2)])
    sink = make_sink("shm")
    try:
        with pytest.raises(_StreamFailedError) as failed:
            _push(sink, ranks, dict(random_hf_weights(config, seed=8)), "v8")
        assert str(failed.value.__cause__) == "disk on fire"
        for result in failed.value.results:
            assert not result.ok
            assert not result.timed_out  # told at once, not left to time out
            assert result.touched  # direct mode: the parameters may be half-written
            aborted = "the publisher aborted the session: publisher failed: ValueError"
            assert f"{aborted}: disk on fire" in result.errors[0]
    finally:
        sink.close()
        for rank in ranks:
            rank.close()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "slots"])
def test_nonfinite_values_stop_the_copies_and_abort_every_rank(config, direct):
    weights = dict(random_hf_weights(config, seed=9))
    last = min(weights, key=lambda name: weights[name].nbytes)
    weights[last] = weights.pop(last).clone()  # last in the plan, and the last copy to start
    weights[last].view(-1)[-1] = float("inf")
    ranks = _ranks(config, [(0, 2)], arena=direct)
    sink = make_sink("shm")
    try:
        with pytest.raises(_StreamFailedError) as failed:
            _push(sink, ranks, weights, "v9", refuse_nonfinite=True)
        assert sink.mode == ("shm direct" if direct else "shm slots")
        refused = failed.value.__cause__
        assert isinstance(refused, NonFiniteWeightsError)
        assert str(refused) == f"tensor {last!r} holds NaN or infinite values"
        for result in failed.value.results:
            assert not result.ok
            assert "publisher failed: NonFiniteWeightsError" in result.errors[0]
        # not asked to refuse them, the sink streams the same weights through
        session, _ = _push(sink, ranks, weights, "v9-allowed")
        assert set(session.digests) == set(weights)
    finally:
        sink.close()
        for rank in ranks:
            rank.close()


def test_a_failed_write_stops_every_copy_before_the_ranks_hear_of_it(config, monkeypatch):
    started, ended, done = [], [], []
    original = shm_direct._write_tensor

    def slow(full, dests, *options):
        started.append(full.shape)
        try:
            time.sleep(0.01)  # the failure lands while other copies wait to start
            result = original(full, dests, *options)
            done.append(full.shape)
            return result
        finally:
            ended.append(full.shape)

    monkeypatch.setattr(shm_direct, "_write_tensor", slow)
    weights = dict(random_hf_weights(config, seed=10))
    first = max(weights, key=lambda name: weights[name].nbytes)  # the first copy to start
    weights[first] = weights[first].clone()
    weights[first].view(-1)[0] = float("nan")
    ranks = _ranks(config, [(0, 1)])
    sink = make_sink("shm")
    try:
        with pytest.raises(_StreamFailedError) as failed:
            _push(sink, ranks, weights, "v10", refuse_nonfinite=True)
        assert isinstance(failed.value.__cause__, NonFiniteWeightsError)
        assert len(ended) == len(started)  # no copy was still running when the stream failed
        time.sleep(0.05)
        assert len(started) == len(ended) < len(weights)  # and none started since
        assert len(done) < len(weights) - 1  # the others stopped instead of finishing
    finally:
        sink.close()
        for rank in ranks:
            rank.close()


def test_no_byte_is_written_before_the_rank_confirms_direct_mode(config, monkeypatch):
    # a rank that got the header but whose confirmation is lost: the publisher must not write
    monkeypatch.setattr(ShmSource, "_confirm_direct", lambda source: None)
    [rank] = _ranks(config, [(0, 1)])
    before = {name: param.detach().clone() for name, param in rank.model.named_parameters()}
    sink = make_sink("shm")
    weights = dict(random_hf_weights(config, seed=9))
    try:
        factory = SessionFactory(64 * KiB)
        session = factory.session(normalize_weights(weights), "v9", None)
        sending = factory.sending(list(weights.items()))
        description = sink.prepare(session, sending)
        results = []
        receiving = threading.Thread(target=lambda: results.append(rank.receive(description, "v9")))
        receiving.start()
        with pytest.raises(TimeoutError, match="every rank to confirm direct mode"):
            sink.stream(session, sending, timeout_s=2.0)
        receiving.join(TIMEOUT_S)
        [result] = results
        assert not result.ok
        assert "the publisher aborted the session" in result.errors[0]
        for name, param in rank.model.named_parameters():
            assert_bit_identical(param.data, before[name])  # NaN payloads too
    finally:
        sink.close()
        rank.close()


def test_the_writer_splits_mixed_dtypes_by_rows_and_columns_bit_exactly():
    """Every dtype, 0-d and empty tensors, row and column slices into two 'ranks'."""
    weights = [
        *all_dtype_tensors(9),
        ("scalar", torch.tensor(3.5, dtype=torch.float32)),
        ("empty", torch.empty(0, 4, dtype=torch.bfloat16)),
        ("wide", random_tensor((40, 70_000), torch.bfloat16, 10)),  # > one 4 MiB chunk
    ]
    plan = plan_buckets(metas_of(weights), 64 * KiB)
    copies: list[list[tuple[str, str, ShardCopy]]] = [[], []]
    shapes: list[dict[str, tuple]] = [{}, {}]
    for name, tensor in weights:
        for rank in range(2):
            if tensor.dim() == 2 and tensor.shape[0] % 2 == 0 and tensor.numel():
                dim = 1 if name == "wide" else 0  # columns for one, rows for the others
                half = tensor.shape[dim] // 2
                shape = list(tensor.shape)
                shape[dim] = half
                copy = ShardCopy(dim, rank * half, dim, 0, half)
            else:
                shape, copy = list(tensor.shape), ShardCopy.whole(tuple(tensor.shape))
            shapes[rank][name] = tuple(shape)
            copies[rank].append((name, name, copy))
    dtypes = dict(weights)
    arenas = [
        ParamArena(
            (name, torch.empty(shape, dtype=dtypes[name].dtype, device="meta"))
            for name, shape in shapes[rank].items()
        )
        for rank in range(2)
    ]
    writer = DirectWriter(workers=2)
    try:
        targets = [
            MappedTarget(direct_placement(arenas[rank], copies[rank]).target, plan)
            for rank in range(2)
        ]
        written = dict(writer.write(plan, dict(weights), targets, time.monotonic() + TIMEOUT_S))
        digests = {name: d for bucket in written.values() for name, (d, _) in bucket.items()}
        assert digests == {name: tensor_digest(tensor) for name, tensor in weights}
        for rank in range(2):
            for name, copy in ((n, c) for n, _, c in copies[rank]):
                region = arenas[rank].views[name]
                assert_bit_identical(region, copy.source(dtypes[name]).contiguous())
                slices = next(b[name][1] for b in written.values() if name in b)
                assert slices[rank] == tensor_digest(region)
    finally:
        writer.close()
        for target in targets:
            target.close()
        for arena in arenas:
            arena.close()
