"""Rank 0's two-phase updates and rollbacks, step by step (the controller alone, no ranks).

A two-phase update stages, answers "staged" once the pause mode allows the swap, and swaps only
on a commit; an abort (or no decision within `timeout_s`) discards it. A rollback swaps the
version the staging memory still holds, and is refused with the reason once it is not held.
"""

import time

import msgspec
import pytest

from weightbus.core.wire import RankVerdict
from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.actions import Action
from weightbus.engines.reference.engine.pending_update import PEER_RESOLUTION_S
from weightbus.engines.reference.engine.update_control import UpdateController

FINGERPRINTS = {"v0": "00" * 16, "v1": "11" * 16, "v2": "22" * 16}


def _controller(sent: list, *, wait: bool = False) -> UpdateController:
    return UpdateController(
        version="v0",
        fingerprint=FINGERPRINTS["v0"],
        send=sent.append,
        abort=lambda reason, notify: None,
        wait_for_initial_weights=wait,
    )


def _update(
    version: str,
    *,
    two_phase: bool = True,
    timeout_s: float = 60.0,
    pause="drain",
    peers: tuple[str, ...] = (),
):
    return messages.UpdateWeights(
        update_id=f"u-{version}",
        version=version,
        transport="disk",
        source={},
        two_phase=two_phase,
        pause_mode=pause,
        timeout_s=timeout_s,
        peers=list(peers),
    )


def _verdict(version: str, *, ok: bool = True) -> RankVerdict:
    return RankVerdict(
        session_id="ab" * 16,
        rank=0,
        ok=ok,
        errors=[] if ok else ["digest mismatch for tensor 'w'"],
        names=[] if ok else ["w"],
        touched=False,
        fingerprint=FINGERPRINTS[version] if ok else None,
    )


def _results(sent: list) -> dict[str, messages.UpdateResult]:
    return {m.update_id: m for m in sent if isinstance(m, messages.UpdateResult)}


def _stage(control: UpdateController, version: str, **options) -> None:
    """Accept an update of `version` and let every rank stage it."""
    control.on_update(_update(version, **options))
    assert control.next_action(num_running=0).action == Action.BEGIN_STAGED
    assert control.next_action(num_running=0).action == Action.POLL
    control.on_staged([_verdict(version)], nbytes=8, phases={})


def _decide(control: UpdateController, version: str, decision: str, request_id: str) -> None:
    control.on_decide(messages.Decide(request_id=request_id, version=version, decision=decision))


def _commit(control: UpdateController, version: str) -> None:
    """A one-phase atomic update of `version`, committed."""
    _stage(control, version, two_phase=False)
    assert control.next_action(num_running=0).action == Action.COMMIT
    control.on_committed()


def test_two_phase_answers_staged_then_swaps_only_on_commit():
    sent: list = []
    control = _controller(sent)
    _stage(control, "v1")
    assert control.next_action(num_running=0).action == Action.NONE  # answers "staged"
    staged = _results(sent)["u-v1"]
    assert (staged.status_code, staged.staged, staged.fingerprint) == (
        200,
        True,
        FINGERPRINTS["v1"],
    )
    assert control.state().staged_version == "v1"
    for _ in range(3):  # no decision: it waits, serving v0
        assert control.next_action(num_running=0).action == Action.NONE
    assert control.version == "v0"
    _decide(control, "v1", "commit", "c1")
    assert control.next_action(num_running=0).action == Action.COMMIT
    control.on_committed()
    committed = _results(sent)["c1"]
    assert (committed.status_code, committed.staged, committed.version) == (200, False, "v1")
    state = control.state()
    assert (state.version, state.fingerprint, state.staged_version) == (
        "v1",
        FINGERPRINTS["v1"],
        None,
    )
    assert state.rollback.version == "v0"


def test_each_ranks_bytes_travel_in_the_staged_answer_and_in_the_commits():
    sent: list = []
    control = _controller(sent)
    control.on_update(_update("v1"))
    assert control.next_action(num_running=0).action == Action.BEGIN_STAGED
    assert control.next_action(num_running=0).action == Action.POLL
    verdicts = [  # gathered in any order: reported by rank
        msgspec.structs.replace(_verdict("v1"), rank=rank, nbytes=nbytes)
        for rank, nbytes in [(1, 300), (0, 500)]
    ]
    control.on_staged(verdicts, nbytes=500, phases={})
    assert control.next_action(num_running=0).action == Action.NONE  # answers "staged"
    _decide(control, "v1", "commit", "c1")
    assert control.next_action(num_running=0).action == Action.COMMIT
    control.on_committed()
    staged, committed = _results(sent)["u-v1"], _results(sent)["c1"]
    assert staged.rank_nbytes == committed.rank_nbytes == [500, 300]
    assert staged.nbytes == committed.nbytes == 500


def test_drain_answers_staged_only_once_running_sequences_finished():
    sent: list = []
    control = _controller(sent)
    _stage(control, "v1")
    assert not control.may_admit()  # staged under drain: new sequences wait
    control.next_action(num_running=2)
    assert "u-v1" not in _results(sent)
    control.next_action(num_running=0)
    assert _results(sent)["u-v1"].staged


def test_abort_of_a_staged_update_discards_it_and_counts():
    sent: list = []
    control = _controller(sent)
    _stage(control, "v1")
    control.next_action(num_running=0)
    _decide(control, "v1", "abort", "a1")
    assert _results(sent)["a1"].status_code == 200
    assert control.next_action(num_running=0).action == Action.ABORT
    state = control.state()
    assert (state.version, state.status, state.two_phase_aborts) == ("v0", "NORMAL", 1)
    _decide(control, "v1", "commit", "c1")  # too late: nothing pending
    late = _results(sent)["c1"]
    assert (late.status_code, late.error) == (
        409,
        "no two-phase update of version 'v1' is pending",
    )


def test_abort_while_receiving_discards_when_the_receive_ends():
    sent: list = []
    control = _controller(sent)
    control.on_update(_update("v1"))
    assert control.next_action(num_running=0).action == Action.BEGIN_STAGED
    _decide(control, "v1", "abort", "a1")
    assert "will be discarded" in _results(sent)["a1"].error
    control.on_staged([_verdict("v1")], nbytes=8, phases={})
    aborted = _results(sent)["u-v1"]
    assert (aborted.status_code, aborted.error) == (409, "aborted: aborted by the caller")
    assert control.next_action(num_running=0).action == Action.ABORT
    assert control.version == "v0"


def test_no_decision_within_timeout_discards(monkeypatch):
    sent: list = []
    control = _controller(sent)
    _stage(control, "v1", timeout_s=5.0)
    control.next_action(num_running=0)
    clock = time.perf_counter() + 6.0
    monkeypatch.setattr(
        "weightbus.engines.reference.engine.update_control.time.perf_counter", lambda: clock
    )
    assert control.next_action(num_running=0).action == Action.ABORT
    assert (control.version, control.state().two_phase_aborts) == ("v0", 1)


def test_commit_naming_another_fingerprint_is_refused():
    sent: list = []
    control = _controller(sent)
    _stage(control, "v1")
    control.next_action(num_running=0)
    control.on_decide(
        messages.Decide(
            request_id="c1", version="v1", decision="commit", fingerprint=FINGERPRINTS["v2"]
        )
    )
    assert _results(sent)["c1"].status_code == 409
    assert control.next_action(num_running=0).action == Action.NONE  # still staged


def test_rollback_swaps_back_and_a_second_one_is_refused():
    sent: list = []
    control = _controller(sent)
    _commit(control, "v1")
    _commit(control, "v2")
    control.on_rollback(messages.Rollback(update_id="r1", version="v1"))
    assert control.next_action(num_running=0).action == Action.ROLLBACK
    control.on_committed()
    state = control.state()
    assert (state.version, state.fingerprint, state.rollbacks) == ("v1", FINGERPRINTS["v1"], 1)
    assert state.rollback is None
    control.on_rollback(messages.Rollback(update_id="r2"))
    refused = _results(sent)["r2"]
    second = (
        "no previous version is held: version 'v1' was restored by a rollback from 'v2'; "
        "a rollback does not undo another"
    )
    assert (refused.status_code, refused.error) == (409, second)


@pytest.mark.parametrize(
    ("before", "reason"),
    [
        ("nothing", "no version has been replaced since the engine started"),
        ("in_place", "an in-place push of 'v2' replaced the live weights"),
        ("failed_stage", "a push of 'v2' began staging into its memory"),
    ],
)
def test_rollback_refused_when_the_previous_version_is_not_held(before, reason):
    sent: list = []
    control = _controller(sent)
    if before != "nothing":
        _commit(control, "v1")
    if before == "in_place":
        control.on_update(
            messages.UpdateWeights(
                update_id="u-v2", version="v2", transport="disk", source={}, atomic=False
            )
        )
        assert control.next_action(num_running=0).action == Action.LOAD
        control.on_loaded([_verdict("v2")], nbytes=8, phases={})
    if before == "failed_stage":
        control.on_update(_update("v2", two_phase=False))
        control.next_action(num_running=0)
        control.on_staged([_verdict("v2", ok=False)], nbytes=8, phases={})
    control.on_rollback(messages.Rollback(update_id="r1"))
    refused = _results(sent)["r1"]
    assert (refused.status_code, refused.error) == (409, f"no previous version is held: {reason}")


def test_two_phase_rollback_waits_for_commit():
    sent: list = []
    control = _controller(sent)
    _commit(control, "v1")
    control.on_rollback(messages.Rollback(update_id="r1", two_phase=True, pause_mode="in_place"))
    assert control.next_action(num_running=3).action == Action.NONE
    assert _results(sent)["r1"].staged
    _decide(control, "v0", "commit", "c1")
    assert control.next_action(num_running=3).action == Action.ROLLBACK


def test_waiting_engine_serves_nothing_until_its_first_push():
    sent: list = []
    control = _controller(sent, wait=True)
    state = control.state()
    assert state.status == "WAITING"
    assert not control.may_run()
    assert control.blocked_reason().startswith("waiting for its initial weights")
    control.on_update(_update("v1", two_phase=False))
    assert control.next_action(num_running=0).action == Action.LOAD  # nothing to protect
    control.on_loaded([_verdict("v1")], nbytes=8, phases={})
    assert (control.state().status, control.may_run()) == ("NORMAL", True)


PEERS = ("http://peer-b:8000", "http://peer-c:8000")


def _ask(control: UpdateController, sent: list, version: str, request_id: str) -> str | None:
    control.on_ask_outcome(
        messages.AskOutcome(
            request_id=request_id, version=version, fingerprint=FINGERPRINTS[version]
        )
    )
    return _results(sent)[request_id].outcome


def _later(monkeypatch, seconds: float) -> None:
    clock = time.perf_counter() + seconds
    monkeypatch.setattr(
        "weightbus.engines.reference.engine.update_control.time.perf_counter", lambda: clock
    )


def test_outcome_answers_follow_the_update_and_asking_fences_it():
    sent: list = []
    control = _controller(sent)
    assert _ask(control, sent, "v1", "q0") == "absent"
    control.on_update(_update("v1", peers=PEERS))
    control.next_action(num_running=0)
    assert _ask(control, sent, "v1", "q1") == "receiving"
    control.on_staged([_verdict("v1")], nbytes=8, phases={})
    control.next_action(num_running=0)  # answers "staged"
    assert _ask(control, sent, "v1", "q2") == "staged"
    _decide(control, "v1", "commit", "late")  # the trainer's commit, after a peer asked
    late = _results(sent)["late"]
    assert (late.status_code, late.error) == (
        409,
        (
            "version 'v1' is being resolved with the fleet's peers (no decision came within "
            "60.0 s): its outcome is theirs now"
        ),
    )
    control.on_decide(
        messages.Decide(request_id="peers", version="v1", decision="commit", by_peers=True)
    )
    assert _ask(control, sent, "v1", "q3") == "committed"  # its commit waits for the pause mode
    assert control.next_action(num_running=0).action == Action.COMMIT
    control.on_committed()
    assert _ask(control, sent, "v1", "q4") == "committed"
    assert _results(sent)["peers"].status_code == 200


def test_no_decision_with_peers_asks_the_server_to_settle_then_discards_alone(monkeypatch):
    sent: list = []
    control = _controller(sent)
    _stage(control, "v1", timeout_s=5.0, peers=PEERS)
    control.next_action(num_running=0)
    _later(monkeypatch, 6.0)
    assert control.next_action(num_running=0).action == Action.NONE  # still staged
    (settle,) = [m for m in sent if isinstance(m, messages.SettleWithPeers)]
    assert (settle.version, settle.fingerprint, settle.peers) == (
        "v1",
        FINGERPRINTS["v1"],
        list(PEERS),
    )
    _decide(control, "v1", "commit", "late")  # fenced: the trainer's word no longer counts
    assert _results(sent)["late"].status_code == 409
    _later(monkeypatch, 6.0 + PEER_RESOLUTION_S + 1.0)  # the server never answered
    assert control.next_action(num_running=0).action == Action.ABORT
    assert (control.version, control.state().two_phase_aborts) == ("v0", 1)
