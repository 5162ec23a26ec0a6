"""The whole model as the trainer group holds it: every rank's holdings, gathered once per
layout, checked, and the same on every rank (`TrainerLayout`).

It also says who sends what: a tensor some rank holds whole is sent whole by one of them
(`sender`), the others in cells (`trainer.cells`), digested in blocks (`trainer.digests`).
"""

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import xxhash

from weightbus.core.experts import missing_experts
from weightbus.core.meta import TensorMeta, dtype_from_name, dtype_name
from weightbus.core.plan import Plan, plan_buckets
from weightbus.core.trainer.boxes import Box
from weightbus.core.trainer.holdings import Holding


class HeldMeta(msgspec.Struct, frozen=True, array_like=True):
    """What a rank says it holds of one tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    box: Box


def held_metas(holdings: Sequence[Holding]) -> list[HeldMeta]:
    return [
        HeldMeta(h.name, dtype_name(h.meta.dtype), tuple(h.meta.shape), h.box) for h in holdings
    ]


@dataclass(frozen=True)
class TrainerLayout:
    """Every tensor of the model, in order, and which ranks hold which box of it.

    Raises:
        ValueError: ranks disagree on a tensor's dtype or shape, no rank holds some part of
            a tensor, or an expert between the experts held (each named).
    """

    by_rank: tuple[tuple[HeldMeta, ...], ...]

    def __post_init__(self) -> None:
        metas: dict[str, HeldMeta] = {}
        holders: dict[str, list[tuple[int, Box]]] = {}
        for rank, held in enumerate(self.by_rank):
            for meta in held:
                first = metas.setdefault(meta.name, meta)
                if (first.dtype, first.shape) != (meta.dtype, meta.shape):
                    raise ValueError(
                        f"tensor {meta.name!r}: trainer rank {rank} holds it as {meta.dtype} "
                        f"{list(meta.shape)}, another rank as {first.dtype} {list(first.shape)}"
                    )
                holders.setdefault(meta.name, []).append((rank, meta.box))
        missing = missing_experts(metas)
        if missing:
            shown = ", ".join(repr(name) for name in missing[:3])
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ValueError(f"no trainer rank holds expert tensor {shown}{more}")
        object.__setattr__(self, "_held", metas)
        object.__setattr__(self, "_holders", holders)
        for name, meta in metas.items():
            whole = Box.whole(meta.shape)
            if all(box != whole for _, box in holders[name]):
                _check_covered(name, whole, holders[name])

    @functools.cached_property
    def layout_hash(self) -> str:
        return xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode(self.by_rank))

    @property
    def world_size(self) -> int:
        return len(self.by_rank)

    @functools.cached_property
    def metas(self) -> list[TensorMeta]:
        """The model's tensors, in order (rank 0's first, then each rank's new ones)."""
        held: dict[str, HeldMeta] = self._held  # type: ignore[attr-defined]
        return [TensorMeta(m.name, dtype_from_name(m.dtype), tuple(m.shape)) for m in held.values()]

    @functools.cached_property
    def metas_by_name(self) -> dict[str, TensorMeta]:
        return {meta.name: meta for meta in self.metas}

    def plan(self, bucket_bytes: int, plan_hash: str) -> Plan:
        """The plan of the model's tensors, which must be the leader's (`plan_hash`).

        Raises:
            ValueError: another plan (ranks that hold different models).
        """
        plan = plan_buckets(self.metas, bucket_bytes)
        if plan.plan_hash != plan_hash:
            raise ValueError("this rank's plan differs from rank 0's (a different model?)")
        return plan

    def holders(self, name: str) -> list[tuple[int, Box]]:
        """`(rank, box)` of every rank holding part of tensor `name`, by rank."""
        return self._holders[name]  # type: ignore[attr-defined]

    @functools.cached_property
    def senders(self) -> dict[str, int]:
        """The rank that sends each tensor some rank holds whole (absent: sent in cells): the
        least loaded of its whole holders, largest tensors first, so replicas share it."""
        load = [0] * self.world_size
        chosen = {}
        for meta in sorted(self.metas, key=lambda meta: -meta.nbytes):
            whole = Box.whole(meta.shape)
            ranks = [rank for rank, box in self.holders(meta.name) if box == whole]
            if ranks:
                rank = min(ranks, key=lambda r: (load[r], r))
                load[rank] += meta.nbytes
                chosen[meta.name] = rank
        return chosen

    def sender(self, name: str) -> int | None:
        """The rank that sends tensor `name` whole, or None: it goes in cells."""
        return self.senders.get(name)


def _check_covered(name: str, whole: Box, boxes: list[tuple[int, Box]]) -> None:
    """Every element of `whole` is in some rank's box (cells between the boxes' edges)."""
    for cell in whole.cut_by(box for _, box in boxes):
        if not any(cell.intersect(box) == cell for _, box in boxes):
            raise ValueError(
                f"tensor {name!r}: no trainer rank holds rows {cell.row_start}:{cell.row_stop}, "
                f"columns {cell.col_start}:{cell.col_stop} of its {whole.rows}x{whole.cols} matrix"
            )
