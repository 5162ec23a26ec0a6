"""Pushes into an engine that serves a draft model (speculative decoding): the main model and
the draft (`draft.` names) are one version with one fingerprint, swapped together or not at
all; a push without the draft is refused unless it says the draft stays.

The engines are real `weightbus serve --draft-model tiny` processes at TP 2; every check reads
back what they serve: fingerprints over the tensors they hold, and greedy completions compared
with an engine without a draft that received the same main model.
"""

import json
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from engine_harness import ServedEngine
from update_harness import engine_greedy, weights_state

from weightbus import Publisher
from weightbus.core.digest import fingerprint as fingerprint_of
from weightbus.core.meta import DRAFT_PREFIX
from weightbus.core.publisher import PushError
from weightbus.core.publisher.targets import EngineResult, HttpEngineTarget, UpdateOrder
from weightbus.engines.reference.engine.weights_manager import DRAFT_MISSING
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import random_hf_weights

pytestmark = pytest.mark.e2e

DRAFT_SEED = 1  # the draft the engines start with


def main_weights(seed: int) -> dict[str, torch.Tensor]:
    return dict(random_hf_weights(tiny_config(), seed))


def draft_weights(seed: int) -> dict[str, torch.Tensor]:
    """A draft model's tensors under the names a push carries them (`draft.` + HF name)."""
    return {DRAFT_PREFIX + name: t for name, t in random_hf_weights(tiny_config(), seed)}


def fingerprint(weights: dict[str, torch.Tensor]) -> str:
    return fingerprint_of(weights.items())


def unprefixed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name.removeprefix(DRAFT_PREFIX): t for name, t in weights.items()}


@pytest.fixture(scope="module")
def engines(
    tmp_path_factory: pytest.TempPathFactory, shared_processes
) -> Iterator[dict[str, ServedEngine]]:
    """`drafted`: TP 2 with a tiny draft; `plain`: TP 1, no draft (the reference; the TP 1
    engine other modules share, tests/process_pool.py: every test pushes into it first)."""
    log_dir = tmp_path_factory.mktemp("log")
    started: dict[str, ServedEngine] = {}
    try:
        started["drafted"] = ServedEngine(
            "--tp", "2", "--draft-model", "tiny", "--draft-seed", str(DRAFT_SEED),
            "--num-speculative-tokens", "3", log_path=log_dir / "drafted.log",
        )  # fmt: skip
        plain = shared_processes.tiny_engine("--tp", "1", log_dir=log_dir)
        yield {**started, "plain": plain}
    finally:
        for engine in started.values():
            engine.stop()


def assert_same_completion(choice: dict, reference: dict) -> None:
    """Token-identical; logprobs equal up to summation order (TP 2 against TP 1)."""
    assert choice["token_ids"] == reference["token_ids"]
    logprobs = choice["logprobs"]["token_logprobs"]
    assert logprobs == pytest.approx(reference["logprobs"]["token_logprobs"], abs=1e-4)


def _served(engine: ServedEngine) -> tuple[str, dict | None]:
    state = weights_state(engine)
    return state["fingerprint"], state["draft"]


def test_the_engine_reports_the_draft_it_started_with(engines):
    state = weights_state(engines["drafted"])
    if state["version"] != "init":
        pytest.skip("another test of the module pushed first")
    draft = draft_weights(DRAFT_SEED)
    assert state["draft"]["version"] == "init"
    assert state["draft"]["fingerprint"] == fingerprint(unprefixed(draft))
    assert state["fingerprint"] == fingerprint({**main_weights(0), **draft})


@pytest.mark.parametrize("transport", ["shm", "disk", "hf_dir", "dist", "nixl"])
def test_one_push_carries_both_models_as_one_version(engines, transport):
    main, draft = main_weights(5), draft_weights(6)
    version = f"both-{transport}-{secrets.token_hex(2)}"
    bucket_bytes = 4 << 20  # the draft (16 MiB) spans several buckets
    with Publisher([engines["drafted"].url], transport=transport, bucket_bytes=bucket_bytes) as pub:
        if transport == "dist":
            pub.init_weights_group("127.0.0.1")
        result = pub.push({**main, **draft}, version=version)
    assert result.fingerprint == fingerprint({**main, **draft})
    served, served_draft = _served(engines["drafted"])
    assert served == result.fingerprint
    assert served_draft["version"] == version
    assert served_draft["fingerprint"] == fingerprint(unprefixed(draft))
    if transport in ("disk", "hf_dir", "dist"):  # shm, nixl: written into the parameters
        # loaded bucket by bucket: never more than one bucket of it at once
        assert served_draft["bytes"] == sum(t.nbytes for t in draft.values())
        assert 0 < served_draft["max_chunk_bytes"] <= bucket_bytes
    with Publisher([engines["plain"].url], transport="shm") as pub:
        pub.push(main, version=version)
    assert_same_completion(engine_greedy(engines["drafted"]), engine_greedy(engines["plain"]))


def test_a_delta_push_carries_both_models(engines):
    main, draft = main_weights(7), draft_weights(8)
    run = secrets.token_hex(2)
    with Publisher([engines["drafted"].url], transport="shm", delta="always") as pub:
        pub.push({**main, **draft}, version=f"{run}-0")
        new_draft = {name: t.clone() for name, t in draft.items()}
        new_draft["draft.model.norm.weight"] += 0.5
        result = pub.push({**main, **new_draft}, version=f"{run}-1")
    assert result.delta.sent
    assert result.delta.tensors["same"] == len(main) + len(draft) - 1
    served, served_draft = _served(engines["drafted"])
    assert served == fingerprint({**main, **new_draft})
    assert served_draft["fingerprint"] == fingerprint(unprefixed(new_draft))


@pytest.mark.parametrize("atomic", [True, False])
def test_a_push_without_the_draft_is_refused_unless_it_keeps_the_draft(engines, atomic):
    engine = engines["drafted"]
    run = secrets.token_hex(2)
    draft = draft_weights(9)
    with Publisher([engine.url], transport="shm") as pub:
        pub.push({**main_weights(3), **draft}, version=f"{run}-both")
        before = _served(engine)
        with pytest.raises(PushError) as raised:
            pub.push(main_weights(4), version=f"{run}-main", atomic=atomic)
        assert DRAFT_MISSING in str(raised.value)
        assert _served(engine) == before
        assert weights_state(engine)["status"] == "NORMAL"
        result = pub.push(main_weights(4), version=f"{run}-kept", atomic=atomic, keep_draft=True)
    served, served_draft = _served(engine)
    assert served == result.fingerprint == fingerprint(main_weights(4))
    assert served_draft == before[1]  # the draft still comes from the version that carried it


def accepted_share(engine: ServedEngine) -> float:
    """The share of draft tokens the engine accepts on one greedy completion (`/metrics`)."""
    before = draft_counters(engine)
    engine_greedy(engine)
    after = draft_counters(engine)
    return (after[1] - before[1]) / (after[0] - before[0])


def draft_counters(engine: ServedEngine) -> tuple[int, int]:
    values = {}
    for line in engine.client.get("/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = float(value) if name.startswith("weightbus_spec_") else None
    return (
        int(values["weightbus_spec_draft_tokens_total"]),
        int(values["weightbus_spec_accepted_tokens_total"]),
    )


@pytest.mark.parametrize("atomic", [True, False])
def test_a_kept_draft_keeps_its_bytes(engines, atomic):
    """The draft a push keeps is the one served before it, not what the staging memory held:
    a draft equal to the main model is accepted on every greedy token, a random one is not."""
    engine = engines["drafted"]
    run = secrets.token_hex(2)
    main = main_weights(20)
    same_as_main = {DRAFT_PREFIX + name: t for name, t in main.items()}  # shared memory
    with Publisher([engine.url], transport="shm") as pub:
        pub.push({**main, **draft_weights(21)}, version=f"{run}-random-draft")
        assert accepted_share(engine) < 0.5
        pub.push({**main, **same_as_main}, version=f"{run}-same-draft")  # staging: the random one
        assert accepted_share(engine) == 1.0
        pub.push(main, version=f"{run}-kept", atomic=atomic, keep_draft=True)
    assert _served(engine)[1]["version"] == f"{run}-same-draft"
    assert accepted_share(engine) == 1.0


def flip_a_draft_byte(session: Path) -> str:
    """Flip the first data byte of a draft tensor in a disk session's shards; returns its name."""
    for shard in sorted(session.glob("*.safetensors")):
        data = bytearray(shard.read_bytes())
        header_bytes = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_bytes])
        for name, entry in header.items():
            if name.startswith(DRAFT_PREFIX):
                data[8 + header_bytes + entry["data_offsets"][0]] ^= 0xFF
                shard.write_bytes(bytes(data))
                return name
    raise AssertionError(f"no draft tensor in {session}")


class DraftCorruptingTarget(HttpEngineTarget):
    """An engine whose copy of each disk session has one byte of a draft tensor flipped: the
    draft it stages is corrupted, and its ranks' digest checks must refuse it."""

    def update(self, order: UpdateOrder) -> EngineResult:
        session = Path(order.source["path"])
        copy = session.with_name(f"{session.name}-corrupted")
        shutil.copytree(session, copy)
        flip_a_draft_byte(copy)
        source = {**order.source, "path": str(copy)}
        return super().update(msgspec.structs.replace(order, source=source))


@pytest.mark.parametrize("atomic", [True, False])
def test_a_corrupted_draft_fails_closed_for_both_models(engines, atomic):
    engine = engines["drafted"]
    run = secrets.token_hex(2)
    with Publisher([engine.url], transport="shm") as pub:
        pub.push({**main_weights(11), **draft_weights(12)}, version=f"{run}-good")
    before, greedy_before = _served(engine), engine_greedy(engine)
    bad = {**main_weights(13), **draft_weights(14)}
    with (
        Publisher([DraftCorruptingTarget(engine.url)], transport="disk") as pub,
        pytest.raises(PushError) as raised,
    ):
        pub.push(bad, version=f"{run}-bad", atomic=atomic)
    assert "digest mismatch for tensor 'draft." in str(raised.value)
    state = weights_state(engine)
    if atomic:  # both models still serve the previous version, bit-exact
        assert (state["fingerprint"], state["draft"]) == before
        assert state["status"] == "NORMAL"
        assert engine_greedy(engine) == greedy_before
    else:  # half-written: the engine serves nothing until a good push
        assert state["status"] == "FAILED"
        with Publisher([engine.url], transport="shm") as pub:
            pub.push({**main_weights(11), **draft_weights(12)}, version=f"{run}-fixed")
        assert engine_greedy(engine)["logprobs"] == greedy_before["logprobs"]


def test_a_rollback_brings_back_both_models(engines):
    engine = engines["drafted"]
    run = secrets.token_hex(2)
    with Publisher([engine.url], transport="shm") as pub:
        pub.push({**main_weights(15), **draft_weights(16)}, version=f"{run}-1")
        first, greedy_first = _served(engine), engine_greedy(engine)
        pub.push({**main_weights(17), **draft_weights(18)}, version=f"{run}-2")
        pub.rollback()
    assert _served(engine) == first
    assert first[1]["version"] == f"{run}-1"
    assert engine_greedy(engine) == greedy_first


def test_an_engine_without_a_draft_refuses_draft_tensors(engines):
    with (
        Publisher([engines["plain"].url], transport="shm") as pub,
        pytest.raises(PushError) as raised,
    ):
        pub.push({**main_weights(2), **draft_weights(2)}, version=secrets.token_hex(3))
    assert "unknown tensors: ['draft." in str(raised.value)
    assert weights_state(engines["plain"])["draft"] is None
