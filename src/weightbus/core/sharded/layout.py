"""The whole model as the trainer group holds it: every rank's holdings, gathered once per
layout, checked, and the same on every rank (`TrainerLayout`)."""

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import msgspec
import xxhash

from weightbus.core.meta import TensorMeta, dtype_from_name, dtype_name
from weightbus.core.plan import Plan, plan_buckets
from weightbus.core.sharded.boxes import Box
from weightbus.core.sharded.holdings import Holding


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
        ValueError: ranks disagree on a tensor's dtype or shape, or no rank holds some part of
            a tensor (each named).
    """

    by_rank: tuple[tuple[HeldMeta, ...], ...]

    def __post_init__(self) -> None:
        metas: dict[str, HeldMeta] = {}
        for rank, held in enumerate(self.by_rank):
            for meta in held:
                first = metas.setdefault(meta.name, meta)
                if (first.dtype, first.shape) != (meta.dtype, meta.shape):
                    raise ValueError(
                        f"tensor {meta.name!r}: trainer rank {rank} holds it as {meta.dtype} "
                        f"{list(meta.shape)}, another rank as {first.dtype} {list(first.shape)}"
                    )
        object.__setattr__(self, "_metas", metas)
        for name, meta in metas.items():
            _check_covered(name, Box.whole(meta.shape), self.holders(name))

    @property
    def layout_hash(self) -> str:
        return xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode(self.by_rank))

    @property
    def metas(self) -> list[TensorMeta]:
        """The model's tensors, in order (rank 0's first, then each rank's new ones)."""
        held: dict[str, HeldMeta] = self._metas
        return [TensorMeta(m.name, dtype_from_name(m.dtype), tuple(m.shape)) for m in held.values()]

    def plan(self, bucket_bytes: int, plan_hash: str) -> Plan:
        """The plan of the model's tensors, which must be rank 0's (`plan_hash`).

        Raises:
            ValueError: another plan (ranks that hold different models).
        """
        plan = plan_buckets(self.metas, bucket_bytes)
        if plan.plan_hash != plan_hash:
            raise ValueError("this rank's plan differs from rank 0's (a different model?)")
        return plan

    def holders(self, name: str) -> list[tuple[int, Box]]:
        """`(rank, box)` of every rank holding part of tensor `name`, by rank."""
        return [
            (rank, m.box) for rank, held in enumerate(self.by_rank) for m in held if m.name == name
        ]


def _check_covered(name: str, whole: Box, boxes: list[tuple[int, Box]]) -> None:
    """Every element of `whole` is in some rank's box (cells between the boxes' edges)."""
    rows = sorted(
        {whole.row_start, whole.row_stop, *(v for _, b in boxes for v in (b.row_start, b.row_stop))}
    )
    cols = sorted(
        {whole.col_start, whole.col_stop, *(v for _, b in boxes for v in (b.col_start, b.col_stop))}
    )
    for row_start, row_stop in pairwise(rows):
        for col_start, col_stop in pairwise(cols):
            cell = Box(row_start, row_stop, col_start, col_stop)
            if not any(cell.intersect(box) == cell for _, box in boxes):
                raise ValueError(
                    f"tensor {name!r}: no trainer rank holds rows {row_start}:{row_stop}, "
                    f"columns {col_start}:{col_stop} of its {whole.rows}x{whole.cols} matrix"
                )
