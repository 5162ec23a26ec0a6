"""Every decoder of untrusted bytes, fuzzed: it answers with its documented error or a value.

Untrusted input reaches weightbus as wire frames (ZMQ, the `dist` group), as the messages
between the API server and rank 0, as session descriptions in `POST /v1/update_weights`, as
files (the disk manifest and shards, Hugging Face checkpoints) and as ranks' direct-write
offers. Messages and descriptions are drawn from their own types (`msgspec_strategies`), so a
message type added later is fuzzed too; files get random bytes and mutations of valid ones.
Each decoder must raise only the error it documents (`ProtocolError`, `msgspec.DecodeError`,
`ValueError` naming the problem), never another exception, and return within the test's bound.
"""

import contextlib
import os
import secrets
import typing
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec_strategies import chaos, msgpack_frames, values_for
from safetensors.torch import save_file

from helpers import sending_of
from sessions import SessionFactory
from weightbus.core.meta import TensorMeta
from weightbus.core.plan import plan_buckets
from weightbus.core.transport import make_sink, open_source
from weightbus.core.transport.disk import (
    MANIFEST_NAME,
    DiskDescription,
    DiskManifest,
    DiskSource,
    read_manifest,
)
from weightbus.core.transport.distributed.slices import check_slices, rank_regions
from weightbus.core.transport.parts.arena import ParamArena
from weightbus.core.transport.parts.shared_memory import SHM_DIR, Slot
from weightbus.core.transport.shm.direct import MappedTarget
from weightbus.core.weights import normalize_weights
from weightbus.core.wire import PROTOCOL_VERSION, DirectTarget, Message, ProtocolError, decode
from weightbus.core.wire.messages import SliceSpec
from weightbus.engines.reference.engine import messages as engine_messages

FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FEW = settings(FUZZ, max_examples=50)
MESSAGE_TYPES = sorted(Message.registry)
TENSOR_NAMES = st.sampled_from(["w", "b", "emb.weight", "x"]) | st.text(min_size=1, max_size=8)


def _mutations(frame: bytes) -> st.SearchStrategy[bytes]:
    """`frame` cut short, or with some bytes overwritten."""
    if not frame:
        return st.just(frame)
    cut = st.integers(0, len(frame) - 1).map(lambda n: frame[:n])
    flips = st.lists(st.tuples(st.integers(0, len(frame) - 1), st.integers(0, 255)), max_size=4)
    return cut | flips.map(lambda edits: _overwrite(frame, edits))


def _overwrite(frame: bytes, edits: list[tuple[int, int]]) -> bytes:
    data = bytearray(frame)
    for position, value in edits:
        data[position] = value
    return bytes(data)


# --- wire messages (ZMQ, dist group, verdicts) ---


WIRE_FRAMES = {
    name: msgpack_frames(kind, prefix=[PROTOCOL_VERSION]) for name, kind in Message.registry.items()
}


@pytest.mark.parametrize("name", sorted(WIRE_FRAMES))
@FUZZ
@given(data=st.data())
def test_wire_frames_decode_or_raise_protocol_error(name: str, data: st.DataObject) -> None:
    frame = data.draw(WIRE_FRAMES[name])
    frame = data.draw(st.just(frame) | _mutations(frame))
    try:
        message = decode(frame)
    except ProtocolError:
        return
    assert isinstance(message, Message)
    assert decode(message.encode()) == message  # whatever decodes is a valid message


@FUZZ
@given(frame=msgpack_frames(typing.Any) | st.binary(max_size=64))
def test_anything_else_is_a_protocol_error(frame: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        assert isinstance(decode(frame), Message)


# --- API server <-> rank 0 ---

RANK0_FRAMES = [
    (decoder, member.__name__, msgpack_frames(member))
    for decoder, union in [
        (engine_messages.decode_to_engine, engine_messages.ToEngine),
        (engine_messages.decode_from_engine, engine_messages.FromEngine),
    ]
    for member in typing.get_args(union)
]


@pytest.mark.parametrize(
    ("decoder", "name", "frames"),
    RANK0_FRAMES,
    ids=[f"{d.__name__}-{n}" for d, n, _ in RANK0_FRAMES],
)
@FEW
@given(data=st.data())
def test_rank0_messages_decode_or_raise_decode_error(decoder, name: str, frames, data) -> None:
    frame = data.draw(frames)
    frame = data.draw(st.just(frame) | _mutations(frame))
    with contextlib.suppress(msgspec.DecodeError):
        decoder(frame)


@pytest.mark.parametrize(
    ("decoder", "message"),
    [
        (engine_messages.decode_to_engine, engine_messages.AbortRequest(request_id="x")),
        (
            engine_messages.decode_from_engine,
            engine_messages.RequestError(request_id="x", message="y"),
        ),
    ],
)
def test_invalid_utf8_in_a_rank0_message_is_a_decode_error(decoder, message) -> None:
    # msgspec raises UnicodeDecodeError for it; the loops of rank 0 and of the API server
    # catch DecodeError (the uncaught error stopped the worker, or the server's reader)
    frame = engine_messages.encode(message).replace(b"\xa1x", b"\xa1\xff")
    with pytest.raises(msgspec.DecodeError, match="invalid UTF-8 in a string"):
        decoder(frame)


# --- session descriptions (`source` of POST /v1/update_weights) ---


def _descriptions(keys: list[str]) -> st.SearchStrategy[object]:
    known = st.fixed_dictionaries({}, optional={key: chaos(json_only=True) for key in keys})
    return known | chaos(json_only=True)


DESCRIPTIONS = {
    "disk": _descriptions(["path"]),
    "dist": _descriptions(["group_name", "session_id", "mode", "prefetch_depth", "group"]),
    "hf_dir": _descriptions(["path", "version", "names", "digests", "fingerprint", "step"]),
    "shm": _descriptions(["endpoint", "session_id", "slots", "slot_bytes", "group"]),
}


@pytest.mark.parametrize("transport", sorted(DESCRIPTIONS))
@FUZZ
@given(data=st.data())
def test_descriptions_open_or_raise_value_error(transport: str, data: st.DataObject) -> None:
    description = data.draw(DESCRIPTIONS[transport])
    try:
        source = open_source(transport, description)
    except ValueError:
        return
    source.close()


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("ipc://" + "x" * 300, "cannot be connected: File name too long"),
        ("ipc://", "cannot be connected: Invalid argument"),
        ("tcp://10.0.0.1:5", "shm endpoint must be an ipc:// address"),
    ],
    ids=["too long", "empty", "tcp"],
)
def test_shm_endpoints_that_cannot_be_connected_are_value_errors(endpoint: str, message: str):
    slots = ["weightbus-shm-1-0000000000000000-0", "weightbus-shm-1-0000000000000000-1"]
    description = {"session_id": "ab" * 16, "slots": slots, "slot_bytes": 4096}
    with pytest.raises(ValueError, match=message):
        open_source("shm", {**description, "endpoint": endpoint})


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("weightbus-shm-" + "x" * 300, "cannot open shared-memory file weightbus-shm-x+: File"),
        ("weightbus-shm-\x00", "'weightbus-shm-\\\\x00' is not a weightbus shared-memory file"),
    ],
    ids=["too long", "nul"],
)
def test_slot_names_that_cannot_be_files_are_value_errors(name: str, message: str) -> None:
    # the names a description gives are mapped when the session begins (`ShmSource.begin`)
    with pytest.raises(ValueError, match=message):
        Slot.open(name, 4096)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (Path.mkdir, "Is a directory"),
        (lambda path: path.symlink_to("/dev/null"), "Too many levels of symbolic links"),
    ],
    ids=["directory", "link"],
)
def test_slots_that_are_not_plain_files_are_refused(make, reason: str) -> None:
    name = f"weightbus-shm-{os.getpid()}-{secrets.token_hex(8)}-0"
    make(SHM_DIR / name)
    try:
        with pytest.raises(ValueError, match=f"cannot open shared-memory file {name}: {reason}"):
            Slot.open(name, 4096)
    finally:
        path = SHM_DIR / name
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()


# --- the disk transport's files ---


@pytest.fixture(scope="module")
def disk_session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid session directory written by the disk sink."""
    weights = [("w", torch.arange(12.0).reshape(3, 4)), ("b", torch.ones(5, dtype=torch.int8))]
    sink = make_sink("disk", root=tmp_path_factory.mktemp("disk"))
    session = SessionFactory(4096).session(normalize_weights(weights), "v1", step=None)
    return Path(sink.prepare(session, sending_of(weights)).path)


def _read_session(directory: Path) -> None:
    source = DiskSource(DiskDescription(path=str(directory)))
    source.begin(timeout_s=1.0)
    for batch in source.batches(timeout_s=1.0):
        batch.release()
    source.end(timeout_s=1.0)


MANIFESTS = values_for(DiskManifest, json_only=True).map(msgspec.json.encode)


@FUZZ
@given(data=st.data())
def test_manifests_read_or_raise_value_error(disk_session: Path, data) -> None:
    valid = (disk_session / MANIFEST_NAME).read_bytes()
    manifest = data.draw(_mutations(valid) | MANIFESTS | st.binary(max_size=64))
    directory = disk_session.parent / "fuzzed"
    directory.mkdir(exist_ok=True)
    (directory / MANIFEST_NAME).write_bytes(manifest)
    with contextlib.suppress(ValueError):
        read_manifest(directory)


@FEW
@given(data=st.data())
def test_shards_read_or_raise_value_error(disk_session: Path, data) -> None:
    directory = disk_session.parent / "fuzzed-shards"
    directory.mkdir(exist_ok=True)
    (directory / MANIFEST_NAME).write_bytes((disk_session / MANIFEST_NAME).read_bytes())
    for shard in sorted(disk_session.glob("*.safetensors")):
        valid = shard.read_bytes()
        (directory / shard.name).write_bytes(data.draw(_mutations(valid) | st.binary()))
    with contextlib.suppress(ValueError):
        _read_session(directory)


# --- Hugging Face checkpoint directories (hf_dir) ---


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("hf") / "model.safetensors"
    save_file({"w": torch.zeros(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}, str(path))
    return path.read_bytes()


INDEXES = st.fixed_dictionaries(
    {"weight_map": values_for(dict[str, str], json_only=True) | chaos(json_only=True)}
) | chaos(json_only=True)
NAMES = st.fixed_dictionaries({}, optional={"names": st.lists(TENSOR_NAMES) | chaos(True)})


@FEW
@given(data=st.data())
def test_checkpoint_headers_read_or_raise_value_error(
    checkpoint: bytes, tmp_path_factory: pytest.TempPathFactory, data
) -> None:
    directory = tmp_path_factory.getbasetemp() / "hf-fuzzed"
    directory.mkdir(exist_ok=True)
    (directory / "model.safetensors").write_bytes(data.draw(_mutations(checkpoint)))
    index = directory / "model.safetensors.index.json"
    index.unlink(missing_ok=True)
    if data.draw(st.booleans()):
        index.write_bytes(msgspec.json.encode(data.draw(INDEXES)))
    description = {"path": str(directory), "version": "v"}
    description |= data.draw(NAMES)
    with contextlib.suppress(ValueError):
        open_source("hf_dir", description).begin(timeout_s=1.0)


# --- direct-write offers of engine ranks (read by the publisher) ---


@pytest.fixture(scope="module")
def arena() -> ParamArena:
    owned = ParamArena([("w", torch.zeros(4, 8)), ("b", torch.zeros(8, dtype=torch.bfloat16))])
    yield owned
    owned.close()


OFFERS = values_for(DirectTarget)


@FUZZ
@given(data=st.data())
def test_direct_offers_map_or_raise_value_error(arena: ParamArena, data) -> None:
    offer = data.draw(OFFERS)
    if isinstance(offer, dict):  # aim most offers at the real file, so the layout is checked
        offer |= data.draw(
            st.fixed_dictionaries(
                {}, optional={"file": st.just(arena.name), "nbytes": st.just(arena.nbytes)}
            )
        )
    try:
        target = msgspec.convert(offer, DirectTarget)
    except msgspec.ValidationError:
        return  # the wire decoder refuses it before the publisher sees it
    plan = plan_buckets(arena_metas(), bucket_bytes=4096)
    try:
        mapped = MappedTarget(target, plan)
    except ValueError:
        return
    mapped.close()


def arena_metas() -> list[TensorMeta]:
    """The tensors of the fuzzed plans: the arena's parameters, as full tensors."""
    return [TensorMeta("w", torch.float32, (4, 8)), TensorMeta("b", torch.bfloat16, (8,))]


# --- a rank's slice map in a dist group (read by the publisher) ---


@FUZZ
@given(
    slices=st.lists(values_for(SliceSpec).filter(lambda v: isinstance(v, list)), max_size=4),
    data=st.data(),
)
def test_slice_maps_are_checked_before_use(slices: list, data) -> None:
    specs = []
    for value in slices:
        with contextlib.suppress(msgspec.ValidationError):
            specs.append(msgspec.convert(value, SliceSpec))
    metas = arena_metas()
    by_name = {spec.name: spec for spec in specs}
    if data.draw(st.booleans()):  # slices of the tensors the push carries
        by_name = {meta.name: SliceSpec(meta.name, *data.draw(_spec_numbers())) for meta in metas}
    try:
        check_slices(by_name, {meta.name: meta.shape for meta in metas})
    except ValueError:
        return
    plan = plan_buckets(metas, bucket_bytes=256)
    for bucket in plan.buckets:
        buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        for region in rank_regions(bucket, buffer, by_name):
            assert region.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def _spec_numbers() -> st.SearchStrategy[tuple[int, int, int]]:
    return st.tuples(st.integers(0, 2), st.integers(0, 9), st.integers(0, 9))
