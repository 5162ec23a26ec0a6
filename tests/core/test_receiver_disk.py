"""The disk transport end to end through the Receiver, on real files."""

import json
from pathlib import Path

import pytest
import torch

from helpers import TensorDictTarget, assert_bit_identical, random_tensor, receive_order, sending_of
from sessions import SessionFactory
from weightbus.core.digest import fingerprint
from weightbus.core.receiver import Receiver
from weightbus.core.transport import make_sink, open_source
from weightbus.core.transport.disk import MANIFEST_NAME
from weightbus.core.weights import normalize_weights

KiB = 1024


def _weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    return [
        ("embed.weight", random_tensor((64, 16), torch.bfloat16, seed)),
        ("layer.0.weight", random_tensor((40, 16), torch.float32, seed + 1)),
        ("layer.0.bias", random_tensor((40,), torch.float32, seed + 2)),
        ("scale", random_tensor((), torch.float64, seed + 3)),
        ("mask", random_tensor((5, 3), torch.bool, seed + 4)),
    ]


def _target() -> TensorDictTarget:
    return TensorDictTarget({name: torch.zeros_like(t) for name, t in _weights()})


def _push(tmp_path: Path, weights, version: str = "v1", bucket_bytes: int = 2 * KiB):
    sink = make_sink("disk", root=tmp_path / "sessions")
    session = SessionFactory(bucket_bytes).session(normalize_weights(weights), version, step=None)
    return sink, session, sink.prepare(session, sending_of(weights))


def _receive(description: dict, target: TensorDictTarget, rank: int = 0, tp_size: int = 1, **kw):
    receiver = Receiver(
        load_weights=target.load_weights, expected=target.expected(), rank=rank, tp_size=tp_size
    )
    return receiver.receive(
        open_source("disk", description), receive_order("disk", **{"version": "v1", **kw})
    )


def test_push_through_disk_is_bit_exact_and_fingerprints_agree(tmp_path):
    weights = _weights(seed=5)
    _, session, description = _push(tmp_path, weights)
    target = _target()
    result = _receive(description, target, plan_hash=session.plan.plan_hash)
    assert result.ok, result.errors
    for name, tensor in weights:
        assert_bit_identical(target.tensors[name], tensor)
    assert result.fingerprint == session.fingerprint == fingerprint(weights)
    assert result.nbytes == sum(t.nbytes for _, t in weights)
    assert {"wait_s", "verify_s", "load_s", "total_s"} <= set(result.phases)


def test_session_directory_is_complete_or_absent_and_old_sessions_are_removed(tmp_path):
    sink, _, first = _push(tmp_path, _weights())
    session = SessionFactory(2 * KiB).session(normalize_weights(_weights(1)), "v2", step=3)
    second = sink.prepare(session, sending_of(_weights(1)))
    assert not Path(first.path).exists()
    entries = sorted(p.name for p in (tmp_path / "sessions").iterdir())
    assert entries == [Path(second.path).name]
    assert (Path(second.path) / MANIFEST_NAME).exists()
    sink.close()
    assert list((tmp_path / "sessions").iterdir()) == []


def _corrupt_one_byte(directory: Path, tensor_name: str) -> None:
    for shard in directory.glob("shard-*.safetensors"):
        data = bytearray(shard.read_bytes())
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
        if tensor_name in header:
            start = 8 + header_len + header[tensor_name]["data_offsets"][0]
            data[start] ^= 0x01
            shard.write_bytes(bytes(data))
            return
    raise AssertionError(f"{tensor_name} not found")


@pytest.mark.parametrize("tp_size", [1, 2])
def test_corrupted_byte_is_caught_by_exactly_one_rank(tmp_path, tp_size):
    weights = _weights()
    _, _, description = _push(tmp_path, weights)
    _corrupt_one_byte(Path(description.path), "layer.0.weight")
    verdicts = [_receive(description, _target(), rank, tp_size) for rank in range(tp_size)]
    failing = [v for v in verdicts if not v.ok]
    assert len(failing) == 1
    assert failing[0].errors == [
        "digest mismatch for tensor 'layer.0.weight': its bytes are corrupted"
    ]
    assert failing[0].bad_names == ["layer.0.weight"]


def test_verify_none_skips_digests_only(tmp_path):
    _, _, description = _push(tmp_path, _weights())
    _corrupt_one_byte(Path(description.path), "embed.weight")
    assert _receive(description, _target(), verify="none").ok
    assert not _receive(description, _target(), verify="full").ok


def test_truncated_shard_is_an_error(tmp_path):
    _, _, description = _push(tmp_path, _weights())
    shard = min(Path(description.path).glob("shard-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-10])
    result = _receive(description, _target())
    assert not result.ok
    assert result.errors[0].startswith(f"cannot read shard {shard.name}")


def _rewrite_manifest(description: dict, edit) -> None:
    path = Path(description.path) / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def test_manifest_lying_about_a_shape_is_caught(tmp_path):
    _, _, description = _push(tmp_path, _weights())

    def lie(manifest):
        for meta in manifest["begin"]["tensors"]:
            if meta[0] == "layer.0.bias":
                meta[2] = [41]

    _rewrite_manifest(description, lie)
    result = _receive(description, _target())
    assert not result.ok
    assert "stream plan hash" in result.errors[0]
    assert "tensor 'layer.0.bias': expected float32[40], got float32[41]" in result.errors


def test_manifest_lying_about_a_digest_is_caught(tmp_path):
    _, _, description = _push(tmp_path, _weights())
    _rewrite_manifest(description, lambda m: m["digests"].update({"scale": "0" * 32}))
    result = _receive(description, _target())
    assert result.errors == ["digest mismatch for tensor 'scale': its bytes are corrupted"]


def test_invalid_manifest_is_named(tmp_path):
    _, _, description = _push(tmp_path, _weights())
    (Path(description.path) / MANIFEST_NAME).write_text('{"format": 1, "begin": 7}')
    result = _receive(description, _target())
    assert not result.ok
    assert result.errors[0].startswith("invalid manifest")


def test_stream_version_must_equal_requested_version(tmp_path):
    _, _, description = _push(tmp_path, _weights(), version="step-7")
    result = _receive(description, _target(), version="step-8")
    assert result.errors == ["stream version 'step-7' != requested 'step-8'"]


def test_stale_plan_hash_is_rejected(tmp_path):
    _, _, description = _push(tmp_path, _weights())
    result = _receive(description, _target(), plan_hash="f" * 32)
    assert not result.ok
    assert result.errors[0].startswith("stale plan: stream has ")


@pytest.mark.parametrize(
    ("edit", "message", "names"),
    [
        (
            lambda w: [*w, ("extra.weight", torch.zeros(2))],
            "unknown tensors: ['extra.weight']",
            ["extra.weight"],
        ),
        (lambda w: w[1:], "missing tensors: ['embed.weight']", ["embed.weight"]),
        (
            lambda w: [(n, t.float() if n == "embed.weight" else t) for n, t in w],
            "tensor 'embed.weight': expected bfloat16[64, 16], got float32[64, 16]",
            ["embed.weight"],
        ),
        (
            lambda w: [(n, t[:-1] if n == "layer.0.bias" else t) for n, t in w],
            "tensor 'layer.0.bias': expected float32[40], got float32[39]",
            ["layer.0.bias"],
        ),
    ],
    ids=["unknown", "missing", "wrong dtype", "wrong shape"],
)
def test_layout_mismatches_name_the_tensors_and_change_nothing(tmp_path, edit, message, names):
    _, _, description = _push(tmp_path, edit(_weights(seed=9)))
    target = _target()
    before = {name: t.clone() for name, t in target.tensors.items()}
    result = _receive(description, target)
    assert result.errors == [message]
    assert result.bad_names == names
    for name, tensor in before.items():
        assert_bit_identical(target.tensors[name], tensor)


def test_tied_weights_are_sent_once():
    embed = torch.randn(8, 4)
    normalized = normalize_weights(
        {"embed.weight": embed, "lm_head.weight": embed, "norm": torch.ones(4)}
    )
    assert [name for name, _ in normalized] == ["embed.weight", "norm"]


def test_a_draft_sharing_a_tensor_with_the_main_model_gets_its_own_copy():
    embed = torch.randn(8, 4)
    weights = {
        "embed.weight": embed,
        "lm_head.weight": embed,
        "draft.embed.weight": embed,
        "draft.lm_head.weight": embed,
    }
    normalized = normalize_weights(weights)
    assert [name for name, _ in normalized] == ["embed.weight", "draft.embed.weight"]


def test_name_map_renames_and_drops():
    weights = {"a": torch.ones(1), "b": torch.ones(2), "c": torch.ones(3)}
    normalized = normalize_weights(weights, name_map={"a": "model.a", "b": None})
    assert [name for name, _ in normalized] == ["model.a", "c"]
    with pytest.raises(ValueError, match="duplicate tensor name 'c'"):
        normalize_weights(weights, name_map=lambda n: "c")
    with pytest.raises(TypeError, match="weight 'x' is a list, not a tensor"):
        normalize_weights([("x", [1, 2])])
