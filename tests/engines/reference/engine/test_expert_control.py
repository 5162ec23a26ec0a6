"""Expert re-placements on rank 0, step by step (the controller alone, no ranks), and the map a
request asks for, checked against the live one.

A re-placement is refused while anything else moves or frees the weights (409 naming the live
map); otherwise every rank runs it at the next step boundary, and rank 0 sends the new slice
maps before its answer. A rank that failed after experts moved leaves the weights unserved.
"""

import pytest

from weightbus.core.wire import RankVerdict
from weightbus.core.wire.messages import SliceSpec
from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.actions import Action
from weightbus.engines.reference.engine.expert_placement import (
    PlacementError,
    experts_info,
    placement_name,
    requested_map,
)
from weightbus.engines.reference.engine.expert_requests import NO_EXPERTS
from weightbus.engines.reference.engine.update_control import UpdateController
from weightbus.engines.reference.models.experts import (
    ExpertMap,
    linear_placement,
    round_robin_placement,
)

LINEAR_MAP = linear_placement(8, 2)  # rank 0 [0 1 2 3], rank 1 [4 5 6 7]
LINEAR = experts_info(LINEAR_MAP)
ROUND_ROBIN = round_robin_placement(8, 2)
BUSY = f"the expert map stays {LINEAR.hash}"
ONE_COPY = "a rank holds at most one copy of an expert"


def _controller(sent: list, experts: messages.ExpertsInfo | None = LINEAR) -> UpdateController:
    return UpdateController(
        version="v0",
        fingerprint="00" * 16,
        send=sent.append,
        abort=lambda reason, notify: None,
        experts=experts,
    )


def _place(rows: tuple[tuple[int, ...], ...], request_id: str = "p1") -> messages.PlaceExperts:
    return messages.PlaceExperts(request_id=request_id, expert_map=[list(row) for row in rows])


def _control_results(sent: list) -> list[tuple[int, str]]:
    return [(m.status_code, m.message) for m in sent if isinstance(m, messages.ControlResult)]


def _verdict(rank: int, *, ok: bool = True, touched: bool = False) -> RankVerdict:
    return RankVerdict(
        session_id="p1",
        rank=rank,
        ok=ok,
        errors=[] if ok else ["cannot place the experts: gloo: connection reset"],
        touched=touched,
    )


def _slices(expert_map: ExpertMap) -> list[list[SliceSpec]]:
    return [[SliceSpec(f"experts.{e}", 0, 0, 4) for e in row] for row in expert_map.slots]


def test_a_replacement_runs_at_the_next_step_and_the_slice_maps_precede_the_answer():
    sent: list = []
    control = _controller(sent)
    control.on_place_experts(_place(ROUND_ROBIN.slots))
    action = control.next_action(num_running=3)  # generation goes on around it
    assert action.action == Action.PLACE_EXPERTS
    assert messages.decode_to_engine(action.payload) == _place(ROUND_ROBIN.slots)
    placed = experts_info(ROUND_ROBIN)
    control.on_experts_placed(
        _place(ROUND_ROBIN.slots), [_verdict(0), _verdict(1)], _slices(ROUND_ROBIN), placed
    )
    assert [type(m) for m in sent] == [messages.LayoutChanged, messages.ControlResult]
    assert sent[0] == messages.LayoutChanged(rank_slices=_slices(ROUND_ROBIN), experts=placed)
    assert _control_results(sent) == [
        (200, f"experts placed: the expert map is {placed.hash} (round_robin)")
    ]
    assert control.experts == placed
    assert control.next_action(num_running=0).action == Action.NONE


def test_while_a_replacement_waits_for_its_step_other_weight_changes_are_refused():
    sent: list = []
    control = _controller(sent)
    control.on_place_experts(_place(ROUND_ROBIN.slots))
    control.on_place_experts(_place(ROUND_ROBIN.slots, request_id="p2"))
    control.on_update(
        messages.UpdateWeights(update_id="u1", version="v1", transport="disk", source={})
    )
    control.on_control(messages.Control(request_id="r1", action="release", tags=["kv_cache"]))
    update = [m for m in sent if isinstance(m, messages.UpdateResult)]
    assert [(m.status_code, m.error) for m in update] == [
        (409, "an expert re-placement is in progress")
    ]
    assert _control_results(sent) == [
        (409, f"another expert re-placement is in flight: {BUSY}"),
        (409, "an expert re-placement is in progress"),
    ]


def _push(control: UpdateController) -> str:
    control.on_update(
        messages.UpdateWeights(update_id="u1", version="v1", transport="disk", source={})
    )
    assert control.next_action(num_running=0).action == Action.BEGIN_STAGED
    return "a push of 'v1' is in flight"


def _two_phase_staged(control: UpdateController) -> str:
    control.on_update(
        messages.UpdateWeights(
            update_id="u1", version="v1", transport="disk", source={}, two_phase=True
        )
    )
    control.next_action(num_running=0)
    verdict = RankVerdict(session_id="u1", rank=0, ok=True, fingerprint="11" * 16)
    control.on_staged([verdict], nbytes=8, phases={})
    control.next_action(num_running=0)  # answers "staged": waits for its decision
    return "a push of 'v1' is in flight"


def _rollback(control: UpdateController) -> str:
    control.rollback.hold(
        messages.HistoryEntry(
            version="v-1", step=None, fingerprint="ff" * 16, committed_at=0, seconds=0, nbytes=0
        )
    )
    control.on_rollback(messages.Rollback(update_id="r1"))
    return "a rollback to 'v-1' is in flight"


def _release(control: UpdateController) -> str:
    control.on_control(messages.Control(request_id="m1", action="release", tags=["weights"]))
    return "a memory release is in flight"


def _released(control: UpdateController) -> str:
    _release(control)
    control.on_released(mask=2)
    return "the weights memory is released"


def _setup(control: UpdateController) -> str:
    request = {"action": "destroy", "group_name": "weightbus"}
    setup = messages.TransportSetup(request_id="s1", transport="dist", request=request)
    control.on_transport_setup(setup, tp_size=2)
    return "a weights group is being initialised or destroyed"


@pytest.mark.parametrize("busy", [_push, _two_phase_staged, _rollback, _release, _released, _setup])
def test_a_replacement_is_refused_while_the_weights_are_busy_naming_the_live_map(busy):
    sent: list = []
    control = _controller(sent)
    why = busy(control)
    sent.clear()
    control.on_place_experts(_place(ROUND_ROBIN.slots))
    assert _control_results(sent) == [(409, f"{why}: {BUSY}")]
    assert control.next_action(num_running=0).action != Action.PLACE_EXPERTS
    assert control.experts == LINEAR


def test_a_dense_engine_has_no_experts_to_place():
    sent: list = []
    _controller(sent, experts=None).on_place_experts(_place(ROUND_ROBIN.slots))
    assert _control_results(sent) == [(400, NO_EXPERTS)]


def test_rank_0_checks_the_map_again():
    sent: list = []
    control = _controller(sent)
    control.on_place_experts(_place(((0, 1, 2, 3), (4, 5, 6, 6))))
    assert _control_results(sent) == [
        (
            400,
            "expert map: expert 6 is held twice on rank 1 (slots 2 and 3): " + ONE_COPY,
        )
    ]
    assert control.next_action(num_running=0).action == Action.NONE


@pytest.mark.parametrize(
    ("touched", "status", "weights"), [(True, 500, "FAILED"), (False, 400, "NORMAL")]
)
def test_a_failed_replacement_fails_closed_once_experts_moved(touched, status, weights):
    sent: list = []
    control = _controller(sent)
    control.on_place_experts(_place(ROUND_ROBIN.slots))
    control.next_action(num_running=0)
    verdicts = [_verdict(0), _verdict(1, ok=False, touched=touched)]
    control.on_experts_placed(_place(ROUND_ROBIN.slots), verdicts, _slices(LINEAR_MAP), LINEAR)
    error = "expert re-placement failed: rank 1: cannot place the experts: gloo: connection reset"
    if touched:
        error += "; the weights are not served until a push lands"
    assert _control_results(sent) == [(status, error)]
    assert control.status == weights
    assert control.may_run() == (not touched)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [[0, 1, 2, 3]],
            "expert_map has 1 ranks; this engine has 2 expert-parallel ranks",
        ),
        (
            [[0, 1, 2, 3], [4, 5, 6]],
            "expert_map rank 1 has 3 slots; every rank of this engine holds 4",
        ),
        (
            [[0, 1, 2, 3], [4, 5, 6, 8]],
            "expert map: rank 1 slot 3 holds expert 8, not in [0, 8)",
        ),
        (
            [[0, 1, 2, 3], [4, 5, 6, 0]],
            "expert map: experts [7] have no slot",
        ),
        (
            [[0, 1, 2, 2], [4, 5, 6, 7]],
            "expert map: expert 2 is held twice on rank 0 (slots 2 and 3): " + ONE_COPY,
        ),
    ],
    ids=["ranks", "slots", "unknown-expert", "expert-without-slot", "expert-twice-on-a-rank"],
)
def test_a_map_that_does_not_fit_is_named(rows, message):
    with pytest.raises(PlacementError) as refused:
        requested_map(LINEAR, expert_map=rows)
    assert (refused.value.param, str(refused.value)) == ("expert_map", message)


def test_a_named_placement_keeps_the_live_experts_ranks_and_redundant_slots():
    redundant = experts_info(linear_placement(8, 2, 2))
    assert requested_map(redundant, placement="round_robin") == round_robin_placement(8, 2, 2)
    with pytest.raises(PlacementError, match="unknown placement 'random'") as refused:
        requested_map(redundant, placement="random")
    assert refused.value.param == "placement"


def test_a_map_is_named_by_the_placement_that_gives_it():
    assert [placement_name(m) for m in (LINEAR_MAP, ROUND_ROBIN)] == ["linear", "round_robin"]
    assert placement_name(ExpertMap(8, ((7, 1, 2, 3), (4, 5, 6, 0)))) == "custom"
    info = experts_info(linear_placement(8, 2, 2))
    assert (info.placement, info.redundant_experts, len(info.expert_map[0])) == ("linear", 2, 5)
