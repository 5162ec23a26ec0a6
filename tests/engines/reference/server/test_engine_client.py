"""EngineClient over real ZMQ ipc sockets, and the pure bookkeeping of completions."""

import asyncio
import shutil
import tempfile

import pytest
from fake_rank0 import FakeRank0, weights_state

from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.server.completions import check_serving, extend_spans
from weightbus.engines.reference.server.engine_client import EngineClient, EngineDeadError
from weightbus.engines.reference.server.errors import APIError
from weightbus.engines.reference.server.protocol import WeightSpan

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")

TIMEOUT_S = 10.0


@pytest.mark.parametrize(
    ("versions", "spans"),
    [
        ([], []),
        (["a"], [("a", 0, 1)]),
        (["a", "a", "a"], [("a", 0, 3)]),
        (["a", "a", "b"], [("a", 0, 2), ("b", 2, 3)]),
        (["a", "b", "c", "c"], [("a", 0, 1), ("b", 1, 2), ("c", 2, 4)]),
        # a forced re-push of an older version opens a span of its own
        (["a", "b", "a"], [("a", 0, 1), ("b", 1, 2), ("a", 2, 3)]),
    ],
)
def test_spans_follow_token_versions(versions: list[str], spans: list[tuple]) -> None:
    result: list[WeightSpan] = []
    for index, version in enumerate(versions):
        extend_spans(result, version, index)
    assert [(s.version, s.start, s.end) for s in result] == spans


def weights(**changes: object) -> messages.WeightsState:
    return weights_state(**{"version": "v", **changes})


@pytest.mark.parametrize(
    ("state", "served"),
    [
        (weights(), True),
        (weights(status="UPDATING"), True),  # queued behind the update, not refused
        (weights(generation="paused"), True),
        (weights(status="FAILED"), False),
        (weights(status="CLEARING"), False),
        (weights(status="CLEARED", released=["weights"]), False),
        (weights(released=["kv_cache"]), False),
    ],
)
def test_check_serving(state: messages.WeightsState, served: bool) -> None:
    if served:
        check_serving(state)
        return
    with pytest.raises(APIError) as info:
        check_serving(state)
    assert info.value.status_code == 503


async def _connected(ipc_dir: str) -> tuple[EngineClient, FakeRank0]:
    client = EngineClient(ipc_dir)
    rank0 = FakeRank0(ipc_dir, weight_version="v0")
    await client.wait_ready(timeout_s=TIMEOUT_S, check=lambda: None)
    return client, rank0


async def _routes_aborted_and_results(ipc_dir: str) -> None:
    client, rank0 = await _connected(ipc_dir)
    try:
        assert client.weights == weights(version="v0")
        add = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "prompt_token_ids": [1]}
        first = await client.add(messages.AddRequest(request_id="r1", **add))
        second = await client.add(messages.AddRequest(request_id="r2", **add))
        third = await client.add(messages.AddRequest(request_id="r3", **add))
        aborted = messages.Aborted(request_ids=["r1", "r3", "gone"], reason="memory released")
        rank0.send(aborted)
        async with asyncio.timeout(TIMEOUT_S):
            assert await first.get() == aborted
            assert await third.get() == aborted
        assert second.empty()

        # a result nobody waits for is dropped; the next one still resolves its waiter
        rank0.send(messages.ControlResult(request_id="stray", status_code=200))
        rank0.handler = lambda m: [
            messages.ControlResult(request_id=m.request_id, status_code=409, message="busy"),
            weights(version="v0", generation="paused"),
        ]
        result = await client.control(
            messages.Control(request_id="c1", action="pause"), timeout_s=TIMEOUT_S
        )
        assert result == messages.ControlResult(request_id="c1", status_code=409, message="busy")
        paused = await client.wait_weights(lambda s: s.generation == "paused", timeout_s=TIMEOUT_S)
        assert paused
        assert not await client.wait_weights(lambda s: s.version == "never", timeout_s=0.05)

        # the engine's death fails a waiting update at once
        rank0.handler = lambda m: []
        update = messages.UpdateWeights(
            update_id="u1", version="v1", transport="disk", source={}, timeout_s=1.0
        )
        waiting = asyncio.create_task(client.update(update, timeout_s=TIMEOUT_S))
        async with asyncio.timeout(TIMEOUT_S):
            while not rank0.received_of(messages.UpdateWeights):
                await asyncio.sleep(0.005)
        client.fail("worker rank 0 exited with code 1")
        with pytest.raises(EngineDeadError, match="exited with code 1"):
            await asyncio.wait_for(waiting, TIMEOUT_S)
        with pytest.raises(EngineDeadError):  # and refuses new ones
            await client.update(update, timeout_s=TIMEOUT_S)
    finally:
        await client.close()
        rank0.close()


def test_client_routes_aborted_results_and_failures() -> None:
    ipc_dir = tempfile.mkdtemp(prefix="wbt-")
    try:
        asyncio.run(_routes_aborted_and_results(ipc_dir))
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)
