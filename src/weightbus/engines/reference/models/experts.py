"""Where the experts of a mixture-of-experts model live: the layout an engine is served with
(`ExpertLayout`, the serve flags) and the live expert map (`ExpertMap`, the logical expert of
every physical slot), with the placements that build a first map and the collective that
moves experts to a new one (`place_experts`).

Without expert parallelism every rank holds a slice of every expert (its intermediate
dimension split over the ranks, as vLLM does without `--enable-expert-parallel`): the map has
one row, the single expert-parallel rank that every TP rank is part of. With it (EP size = TP
size) each rank holds whole experts in its slots, and `redundant_experts` extra slots hold
second copies of some experts, as vLLM's EPLB does.

One map serves every MoE layer of a model: the layers are placed alike.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import msgspec
import xxhash

from weightbus.engines.reference.layers.moe import SlotRoute, SlotTransfer

PLACEMENTS = ("linear", "round_robin")
_MAP_FORMAT = 1


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """How an engine holds the experts (`--expert-parallel`, `--expert-placement`,
    `--redundant-experts`).

    Attributes:
        expert_parallel: whole experts per rank (EP size = TP size), attention still TP.
            False: every rank holds a slice of every expert.
        placement: the first map's placement of the experts over the ranks: `linear` (rank r
            holds a contiguous range) or `round_robin` (expert e on rank e % ep).
        redundant_experts: extra physical slots holding second copies of experts (see
            `initial_expert_map`); only with expert parallelism.

    Raises:
        ValueError: an unknown placement, a negative count, or redundant experts (or a
            placement other than `linear`) without expert parallelism; the flag named.
    """

    expert_parallel: bool = False
    placement: str = "linear"
    redundant_experts: int = 0

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"--expert-placement must be one of {PLACEMENTS}, got {self.placement!r}"
            )
        if self.redundant_experts < 0:
            raise ValueError(f"--redundant-experts must be >= 0, got {self.redundant_experts}")
        if not self.expert_parallel and self.redundant_experts:
            raise ValueError(
                "--redundant-experts needs --expert-parallel: without it every rank holds a "
                "slice of every expert"
            )
        if not self.expert_parallel and self.placement != "linear":
            raise ValueError(
                f"--expert-placement {self.placement} needs --expert-parallel: without it "
                "every rank holds a slice of every expert"
            )

    def ep_size(self, tp_size: int) -> int:
        """Expert-parallel ranks at `tp_size` TP ranks (1 without expert parallelism)."""
        return tp_size if self.expert_parallel else 1

    def describe(self) -> str:
        if not self.expert_parallel:
            return "experts split over the TP ranks"
        return (
            f"expert parallel, {self.placement} placement, "
            f"{self.redundant_experts} redundant experts"
        )


@dataclass(frozen=True, slots=True)
class ExpertMap:
    """The live expert map: `slots[r][s]` is the logical expert that local slot `s` of
    expert-parallel rank `r` holds. Every rank has the same number of slots, every expert at
    least one slot, and no rank two slots of one expert.

    A token routed to an expert with `n` slots uses replica `i % n` (`i`: its index in the
    batch being computed; replicas ordered by rank, then slot), the same rule on every rank.

    Raises:
        ValueError: a map that breaks a rule above (the expert and rank named).
    """

    num_experts: int
    slots: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        rows = tuple(tuple(int(expert) for expert in row) for row in self.slots)
        object.__setattr__(self, "slots", rows)
        if self.num_experts < 1:
            raise ValueError(f"expert map: num_experts must be >= 1, got {self.num_experts}")
        if not rows or not rows[0]:
            raise ValueError("expert map: no ranks or no slots")
        for rank, row in enumerate(rows):
            self._check_row(rank, row, len(rows[0]))
        held = {expert for row in rows for expert in row}
        missing = sorted(set(range(self.num_experts)) - held)
        if missing:
            raise ValueError(f"expert map: experts {missing} have no slot")

    def _check_row(self, rank: int, row: tuple[int, ...], slots_per_rank: int) -> None:
        if len(row) != slots_per_rank:
            raise ValueError(
                f"expert map: rank {rank} has {len(row)} slots, rank 0 {slots_per_rank}: "
                "every rank holds the same number of slots"
            )
        for slot, expert in enumerate(row):
            if not 0 <= expert < self.num_experts:
                raise ValueError(
                    f"expert map: rank {rank} slot {slot} holds expert {expert}, not in "
                    f"[0, {self.num_experts})"
                )
            if row.index(expert) != slot:
                raise ValueError(
                    f"expert map: expert {expert} is held twice on rank {rank} (slots "
                    f"{row.index(expert)} and {slot}): a rank holds at most one copy of an expert"
                )

    @property
    def ep_size(self) -> int:
        """Expert-parallel ranks (rows)."""
        return len(self.slots)

    @property
    def slots_per_rank(self) -> int:
        return len(self.slots[0])

    @property
    def num_redundant(self) -> int:
        """Physical slots beyond one per expert."""
        return self.ep_size * self.slots_per_rank - self.num_experts

    def local_slot(self, rank: int, expert: int) -> int | None:
        """The slot of rank `rank` holding `expert` (None: the rank does not hold it)."""
        row = self.slots[rank]
        return row.index(expert) if expert in row else None

    def replicas(self, expert: int) -> list[tuple[int, int]]:
        """`(rank, slot)` of every copy of `expert`, by rank then slot."""
        return [
            (rank, slot)
            for rank, row in enumerate(self.slots)
            for slot, held in enumerate(row)
            if held == expert
        ]

    def routes(self, rank: int) -> tuple[SlotRoute, ...]:
        """What each local slot of `rank` computes (its expert and which replica it is)."""
        routes = []
        for slot, expert in enumerate(self.slots[rank]):
            copies = self.replicas(expert)
            routes.append(SlotRoute(expert, copies.index((rank, slot)), len(copies)))
        return tuple(routes)

    def hash(self) -> str:
        """xxh3-128 over a canonical msgpack encoding of the map."""
        canonical = [_MAP_FORMAT, self.num_experts, [list(row) for row in self.slots]]
        return xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode(canonical))

    def describe(self) -> str:
        """One line: `8 experts, 2 ranks x 5 slots: rank 0 [0 1 2 3 4], rank 1 [...]`."""
        rows = ", ".join(
            f"rank {rank} [{' '.join(map(str, row))}]" for rank, row in enumerate(self.slots)
        )
        shape = f"{self.ep_size} ranks x {self.slots_per_rank} slots"
        return f"{self.num_experts} experts, {shape}: {rows}"


def linear_placement(num_experts: int, ep_size: int, redundant_experts: int = 0) -> ExpertMap:
    """Rank r holds experts `[r*E/ep, (r+1)*E/ep)` (rounded down), then its redundant slots
    (`with_redundant_slots`).

    Raises:
        ValueError: see `slots_per_rank`.
    """
    per_rank = slots_per_rank(num_experts, ep_size, redundant_experts)
    primaries = [
        list(range(rank * num_experts // ep_size, (rank + 1) * num_experts // ep_size))
        for rank in range(ep_size)
    ]
    return with_redundant_slots(primaries, num_experts, per_rank)


def round_robin_placement(num_experts: int, ep_size: int, redundant_experts: int = 0) -> ExpertMap:
    """Expert e on rank `e % ep`, then each rank's redundant slots (`with_redundant_slots`).

    Raises:
        ValueError: see `slots_per_rank`.
    """
    per_rank = slots_per_rank(num_experts, ep_size, redundant_experts)
    primaries = [list(range(rank, num_experts, ep_size)) for rank in range(ep_size)]
    return with_redundant_slots(primaries, num_experts, per_rank)


def slots_per_rank(num_experts: int, ep_size: int, redundant_experts: int) -> int:
    """`(E + R) / ep`.

    Raises:
        ValueError: the physical slots do not divide over the ranks, or a rank would need
            more slots than there are experts (two copies of one expert on a rank).
    """
    physical = num_experts + redundant_experts
    if physical % ep_size:
        raise ValueError(
            f"num_experts ({num_experts}) + --redundant-experts ({redundant_experts}) = "
            f"{physical} physical slots do not divide over {ep_size} expert-parallel ranks"
        )
    per_rank = physical // ep_size
    if per_rank > num_experts:
        raise ValueError(
            f"--redundant-experts {redundant_experts} gives {per_rank} slots per rank for "
            f"{num_experts} experts: a rank would hold an expert twice"
        )
    return per_rank


def with_redundant_slots(primaries: list[list[int]], num_experts: int, per_rank: int) -> ExpertMap:
    """Each rank's primary experts, then its free slots: the j-th free slot of a rank holds
    the j-th expert (by id) that the rank does not already hold."""
    rows = []
    for row in primaries:
        others = [expert for expert in range(num_experts) if expert not in row]
        rows.append((*row, *others[: per_rank - len(row)]))
    return ExpertMap(num_experts, tuple(rows))


def initial_expert_map(layout: ExpertLayout, num_experts: int, tp_size: int) -> ExpertMap:
    """The map an engine starts with: `layout.placement` over `layout.ep_size(tp_size)` ranks.

    Raises:
        ValueError: see `slots_per_rank`.
    """
    place = linear_placement if layout.placement == "linear" else round_robin_placement
    return place(num_experts, layout.ep_size(tp_size), layout.redundant_experts)


def slot_transfers(old: ExpertMap, new: ExpertMap) -> list[SlotTransfer]:
    """Where every slot whose expert changes from `old` to `new` takes it from: its own rank
    when that rank held the expert, else the first copy under `old` (by rank, then slot).
    Every rank computes the same list.

    Raises:
        ValueError: the maps differ in experts, ranks or slots per rank (the parameters'
            shapes are fixed when the model is built).
    """
    if (new.num_experts, new.ep_size, new.slots_per_rank) != (
        old.num_experts,
        old.ep_size,
        old.slots_per_rank,
    ):
        raise ValueError(
            f"expert map: the new map has {new.num_experts} experts on {new.ep_size} ranks x "
            f"{new.slots_per_rank} slots, the model {old.num_experts} on {old.ep_size} x "
            f"{old.slots_per_rank}"
        )
    transfers = []
    for rank, (old_row, new_row) in enumerate(zip(old.slots, new.slots, strict=True)):
        for slot, (was, expert) in enumerate(zip(old_row, new_row, strict=True)):
            if was == expert:
                continue
            local = old.local_slot(rank, expert)
            src_rank, src_slot = (rank, local) if local is not None else old.replicas(expert)[0]
            transfers.append(SlotTransfer(rank, slot, src_rank, src_slot))
    return transfers


class HoldsExperts(Protocol):
    """A model whose MoE layers follow one `ExpertMap` (`LlamaForCausalLM`)."""

    @property
    def expert_map(self) -> ExpertMap | None: ...

    def place_experts(self, new_map: ExpertMap) -> None: ...


def place_experts(models: Iterable[HoldsExperts], new_map: ExpertMap) -> None:
    """Move the experts of every model to `new_map` (a collective: every rank calls it with
    the same models, in the same order, and the same map), e.g. an engine's live and staging
    models, which must stay placed alike.

    Raises:
        ValueError: a model without experts, or a map that does not fit the models.
    """
    for model in models:
        model.place_experts(new_map)
