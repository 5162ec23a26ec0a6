"""The transport registry: a transport defined outside weightbus (`loopback_transport.py`) is
one module plus one `TransportEntry`, registered in-process or through an entry point; a push
travels through it like through any built-in one, and its rank set-up reaches every rank of a
real `weightbus serve` through the engine's generic route."""

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_harness import ServedEngine

from helpers import MirrorTarget, all_dtype_tensors, assert_bit_identical
from loopback_transport import ENTRY
from weightbus import Publisher
from weightbus.core import transport as registry
from weightbus.core.transport import open_source, register_transport, transport_names
from weightbus.core.wire import ProtocolError

BUILT_IN = ["disk", "dist", "hf_dir", "nixl", "shm"]
TESTS_DIR = Path(__file__).resolve().parents[1]  # where loopback_transport.py lives


def _install_plugins(site: Path, *lines: str) -> None:
    """An installed package's metadata in `site`, as pip writes it, naming transport plugins."""
    info = site / "weightbus_loopback-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: weightbus-loopback\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text("[weightbus.transports]\n" + "".join(lines))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedEngine]:
    """`weightbus serve --tp 2` with the loopback plugin installed (an entry point): its server
    and both ranks find the transport; weightbus itself is as shipped."""
    site = tmp_path_factory.mktemp("site")
    _install_plugins(site, "loopback = loopback_transport:ENTRY\n")
    python_path = [str(site), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, python_path)))
        served = ServedEngine("--tp", "2", log_path=tmp_path_factory.mktemp("log") / "serve.log")
    yield served
    served.stop()


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry as shipped, restored after the test (entry points looked up again)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_plugins_loaded", False)


def _push_through(transport: str) -> None:
    weights = all_dtype_tensors(seed=3)
    mirror = MirrorTarget("mirror://loopback", {n: torch.zeros_like(t) for n, t in weights})
    with Publisher([mirror], transport=transport, bucket_bytes=4096) as pub:
        # random bit patterns, NaN payloads included: carried bit-exactly when allowed
        result = pub.push(weights, version="v1", allow_nonfinite=True)
        assert result.fingerprint == pub.fingerprint(weights)
    assert result.mode == "loopback"
    assert mirror.fingerprint == result.fingerprint
    for name, tensor in weights:
        assert_bit_identical(mirror.target.tensors[name], tensor)


def test_a_transport_registered_in_process_carries_a_push(clean_registry):
    register_transport("loopback", ENTRY)
    assert transport_names() == sorted([*BUILT_IN, "loopback"])
    _push_through("loopback")


def test_a_transport_plugin_is_found_through_its_entry_point(
    clean_registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
):
    # two plugins, one of them broken
    _install_plugins(
        tmp_path, "loopback = loopback_transport:ENTRY\n", "broken = no_such_module_here:ENTRY\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="weightbus.core.transport"):
        assert transport_names() == sorted([*BUILT_IN, "loopback"])
    assert "transport plugin 'broken' not registered: No module named" in caplog.text
    _push_through("loopback")


def test_a_plugin_description_is_decoded_by_the_registry(clean_registry):
    register_transport("loopback", ENTRY)
    with pytest.raises(ProtocolError, match=r"Expected `str`, got `int` - at `source.session_id`"):
        open_source("loopback", {"session_id": 3})
    with pytest.raises(ProtocolError, match=r"loopback source: Object contains unknown field `x`"):
        open_source("loopback", {"session_id": "ab" * 16, "x": 1})


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("shm", "transport 'shm' is already registered"),
        ("Loop-back", "transport name 'Loop-back': use 1-32 of \\[a-z0-9_\\]"),
        ("", "transport name '': use 1-32 of"),
    ],
    ids=["taken", "bad characters", "empty"],
)
def test_register_refuses_taken_and_malformed_names(clean_registry, name, message):
    with pytest.raises(ValueError, match=message):
        register_transport(name, ENTRY)
    assert transport_names() == BUILT_IN


def test_a_plugin_rank_setup_reaches_every_rank_of_a_served_engine(
    clean_registry, engine: ServedEngine, tmp_path: Path
):
    register_transport("loopback", ENTRY)
    with Publisher([engine.url], transport="loopback") as pub:
        pub.setup_transport(directory=str(tmp_path))
        written = {path.name: int(path.read_text()) for path in tmp_path.iterdir()}
        assert sorted(written) == ["rank0-of-2", "rank1-of-2"]
        assert all(count > 0 for count in written.values())  # each rank's slices
        pub.teardown_transport()
    assert list(tmp_path.iterdir()) == []
