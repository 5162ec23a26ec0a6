"""Expert maps: the placements, the rules a map keeps (errors name the expert and rank), the
replica each token takes, and where a re-placement takes each moved expert from."""

import pytest

from weightbus.engines.reference.layers.moe import SlotRoute, SlotTransfer
from weightbus.engines.reference.models.experts import (
    ExpertLayout,
    ExpertMap,
    initial_expert_map,
    linear_placement,
    round_robin_placement,
    slot_transfers,
)


@pytest.mark.parametrize(
    ("place", "num_experts", "ep_size", "redundant", "rows"),
    [
        (linear_placement, 8, 2, 0, ((0, 1, 2, 3), (4, 5, 6, 7))),
        (round_robin_placement, 8, 2, 0, ((0, 2, 4, 6), (1, 3, 5, 7))),
        # each rank's j-th extra slot: the j-th expert it lacks
        (linear_placement, 8, 2, 2, ((0, 1, 2, 3, 4), (4, 5, 6, 7, 0))),
        (round_robin_placement, 8, 2, 2, ((0, 2, 4, 6, 1), (1, 3, 5, 7, 0))),
        (linear_placement, 8, 2, 4, ((0, 1, 2, 3, 4, 5), (4, 5, 6, 7, 0, 1))),
        # experts that do not divide over the ranks: the redundant slots even them out
        (linear_placement, 8, 3, 1, ((0, 1, 2), (2, 3, 4), (5, 6, 7))),
        (round_robin_placement, 8, 3, 1, ((0, 3, 6), (1, 4, 7), (2, 5, 0))),
        (linear_placement, 8, 1, 0, ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ],
)
def test_placements(place, num_experts, ep_size, redundant, rows) -> None:
    expert_map = place(num_experts, ep_size, redundant)
    assert expert_map.slots == rows
    assert expert_map.num_redundant == redundant


def test_initial_map_without_expert_parallelism_is_one_rank_of_every_expert() -> None:
    assert initial_expert_map(ExpertLayout(), 8, 4).slots == (tuple(range(8)),)
    layout = ExpertLayout(expert_parallel=True, placement="round_robin")
    assert initial_expert_map(layout, 8, 4).slots == ((0, 4), (1, 5), (2, 6), (3, 7))


@pytest.mark.parametrize(
    ("ep_size", "redundant", "message"),
    [
        (3, 0, r"num_experts \(8\) \+ --redundant-experts \(0\) = 8 physical slots do not divide"),
        (2, 10, "gives 9 slots per rank for 8 experts: a rank would hold an expert twice"),
    ],
)
def test_placements_that_cannot_be_made_are_named(ep_size, redundant, message) -> None:
    with pytest.raises(ValueError, match=message):
        linear_placement(8, ep_size, redundant)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (((0, 1, 2, 3), (4, 5, 6)), "rank 1 has 3 slots, rank 0 4"),
        (((0, 1, 2, 3), (4, 5, 6, 8)), "rank 1 slot 3 holds expert 8, not in"),
        (((0, 1, 2, 3), (4, 5, 6, 4)), r"expert 4 is held twice on rank 1 \(slots 0 and 3\)"),
        (((0, 1, 2, 3), (4, 5, 6, 0)), r"experts \[7\] have no slot"),
        ((), "no ranks"),
    ],
)
def test_a_bad_map_is_refused_by_name(rows, message) -> None:
    with pytest.raises(ValueError, match=message):
        ExpertMap(8, rows)


def test_hash_and_describe() -> None:
    linear = linear_placement(8, 2, 2)
    assert linear.hash() == ExpertMap(8, [[0, 1, 2, 3, 4], [4, 5, 6, 7, 0]]).hash()
    assert linear.hash() != round_robin_placement(8, 2, 2).hash()
    assert len(linear.hash()) == 32
    assert (
        linear.describe() == "8 experts, 2 ranks x 5 slots: rank 0 [0 1 2 3 4], rank 1 [4 5 6 7 0]"
    )


def test_routes_alternate_between_replicas_by_rank_order() -> None:
    expert_map = linear_placement(8, 2, 2)
    assert expert_map.replicas(0) == [(0, 0), (1, 4)]
    assert expert_map.routes(0) == (
        SlotRoute(0, 0, 2),
        SlotRoute(1),
        SlotRoute(2),
        SlotRoute(3),
        SlotRoute(4, 0, 2),
    )
    assert expert_map.routes(1)[0] == SlotRoute(4, 1, 2)
    assert expert_map.routes(1)[4] == SlotRoute(0, 1, 2)


def test_slot_transfers_take_an_expert_from_the_own_rank_first() -> None:
    old = ExpertMap(8, ((0, 1, 2, 3, 4), (4, 5, 6, 7, 0)))
    new = ExpertMap(8, ((4, 1, 2, 3, 7), (0, 5, 6, 7, 4)))
    assert slot_transfers(old, new) == [
        SlotTransfer(0, 0, 0, 4),  # expert 4: rank 0 held it in slot 4
        SlotTransfer(0, 4, 1, 3),  # expert 7: only rank 1 held it
        SlotTransfer(1, 0, 1, 4),
        SlotTransfer(1, 4, 1, 0),
    ]
    assert slot_transfers(old, old) == []
    with pytest.raises(ValueError, match="the new map has 8 experts on 2 ranks x 4 slots"):
        slot_transfers(old, linear_placement(8, 2))
