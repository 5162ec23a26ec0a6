"""Security properties, observed on real processes and real objects.

A real engine (TP 2: its ranks talk to each other) receives a push through every transport
(`shm` direct and slots, `disk`, `hf_dir`, `dist` on a loopback weights group). While each
publisher is open, the test records every socket the engine's processes and this (publisher)
process hold, read from /proc, and every /dev/shm object named after one of them. Then:

- every TCP/UDP socket is on a loopback address (nobody configured another);
- every unix socket (ZMQ `ipc://`) lies in a 0700 directory of this user;
- every shared-memory object is 0600 (a directory: 0700 all the way down) and its name holds
  64 random bits after the owner's pid.

The token comparison is checked on the code: only `compare_digest` reads the token.
"""

import ast
import os
import re
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from endpoints import OpenSocket, is_loopback, open_sockets
from engine_harness import ServedEngine

import weightbus.engines.reference.server.auth
from weightbus import Publisher
from weightbus.core.transport.parts.shared_memory import SHM_DIR
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import random_hf_weights

# weightbus-<kind>-<owner pid>-<64 random bits>[-<more>]
SHM_NAME = re.compile(r"weightbus-(?P<kind>[a-z-]+?)-(?P<pid>\d+)-(?P<random>[0-9a-f]{16})(-.+)?")
PUSHES = [
    ("shm", {}),
    ("shm", {"direct": False}),
    ("disk", {}),
    ("hf_dir", {}),
    ("dist", {}),
    ("nixl", {}),
]


@dataclass(slots=True)
class Observation:
    """What the processes held while publishers were open."""

    sockets: set[OpenSocket] = field(default_factory=set)
    socket_dirs: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> mode, uid
    shm_objects: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # name -> modes
    modes: list[str] = field(default_factory=list)  # how each push travelled

    def record(
        self, pids: list[int], sink_root: Path | None, before: set[OpenSocket] = frozenset()
    ) -> None:
        """Record the sockets of `pids` but those in `before` (this test process's, opened
        by earlier tests), and the /dev/shm objects named after them or that are the
        publisher's sink directory (other processes on the host are left out)."""
        for sock in set(open_sockets(pids)) - before:
            self.sockets.add(sock)
            if sock.table == "unix" and sock.address.startswith("/"):
                directory = Path(sock.address).parent.stat()
                self.socket_dirs[sock.address] = (stat.S_IMODE(directory.st_mode), directory.st_uid)
        ours = [
            path
            for path in SHM_DIR.glob("weightbus-*")
            if (match := SHM_NAME.fullmatch(path.name)) and int(match["pid"]) in pids
        ]
        if sink_root is not None and sink_root.parent == SHM_DIR:
            ours.append(sink_root)
        for path in ours:
            self.shm_objects[path.name] = _tree_modes(path)


def _tree_modes(path: Path) -> list[tuple[str, int]]:
    """(relative path, mode) of `path` and, for a directory, of everything under it."""
    found = [(".", path.lstat().st_mode)]
    if path.is_dir():
        found += [(str(p.relative_to(path)), p.lstat().st_mode) for p in path.rglob("*")]
    return found


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Observation:
    engine = ServedEngine("--tp", "2", log_path=tmp_path_factory.mktemp("logs") / "serve.log")
    observation = Observation()
    pids = [os.getpid(), engine.proc.pid, *engine.worker_pids]
    # e.g. the NIXL agent an earlier test's publisher made on another interface (agents
    # live as long as their process): not this module's pushes
    before = set(open_sockets([os.getpid()]))
    try:
        for index, (transport, options) in enumerate(PUSHES):
            weights = dict(random_hf_weights(tiny_config(), seed=index))
            with Publisher([engine.url], transport=transport, transport_options=options) as pub:
                if transport == "dist":
                    pub.init_weights_group("127.0.0.1")
                result = pub.push(weights, version=f"v{index}", pause_mode="in_place")
                observation.modes.append(result.mode)
                observation.record(pids, getattr(pub.sink, "root", None), before)
    finally:
        assert engine.stop() == 0
    return observation


def test_every_transport_was_observed(observed: Observation) -> None:
    assert observed.modes[:4] == ["shm direct", "shm slots", "disk", "hf_dir"]
    assert observed.modes[4].startswith("dist")
    assert observed.modes[5] == "nixl"
    kinds = {SHM_NAME.fullmatch(name)["kind"] for name in observed.shm_objects}
    assert kinds == {"shm", "params", "disk", "hf-dir"}
    assert sum(sock.listening for sock in observed.sockets if sock.table != "unix") >= 4
    assert any(sock.address.endswith("/sock") for sock in observed.sockets)  # publisher's ipc


def test_every_inet_socket_is_on_loopback(observed: Observation) -> None:
    inet = [sock for sock in observed.sockets if sock.table != "unix"]
    assert [sock.describe() for sock in inet if not is_loopback(sock.address)] == []


def test_every_unix_socket_is_in_a_private_directory(observed: Observation) -> None:
    named = [sock for sock in observed.sockets if sock.table == "unix" and sock.address]
    assert [sock.describe() for sock in named if not sock.address.startswith("/")] == []
    shared = {
        path: oct(mode)
        for path, (mode, uid) in observed.socket_dirs.items()
        if mode != 0o700 or uid != os.getuid()
    }
    assert shared == {}


def test_every_shared_memory_object_is_private(observed: Observation) -> None:
    exposed = [
        f"{name}/{relative}: {oct(stat.S_IMODE(mode))}"
        for name, modes in observed.shm_objects.items()
        for relative, mode in modes
        if stat.S_IMODE(mode) != (0o700 if stat.S_ISDIR(mode) else 0o600)
    ]
    assert exposed == []


def test_every_shared_memory_name_holds_64_random_bits(observed: Observation) -> None:
    names = list(observed.shm_objects)
    assert [name for name in names if SHM_NAME.fullmatch(name) is None] == []
    randoms = Counter(SHM_NAME.fullmatch(name)["random"] for name in names)
    assert [random for random, count in randoms.items() if count > 1] == []  # each drawn anew


def _token_reads(tree: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
    """(node, parent) for every read of an attribute named `_token`."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    return [
        (node, parents[node])
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "_token"
        if isinstance(node.ctx, ast.Load)
    ]


def _is_compare_digest(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "compare_digest"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in {"secrets", "hmac"}
    )


def _is_none_check(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Compare)
        and all(isinstance(op, ast.Is | ast.IsNot) for op in node.ops)
        and all(isinstance(c, ast.Constant) and c.value is None for c in node.comparators)
    )


def test_the_token_is_compared_in_constant_time() -> None:
    tree = ast.parse(Path(weightbus.engines.reference.server.auth.__file__).read_text())
    reads = _token_reads(tree)
    assert any(_is_compare_digest(parent) for _, parent in reads)
    # any other use (==, in, startswith, len, a slice...) could leak the token's bytes by timing
    others = [
        ast.unparse(parent)
        for _, parent in reads
        if not (_is_compare_digest(parent) or _is_none_check(parent))
    ]
    assert others == []
