"""Where a fleet's engine ranks run: placement groups weightbus owns, or one the caller owns.

weightbus owns the placement: one group per replica, one bundle per TP rank (`STRICT_PACK` by
default: a replica's ranks share a node), rank r on bundle r. The caller owns it: its group, and
optionally the bundle of every rank (`bundle_indices[replica][rank]`), applied in the order
given, never re-sorted by node or address. The indices are checked before any actor starts.
Indices only make sense for a group the caller owns: with one weightbus creates they are refused.
"""

import re
from collections.abc import Mapping, Sequence

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")

# Ray names a resource held from bundle i of group G `<resource>_group_<i>_<G>`; every bundle
# carries the `bundle` resource, so this names the bundle an actor runs on.
_BUNDLE_RESOURCE = re.compile(r"^bundle_group_(\d+)_([0-9a-f]+)$")


def default_bundle_indices(num_replicas: int, tp_size: int) -> list[list[int]]:
    """Rank r of replica i on bundle `i * tp_size + r` (a caller's group, no indices given)."""
    return [[i * tp_size + r for r in range(tp_size)] for i in range(num_replicas)]


def check_bundle_indices(
    bundle_indices: Sequence[Sequence[int]],
    bundles: Sequence[Mapping[str, float]],
    *,
    num_replicas: int,
    tp_size: int,
    rank_resources: Mapping[str, float],
) -> None:
    """Check a caller's bundle for every rank against its placement group.

    Args:
        bundle_indices: `bundle_indices[i][r]`: the bundle of replica i's rank r.
        bundles: the group's bundles (`placement_group.bundle_specs`).
        num_replicas: replicas to place.
        tp_size: ranks per replica.
        rank_resources: what each rank asks for (e.g. `{"CPU": 1}`).

    Raises:
        ValueError: naming the index and why: a list per replica missing, as many indices
            as ranks, each in range, no bundle twice, each holding what a rank asks for.
    """
    if len(bundle_indices) != num_replicas:
        raise ValueError(
            f"bundle_indices: {len(bundle_indices)} lists for {num_replicas} replicas "
            "(one list of bundle indices per replica)"
        )
    taken: dict[int, str] = {}
    for replica, indices in enumerate(bundle_indices):
        if len(indices) != tp_size:
            raise ValueError(
                f"bundle_indices[{replica}]: {len(indices)} indices for a replica of "
                f"tp_size {tp_size} (one bundle per rank)"
            )
        for rank, index in enumerate(indices):
            where = f"bundle_indices[{replica}][{rank}] = {index!r}"
            _check_index(where, index, bundles, rank_resources)
            if index in taken:
                raise ValueError(f"{where}: bundle {index} is already given to {taken[index]}")
            taken[index] = f"replica {replica} rank {rank}"


def _check_index(
    where: str, index: object, bundles: Sequence[Mapping[str, float]], wants: Mapping[str, float]
) -> None:
    if not isinstance(index, int) or isinstance(index, bool):
        raise ValueError(f"{where}: a bundle index is an int")  # noqa: TRY004 - one error type for a wrong list
    if not 0 <= index < len(bundles):
        raise ValueError(
            f"{where}: out of range for a placement group of {len(bundles)} bundles "
            f"(0..{len(bundles) - 1})"
        )
    held = bundles[index]
    short = {name: amount for name, amount in wants.items() if held.get(name, 0) < amount}
    if short:
        raise ValueError(
            f"{where}: bundle {index} holds {dict(held)} but a rank asks for {dict(wants)}"
        )


def check_owned(
    *, bundle_indices: object, placement_group: object, strategy: str, num_replicas: int
) -> None:
    """Check the placement flags of a fleet config.

    Raises:
        ValueError: indices without a caller's group, an unknown strategy, no replica.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if bundle_indices is not None and placement_group is None:
        raise ValueError(
            "bundle_indices apply only to a placement group the caller owns: pass "
            "placement_group= as well (without one, weightbus creates and owns the groups "
            "and places every rank itself)"
        )


def bundle_of(resource_ids: Mapping[str, object]) -> tuple[str, int] | None:
    """(placement group id, bundle index) an actor runs on, from the resources Ray assigned
    it (`core_worker.resource_ids()`); None outside a placement group."""
    for name in resource_ids:
        match = _BUNDLE_RESOURCE.match(name)
        if match:
            return match.group(2), int(match.group(1))
    return None
