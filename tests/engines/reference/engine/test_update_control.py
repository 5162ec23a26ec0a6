"""Rank 0's controller announces every new state before the result that reveals it.

The API server answers a request as soon as its result arrives, so a client that reads
`GET /v1/weights` right after an answer must find the state the result implies: the
`WeightsState` has to travel first on the same ordered socket.
"""

import pytest

from weightbus.core.wire import RankVerdict
from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.actions import Action
from weightbus.engines.reference.engine.update_control import UpdateController

SESSION_ID = "ab" * 16
FINGERPRINT = "cd" * 16


def _controller(sent: list) -> UpdateController:
    return UpdateController(
        version="v0", fingerprint=None, send=sent.append, abort=lambda reason, notify: None
    )


def _update(atomic: bool) -> messages.UpdateWeights:
    return messages.UpdateWeights(
        update_id="01" * 16,
        version="v1",
        transport="disk",
        source={},
        atomic=atomic,
        pause_mode="in_place",
    )


def _verdict(*, ok: bool, touched: bool = False) -> RankVerdict:
    errors = [] if ok else ["digest mismatch for tensor 'w'"]
    return RankVerdict(
        session_id=SESSION_ID,
        rank=0,
        ok=ok,
        errors=errors,
        names=[] if ok else ["w"],
        touched=touched,
        fingerprint=FINGERPRINT if ok else None,
    )


def _state_before_result(sent: list) -> messages.WeightsState:
    results = [i for i, m in enumerate(sent) if isinstance(m, messages.UpdateResult)]
    assert len(results) == 1
    states = [m for m in sent[: results[0]] if isinstance(m, messages.WeightsState)]
    assert states, "no WeightsState before the UpdateResult"
    assert not any(isinstance(m, messages.WeightsState) for m in sent[results[0] :])
    return states[-1]


@pytest.mark.parametrize(
    ("ok", "touched", "status", "version"),
    [(True, True, "NORMAL", "v1"), (False, True, "FAILED", "v0"), (False, False, "NORMAL", "v0")],
    ids=["committed", "half-written", "refused"],
)
def test_in_place_outcome_state_precedes_result(ok, touched, status, version):
    sent: list = []
    control = _controller(sent)
    control.on_update(_update(atomic=False))
    assert control.next_action(num_running=0).action == Action.LOAD
    control.on_loaded([_verdict(ok=ok, touched=touched)], nbytes=8, phases={})
    state = _state_before_result(sent)
    assert (state.status, state.version) == (status, version)


def test_staged_failure_state_precedes_result():
    sent: list = []
    control = _controller(sent)
    control.on_update(_update(atomic=True))
    assert control.next_action(num_running=0).action == Action.BEGIN_STAGED
    control.on_staged([_verdict(ok=False)], nbytes=8, phases={})
    assert _state_before_result(sent).status == "NORMAL"


@pytest.mark.parametrize("mode", ["in_place", "drain"])
def test_pause_state_precedes_control_result(mode):
    sent: list = []
    control = _controller(sent)
    control.on_control(messages.Control(request_id="02" * 16, action="pause", mode=mode))
    control.next_action(num_running=0)
    kinds = [type(m) for m in sent]
    assert kinds == [messages.WeightsState, messages.ControlResult]
    assert sent[0].generation == "paused"


def _replies(sent: list) -> dict[str, tuple[int, str]]:
    return {
        m.request_id: (m.status_code, m.message)
        for m in sent
        if isinstance(m, messages.ControlResult)
    }


def test_every_concurrent_drain_pause_gets_its_answer():
    sent: list = []
    control = _controller(sent)
    for request_id in ("a1", "a2"):
        control.on_control(messages.Control(request_id=request_id, action="pause", mode="drain"))
    control.next_action(num_running=1)  # still draining: nobody answered yet
    assert _replies(sent) == {}
    control.next_action(num_running=0)
    drained = (200, "generation paused (drain)")
    assert _replies(sent) == {"a1": drained, "a2": drained}


@pytest.mark.parametrize(
    ("action", "mode", "reason"),
    [
        ("pause", "in_place", "pause cancelled by pause_generation (in_place)"),
        ("continue", "drain", "pause cancelled by continue_generation"),
    ],
)
def test_a_waiting_drain_pause_is_cancelled_not_forgotten(action, mode, reason):
    sent: list = []
    control = _controller(sent)
    control.on_control(messages.Control(request_id="d1", action="pause", mode="drain"))
    control.on_control(messages.Control(request_id="x1", action=action, mode=mode))
    assert _replies(sent)["d1"] == (409, reason)
    assert _replies(sent)["x1"][0] == 200


def _delta_update(base_fingerprint: str) -> messages.UpdateWeights:
    from weightbus.core.wire.delta import DeltaSpec

    spec = DeltaSpec(
        base_version="v0",
        base_fingerprint=base_fingerprint,
        fingerprint="ef" * 16,
        tensors=[],
        rank_digests=[[]],
    )
    return messages.UpdateWeights(
        update_id="02" * 16, version="v1", transport="disk", source={}, delta=spec
    )


@pytest.mark.parametrize(
    ("served", "released", "answer"),
    [
        (FINGERPRINT, set(), None),
        (FINGERPRINT, {"kv_cache"}, None),
        ("aa" * 16, set(), "is not served here: this engine serves 'v0' (" + "aa" * 16 + ")"),
        (FINGERPRINT, {"weights"}, "cannot apply: this engine serves no valid weights"),
    ],
)
def test_a_delta_is_accepted_only_onto_the_version_served(served, released, answer):
    sent: list = []
    control = UpdateController(
        version="v0", fingerprint=served, send=sent.append, abort=lambda reason, notify: None
    )
    control.released = set(released)
    control.on_update(_delta_update(FINGERPRINT))
    results = [m for m in sent if isinstance(m, messages.UpdateResult)]
    if answer is None:
        assert not results
        assert control.updating
        return
    assert [(r.status_code, r.error) for r in results] == [
        (409, f"delta base 'v0' ({FINGERPRINT}) {answer}")
    ]
