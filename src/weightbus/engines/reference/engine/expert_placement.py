"""An expert re-placement, as vLLM's EPLB re-places experts (`POST /v1/experts/place`): the
map asked for, checked against the live one (`requested_map`: on the API server, which names
what is wrong, and again on rank 0), and the live map as the engine reports it
(`experts_info`, `GET /v1/experts`).

Rank 0 refuses a re-placement while a push, a transport set-up, a rollback or a memory release
is in flight (`expert_requests.ExpertRequests`); otherwise every rank moves its live and
staging experts at one step boundary (`Action.PLACE_EXPERTS`, `WeightsManager.place_experts`)
and refreshes what it derived from its slice map.
"""

from collections.abc import Callable

from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.models.experts import (
    ExpertMap,
    linear_placement,
    round_robin_placement,
)

# the placements a map may be asked for by name (`ExpertLayout.placement`'s choices)
PLACEMENTS: dict[str, Callable[[int, int, int], ExpertMap]] = {
    "linear": linear_placement,
    "round_robin": round_robin_placement,
}
CUSTOM = "custom"  # a map no named placement gives


class PlacementError(ValueError):
    """A re-placement that cannot apply to this engine; `param` names the request's field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def placement_name(expert_map: ExpertMap) -> str:
    """The named placement that gives `expert_map` (with its redundant slots), else `custom`."""
    dims = (expert_map.num_experts, expert_map.ep_size, expert_map.num_redundant)
    for name, place in PLACEMENTS.items():
        if place(*dims) == expert_map:
            return name
    return CUSTOM


def experts_info(expert_map: ExpertMap) -> messages.ExpertsInfo:
    """The live map as rank 0 reports it."""
    return messages.ExpertsInfo(
        num_experts=expert_map.num_experts,
        expert_map=[list(row) for row in expert_map.slots],
        hash=expert_map.hash(),
        placement=placement_name(expert_map),
        redundant_experts=expert_map.num_redundant,
    )


def requested_map(
    live: messages.ExpertsInfo,
    *,
    expert_map: list[list[int]] | None = None,
    placement: str | None = None,
) -> ExpertMap:
    """The map a re-placement asks for: `placement` over the live map's experts, ranks and
    redundant slots, else `expert_map`, which must have the live map's ranks and slots.

    Raises:
        PlacementError: an unknown placement, or a map with another number of ranks or slots,
            an unknown expert, an expert with no slot or one held twice on a rank (the rank,
            slot and expert named).
    """
    ranks, slots = len(live.expert_map), len(live.expert_map[0])
    if placement is not None:
        if placement not in PLACEMENTS:
            known = ", ".join(PLACEMENTS)
            raise PlacementError("placement", f"unknown placement {placement!r}; known: {known}")
        return PLACEMENTS[placement](live.num_experts, ranks, live.redundant_experts)
    assert expert_map is not None, "give expert_map or placement"
    if len(expert_map) != ranks:
        raise PlacementError(
            "expert_map",
            f"expert_map has {len(expert_map)} ranks; this engine has {ranks} expert-parallel "
            "ranks",
        )
    for rank, row in enumerate(expert_map):
        if len(row) != slots:
            raise PlacementError(
                "expert_map",
                f"expert_map rank {rank} has {len(row)} slots; every rank of this engine holds "
                f"{slots}",
            )
    try:
        return ExpertMap(live.num_experts, tuple(tuple(row) for row in expert_map))
    except ValueError as exc:
        raise PlacementError("expert_map", str(exc)) from None
