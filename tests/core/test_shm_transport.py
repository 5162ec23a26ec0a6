"""The shm transport with real shared memory and real ZMQ sockets; receivers are threads."""

import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from helpers import (
    TensorDictTarget,
    all_dtype_tensors,
    assert_bit_identical,
    random_tensor,
    receive_order,
    sending_of,
)
from sessions import SessionFactory
from weightbus.core.receiver import RankResult, Receiver
from weightbus.core.transport import encode_description, make_sink, open_source
from weightbus.core.transport.parts.shared_memory import SHM_DIR, SLOT_PREFIX, Slot
from weightbus.core.weights import normalize_weights

KiB = 1024


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    # mixed dtypes, and tensors larger than a 4 KiB bucket (split into chunks)
    return [
        *all_dtype_tensors(seed),
        ("big.rows", random_tensor((300, 10), torch.float32, seed)),
        ("big.flat", random_tensor((5000,), torch.bfloat16, seed + 1)),
    ]


def _slot_files() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"{SLOT_PREFIX}*")}


def _push(sink, weights, version: str, ranks: list[tuple[int, int, int]], timeout_s: float = 20):
    """Stream one session to receiver threads `(group, rank, tp_size)`; returns their results."""
    session = SessionFactory(4 * KiB).session(
        normalize_weights(weights), version, None, receivers=len({g for g, _, _ in ranks})
    )
    sending = sending_of(weights)
    description = sink.prepare(session, sending)
    results: dict[tuple[int, int], tuple[RankResult, TensorDictTarget]] = {}

    def receive(group: int, rank: int, tp_size: int) -> None:
        target = TensorDictTarget({name: torch.zeros_like(t) for name, t in weights})
        receiver = Receiver(
            load_weights=target.load_weights, expected=target.expected(), rank=rank, tp_size=tp_size
        )
        source = open_source("shm", sink.for_engine(description, group), rank=rank, tp_size=tp_size)
        request = receive_order("shm", version=version, timeout_s=timeout_s)
        results[group, rank] = receiver.receive(source, request), target

    threads = [threading.Thread(target=receive, args=r) for r in ranks]
    for thread in threads:
        thread.start()
    sink.stream(session, sending, timeout_s)
    for thread in threads:
        thread.join(timeout_s)
    return session, results


def test_one_copy_serves_every_rank_of_every_engine_bit_exactly():
    before = _slot_files()
    sink = make_sink("shm")
    try:
        weights = _weights(1)
        session, results = _push(sink, weights, "v1", [(0, 0, 2), (0, 1, 2), (1, 0, 1)])
        assert len(results) == 3
        for result, target in results.values():
            assert result.ok, result.errors
            assert result.fingerprint == session.fingerprint
            for name, tensor in weights:
                assert_bit_identical(target.tensors[name], tensor)
        assert len(_slot_files() - before) == 2
    finally:
        sink.close()
    assert _slot_files() == before


def test_ten_pushes_reuse_the_same_slots():
    sink = make_sink("shm")
    try:
        _push(sink, _weights(0), "v0", [(0, 0, 1)])
        slots = _slot_files()
        for step in range(1, 10):
            weights = _weights(step)
            _, results = _push(sink, weights, f"v{step}", [(0, 0, 1)])
            result, target = results[0, 0]
            assert result.ok, result.errors
            assert_bit_identical(target.tensors["big.flat"], dict(weights)["big.flat"])
            assert _slot_files() == slots
    finally:
        sink.close()


def test_a_refusing_rank_still_drains_so_others_commit():
    sink = make_sink("shm")
    try:
        weights = _weights(2)
        session = SessionFactory(4 * KiB).session(normalize_weights(weights), "v", None)
        sending = sending_of(weights)
        description = sink.prepare(session, sending)
        outcome: dict[str, RankResult] = {}

        def receive(name: str, expected_version: str) -> None:
            target = TensorDictTarget({n: torch.zeros_like(t) for n, t in weights})
            receiver = Receiver(
                load_weights=target.load_weights,
                expected=target.expected(),
                rank=0 if name == "ok" else 1,
                tp_size=2,
            )
            source = open_source(
                "shm", sink.for_engine(description, 0), rank=receiver.rank, tp_size=2
            )
            outcome[name] = receiver.receive(
                source, receive_order("shm", version=expected_version, timeout_s=20)
            )

        threads = [
            threading.Thread(target=receive, args=("ok", "v")),
            threading.Thread(target=receive, args=("refusing", "other")),
        ]
        for thread in threads:
            thread.start()
        sink.stream(session, sending, 20)  # returns: the refusing rank acked every slot
        for thread in threads:
            thread.join(20)
        assert outcome["ok"].ok
        assert outcome["refusing"].errors == ["stream version 'v' != requested 'other'"]
    finally:
        sink.close()


def test_receiver_times_out_when_the_publisher_never_streams():
    sink = make_sink("shm")
    try:
        weights = _weights(3)
        session = SessionFactory(4 * KiB).session(normalize_weights(weights), "v", None)
        description = sink.prepare(session, sending_of(weights))
        target = TensorDictTarget({n: torch.zeros_like(t) for n, t in weights})
        receiver = Receiver(load_weights=target.load_weights, expected=target.expected())
        result = receiver.receive(
            open_source("shm", description), receive_order("shm", version="v", timeout_s=0.5)
        )
        assert result.timed_out
        assert not result.ok
        assert not target.tensors["big.rows"].any()  # nothing was loaded
    finally:
        sink.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"endpoint": "tcp://10.0.0.1:5"}, "shm endpoint must be an ipc:// address"),
        ({"slots": ["weightbus-shm-1-x-0"]}, "at least two slot names"),
        ({"slots": ["/etc/passwd", "x"]}, "is not a weightbus shared-memory file"),
        ({"slots": [f"{SLOT_PREFIX}1-x-0", f"{SLOT_PREFIX}../x"]}, "is not a weightbus shared"),
    ],
    ids=["endpoint", "one slot", "not a slot", "a path"],
)
def test_bad_descriptions_are_refused(change, message):
    sink = make_sink("shm")
    try:
        session = SessionFactory(4 * KiB).session(normalize_weights(_weights(4)), "v", None)
        prepared = sink.prepare(session, sending_of(_weights(4)))
        description = {**encode_description(prepared), **change}
        with pytest.raises(ValueError, match=message):
            open_source("shm", description)
    finally:
        sink.close()


def test_slots_are_mapped_at_begin_and_a_gone_slot_is_named():
    # a rank maps the slots only when the session streams through them (not in direct mode)
    with pytest.raises(ValueError, match=f"shared-memory file {SLOT_PREFIX}1-gone-0 does not"):
        Slot.open(f"{SLOT_PREFIX}1-gone-0", 4 * KiB)


_DIE_HOLDING_SLOTS = textwrap.dedent(
    """
    import os, torch
    from sessions import SessionFactory
    from weightbus.core.weights import normalize_weights
    from weightbus.core.transport import make_sink
    weights = [("w", torch.ones(10))]
    sink = make_sink("shm", direct=False)  # slots only: made at prepare
    factory = SessionFactory(4096)
    session = factory.session(normalize_weights(weights), "v", None)
    sink.prepare(session, factory.sending(weights))
    print(" ".join(slot.name for slot in sink.slots), flush=True)
    os.kill(os.getpid(), 9)
    """
)


@pytest.mark.e2e  # a Python child process (tiers: tests/conftest.py)
def test_slots_of_a_killed_publisher_are_removed_by_the_next_one():
    tests_dir = str(Path(__file__).parents[1])  # the child imports the tests' `sessions`
    out = subprocess.run(
        [sys.executable, "-c", _DIE_HOLDING_SLOTS],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert out.returncode == -9
    names = out.stdout.split()
    assert len(names) == 2
    assert all((SHM_DIR / name).exists() for name in names)
    for name in names:
        assert oct((SHM_DIR / name).stat().st_mode & 0o777) == oct(0o600)
    dead_dirs = list(Path(tempfile.gettempdir()).glob(f"{SLOT_PREFIX}{names[0].split('-')[2]}-*"))
    assert len(dead_dirs) == 1  # the dead publisher's socket directory
    sink = make_sink("shm")
    sink.close()
    assert not any((SHM_DIR / name).exists() for name in names)
    assert not dead_dirs[0].exists()
