"""The publishing side of a delta: each trainer rank's base (a copy of what it held of the last
version pushed), and what changed since.

Every rank keeps its own base (host memory equal to what it holds: the price of a delta) and
encodes its own changes: the tensors whose digest changed are compared bit-wise, cell by cell
(`encode_cells`: a tensor sent whole by its sender is one cell; a tensor held in row ranges is
cut along its holders' rows, each range encoded by the lowest rank holding it), into flat
indices of the whole tensor and their new values. The leader adds up the counts and decides how
each tensor travels (`sparse`: its changed elements, the owners' segments one after another;
`full`: whole). After the push lands, each rank writes the same changes into its base
(`advance`: the sparse ones just before the next encoding reads it), so it is the new version.
"""

import functools
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from weightbus.core.delta.bits import changes, index_dtype, scatter
from weightbus.core.trainer.boxes import Box
from weightbus.core.trainer.cells import cells
from weightbus.core.trainer.holdings import Holding
from weightbus.core.trainer.layout import TrainerLayout
from weightbus.core.wire.messages import SliceSpec

# tensor -> its cells in row order, each `(owner rank, box)`; None: it cannot travel sparse
# (some rank holds a part of its columns: the owners' changes would not be in order)
Cells = dict[str, list[tuple[int, Box]] | None]


@functools.lru_cache(maxsize=8)
def encode_cells(layout: TrainerLayout) -> Cells:
    """Who encodes which rows of each tensor (the same on every rank)."""
    found: Cells = {}
    for meta in layout.metas:
        whole = Box.whole(meta.shape)
        sender = layout.sender(meta.name)
        if sender is not None:
            found[meta.name] = [(sender, whole)]
            continue
        holders = layout.holders(meta.name)
        if any(box.cols != whole.cols for _, box in holders):
            found[meta.name] = None
            continue
        owned = []
        for cell in cells(whole, holders):
            owners = [rank for rank, box in holders if cell.intersect(box) == cell]
            owned.append((min(owners), cell))
        found[meta.name] = owned
    return found


@dataclass(frozen=True, slots=True)
class CellChanges:
    """The changed elements of one cell: flat indices in the whole tensor, increasing, and
    their new values."""

    cell: int
    indices: torch.Tensor
    values: torch.Tensor


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous()


class RankBase:
    """This rank's copy of what it held of the last version pushed.

    Args:
        holdings: what the rank holds of that version (copied; the caller's are not kept).
        layout_hash: the group's layout then (a delta needs the same one).
        version, fingerprint, digests: the version's name and identity (known on the leader,
            which decides; the other ranks keep the bytes only).
    """

    def __init__(
        self,
        holdings: Mapping[str, Holding],
        layout_hash: str,
        *,
        version: str,
        fingerprint: str | None = None,
        digests: Mapping[str, str] | None = None,
    ) -> None:
        self._tensors = {name: _host(h.tensor).clone() for name, h in holdings.items()}
        self.layout_hash = layout_hash
        self.version, self.fingerprint = version, fingerprint
        self.digests = dict(digests or {})
        # sparse changes of landed deltas not yet written into `tensors`: `(name, flat index of
        # this rank's first element, changes)`, written before the base is next read
        self._unwritten: list[tuple[str, int, CellChanges]] = []

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The base's tensors, every landed change written."""
        self._write_unwritten()
        return self._tensors

    @property
    def nbytes(self) -> int:
        """Host memory the base holds."""
        return sum(tensor.nbytes for tensor in self._tensors.values())

    def mismatch(self, layout: TrainerLayout) -> str | None:
        """Why the version `layout` holds cannot be encoded against this base (None: it can)."""
        if layout.layout_hash != self.layout_hash:
            return "the tensors (their names, dtypes, shapes or who holds them) changed"
        return None

    def encode(
        self,
        names: list[str],
        cells_of: Cells,
        holdings: Mapping[str, Holding],
        rank: int,
        pool: ThreadPoolExecutor | None,
    ) -> dict[str, list[CellChanges]]:
        """This rank's changes to `names`, in the cells it encodes (`pool` None: none,
        changed tensors go whole)."""
        found: dict[str, list[CellChanges]] = {}
        for name in names:
            owned = cells_of[name]
            if owned is None or pool is None:
                continue
            holding = holdings[name]
            mine = [(index, box) for index, (owner, box) in enumerate(owned) if owner == rank]
            if mine:
                found[name] = [
                    self._encode_cell(holding, self.tensors[name], index, box, pool)
                    for index, box in mine
                ]
        return found

    @staticmethod
    def _encode_cell(
        holding: Holding, base: torch.Tensor, index: int, cell: Box, pool: ThreadPoolExecutor
    ) -> CellChanges:
        box, cols = holding.box, holding.box.cols
        low, high = cell.row_start - box.row_start, cell.row_stop - box.row_start
        new = holding.local[low * cols : high * cols]
        old = base.reshape(-1)[low * cols : high * cols]
        indices, values = changes(old, new, pool)
        numel = holding.meta.numel
        indices = indices.to(index_dtype(numel)) + cell.row_start * cols
        return CellChanges(index, indices, values)

    def advance(
        self,
        sparse: Mapping[str, list[CellChanges]],
        full: list[str],
        holdings: Mapping[str, Holding],
    ) -> None:
        """Make the base a landed delta's version: the tensors that went `full` are copied from
        `holdings` now (the caller may change them once the push returned); this rank's
        `sparse` changes (held by the base) are written before the base is next read
        (`tensors`), not while the engines that just loaded are still busy."""
        tensors = self.tensors  # earlier changes written first
        for name in full:
            if name in tensors:
                tensors[name].copy_(holdings[name].tensor.detach())
        for name, found in sparse.items():
            box = holdings[name].box
            first = box.row_start * box.cols
            self._unwritten += [(name, first, changed) for changed in found]

    def _write_unwritten(self) -> None:
        for name, first, changed in self._unwritten:
            indices = changed.indices.long() - first if first else changed.indices
            scatter(self._tensors[name].reshape(-1), indices, changed.values)
        self._unwritten.clear()

    def replace(self, holdings: Mapping[str, Holding]) -> None:
        """Make the base another version of the same tensors, copied into its buffers."""
        self._unwritten.clear()
        for name, holding in holdings.items():
            self._tensors[name].copy_(holding.tensor.detach())

    def alike(self, holdings: Mapping[str, Holding]) -> bool:
        """The same tensors, dtypes and local shapes (a new version fits the buffers)."""
        if set(holdings) != set(self._tensors):
            return False
        return all(
            (h.tensor.dtype, tuple(h.tensor.shape))
            == (self._tensors[n].dtype, tuple(self._tensors[n].shape))
            for n, h in holdings.items()
        )


def slice_of(full: torch.Tensor, spec: SliceSpec) -> torch.Tensor:
    """A rank's slice of a full tensor (`SliceSpec`: a range along one dimension)."""
    return full.narrow(spec.dim, spec.start, spec.length) if full.dim() else full
