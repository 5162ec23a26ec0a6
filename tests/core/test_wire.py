import ast
import contextlib
import os
import pickle
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import weightbus
from weightbus.core.meta import DTYPES_BY_NAME, TensorMeta
from weightbus.core.plan import plan_buckets
from weightbus.core.wire import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    BucketReady,
    DirectReady,
    ErrorReply,
    Message,
    ProtocolError,
    RankVerdict,
    SlotAck,
    UpdateAbort,
    UpdateBegin,
    UpdateCommit,
    UpdateEnd,
    WireEntry,
    WireMeta,
    decode,
)

hex128 = st.binary(min_size=16, max_size=16).map(bytes.hex)
names = st.text(min_size=1, max_size=40)
small = st.integers(0, 2**40)
versions = st.text(min_size=1, max_size=30)


@st.composite
def wire_entries(draw):
    count = draw(st.integers(0, 6))
    entries, offset = [], 0
    for i in range(count):
        nbytes = draw(st.integers(0, 5000))
        entries.append(
            WireEntry(
                f"{draw(names)}.{i}",
                draw(st.sampled_from(list(DTYPES_BY_NAME))),
                tuple(draw(st.lists(st.integers(0, 9), max_size=4))),
                offset,
                nbytes,
                draw(small),
            )
        )
        offset += nbytes + draw(st.integers(0, 300))
    return entries


messages = st.one_of(
    st.builds(
        UpdateBegin,
        session_id=hex128,
        version=versions,
        step=st.none() | small,
        plan_hash=hex128,
        bucket_bytes=st.integers(1, 2**40),
        tensors=st.lists(
            st.builds(
                WireMeta,
                names,
                st.sampled_from(list(DTYPES_BY_NAME)),
                st.lists(st.integers(0, 9), max_size=4).map(tuple),
            ),
            min_size=1,
            max_size=5,
            unique_by=lambda meta: meta.name,
        ),
    ),
    st.builds(
        BucketReady,
        session_id=hex128,
        bucket_index=small,
        slot=small,
        entries=wire_entries(),
        digests=st.dictionaries(names, hex128, max_size=4),
    ),
    st.builds(SlotAck, session_id=hex128, bucket_index=small, slot=small, rank=small),
    st.builds(DirectReady, session_id=hex128, group=small, rank=small),
    st.builds(
        UpdateEnd, session_id=hex128, version=versions, num_buckets=small, fingerprint=hex128
    ),
    st.builds(
        RankVerdict,
        session_id=hex128,
        rank=small,
        ok=st.booleans(),
        errors=st.lists(st.text(max_size=50), max_size=3),
        fingerprint=st.none() | hex128,
        nbytes=small,
    ),
    st.builds(UpdateCommit, session_id=hex128, version=versions, fingerprint=hex128),
    st.builds(UpdateAbort, session_id=hex128, reason=st.text(max_size=100)),
    st.builds(
        ErrorReply,
        code=st.text(min_size=1, max_size=20),
        message=st.text(max_size=100),
        names=st.lists(names, max_size=3),
    ),
)


@settings(max_examples=300, deadline=None)
@given(message=messages)
def test_every_message_round_trips(message):
    frame = message.encode()
    assert decode(frame) == message
    assert type(message).decode(frame) == message


@settings(max_examples=2000, deadline=None)
@given(data=st.binary(max_size=512))
def test_random_bytes_raise_only_protocol_error(data):
    with contextlib.suppress(ProtocolError):
        decode(data)


@settings(max_examples=300, deadline=None)
@given(message=messages, data=st.data())
def test_truncated_or_corrupted_frames_raise_protocol_error(message, data):
    frame = bytearray(message.encode())
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(ProtocolError):
        decode(bytes(frame[:cut]))
    position = data.draw(st.integers(0, len(frame) - 1))
    frame[position] = data.draw(st.integers(0, 255))
    try:
        decoded = decode(bytes(frame))
    except ProtocolError:
        return
    assert isinstance(decoded, Message)


def test_entries_round_trip_from_a_plan():
    plan = plan_buckets([TensorMeta("w", DTYPES_BY_NAME["bfloat16"], (700, 3))], bucket_bytes=1024)
    entries = [WireEntry.of(e) for e in plan.buckets[1].entries]
    message = BucketReady(session_id="ab" * 16, bucket_index=1, slot=0, entries=entries)
    assert [e.to_entry() for e in BucketReady.decode(message.encode()).entries] == list(
        plan.buckets[1].entries
    )


def _frame(body, version=PROTOCOL_VERSION):
    return msgspec.msgpack.encode([version, body])


ACK = {"type": "SlotAck", "session_id": "ab" * 16, "bucket_index": 0, "slot": 1, "rank": 0}


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (
            _frame(ACK, version=PROTOCOL_VERSION + 1),
            f"protocol version {PROTOCOL_VERSION + 1} is not supported",
        ),
        (_frame({**ACK, "type": "Shutdown"}), "invalid message: Invalid value 'Shutdown'"),
        (_frame({**ACK, "slot": -1}), r"Expected `int` >= 0 - at `\$.slot`"),
        (_frame({**ACK, "rank": "0"}), r"Expected `int`, got `str` - at `\$.rank`"),
        (_frame({**ACK, "session_id": "xyz"}), r"at `\$.session_id`"),
        (_frame({**ACK, "extra": 1}), "unknown field `extra`"),
        (_frame({k: v for k, v in ACK.items() if k != "rank"}), "missing required field `rank`"),
        (msgspec.msgpack.encode({"version": 1}), "malformed message frame"),
        (b"", "malformed message frame"),
        (
            _frame(
                {
                    "type": "BucketReady",
                    "session_id": "ab" * 16,
                    "bucket_index": 2,
                    "slot": 0,
                    "entries": [["a", "float32", [4], 0, 16], ["b", "float32", [4], 8, 16]],
                }
            ),
            "bucket 2: entries overlap at byte 8",
        ),
        (
            _frame(
                {
                    "type": "BucketReady",
                    "session_id": "ab" * 16,
                    "bucket_index": 0,
                    "slot": 0,
                    "entries": [["a", "float7", [4], 0, 16]],
                }
            ),
            r"at `\$.entries\[0\]\[1\]`",
        ),
    ],
    ids=[
        "version",
        "unknown type",
        "negative",
        "wrong type",
        "bad session id",
        "unknown field",
        "missing field",
        "not a frame",
        "empty",
        "overlap",
        "bad dtype",
    ],
)
def test_invalid_frames_are_named(frame, message):
    with pytest.raises(ProtocolError, match=message):
        decode(frame)


def test_wrong_message_type_is_named():
    frame = SlotAck(session_id="ab" * 16, bucket_index=0, slot=0, rank=3).encode()
    with pytest.raises(ProtocolError, match="expected a BucketReady message, got SlotAck"):
        BucketReady.decode(frame)


def test_oversized_message_is_rejected_before_decoding():
    with pytest.raises(ProtocolError, match=f"exceeds the limit of {MAX_MESSAGE_BYTES} bytes"):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))


def test_non_bytes_input_is_rejected():
    with pytest.raises(ProtocolError, match="a message must be bytes, got str"):
        decode("not bytes")


class _Exploit:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_malicious_pickle_executes_nothing(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Exploit(marker))
    for frame in (
        payload,
        _frame(payload),
        msgspec.msgpack.encode([PROTOCOL_VERSION, {"type": "SlotAck", "pickle": payload}]),
    ):
        with pytest.raises(ProtocolError):
            decode(frame)
    assert not marker.exists()


# Loaders that can run code from the bytes they read. None may appear in the package, except
# the pickling baseline that `weightbus bench` measures (it reads only its own children's queues).
_FORBIDDEN_MODULES = frozenset(
    {
        "pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve",
        "jsonpickle", "joblib", "copyreg", "multiprocessing", "torch.multiprocessing",
    }
)  # fmt: skip
_FORBIDDEN_CALLS = frozenset(
    {
        # builtins (called by name: `model.eval()` is a method)
        "eval", "exec", "compile", "__import__",
        # deserialisers that unpickle or construct arbitrary objects
        "pickle.load", "pickle.loads", "marshal.load", "marshal.loads", "torch.load",
        "torch.jit.load", "yaml.load", "yaml.load_all", "yaml.unsafe_load",
        "yaml.unsafe_load_all", "yaml.full_load", "yaml.full_load_all", "pandas.read_pickle",
        "pd.read_pickle",
    }
)  # fmt: skip
# methods that pickle whatever object they carry (ZMQ, torch.distributed object collectives)
_FORBIDDEN_METHODS = frozenset(
    {
        "recv_pyobj", "send_pyobj", "ForkingPickler", "Unpickler", "broadcast_object_list",
        "all_gather_object", "gather_object", "scatter_object_list", "send_object_list",
        "recv_object_list", "read_pickle",
    }
)  # fmt: skip
_EXEMPT = {("apps/bench/baselines.py", "torch.multiprocessing")}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _code_executing(source: str) -> list[str]:
    """What in `source` could run code from the bytes it reads (imports, calls, keywords)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name in _FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            if node.module in _FORBIDDEN_MODULES:
                found.append(node.module)
            found += [name for name in names if name in _FORBIDDEN_CALLS | _FORBIDDEN_MODULES]
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in _FORBIDDEN_CALLS or name.rsplit(".", 1)[-1] in _FORBIDDEN_METHODS:
                found.append(name)
            found += [
                f"{name}(allow_pickle=True)"
                for keyword in node.keywords
                if keyword.arg == "allow_pickle"
                and not (isinstance(keyword.value, ast.Constant) and keyword.value.value is False)
            ]
    return found


@pytest.mark.parametrize(
    "source",
    [
        "import pickle",
        "import os, dill",
        "from pickle import loads",
        "from torch import load",
        "import torch.multiprocessing as mp",
        "obj = pickle.loads(data)",
        "value = eval(text)",
        "exec(code)",
        "state = torch.load(path, weights_only=True)",
        "arrays = np.load(path, allow_pickle=True)",
        "config = yaml.load(text, Loader=yaml.Loader)",
        "config = yaml.unsafe_load(text)",
        "obj = socket.recv_pyobj()",
        "dist.broadcast_object_list(objects, src=0)",
        "frame = pandas.read_pickle(path)",
    ],
)
def test_the_scan_finds_code_executing_decoders(source):
    assert _code_executing(source) != []


def test_the_scan_lets_safe_code_through():
    safe = "model.eval()\npattern = re.compile(text)\nx = np.load(path)\nm = msgspec.json.decode(b)"
    assert _code_executing(safe) == []


def test_no_code_executing_decoder_in_the_package():
    package = Path(weightbus.__file__).parent
    hits = [
        f"{path.relative_to(package)}: {name}"
        for path in sorted(package.rglob("*.py"))
        for name in _code_executing(path.read_text())
        if (str(path.relative_to(package)), name) not in _EXEMPT
    ]
    assert hits == []
