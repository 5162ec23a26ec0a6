"""Safetensors files every trainer rank writes its part of (`disk`, `hf_dir`).

The leader lays each file out: its safetensors header (tensors largest element first, so each
starts aligned to its element size) and its size, the bytes still holes (`create_file`). Every
rank then writes what it sends at its offsets (`os.pwrite`): a tensor it sends whole in one
write, digested from the same bytes; its parts of a tensor sent in cells, each element by one
rank (`trainer.parts.range_parts`), digested in blocks (`trainer.digests`). The leader combines
the digests and publishes the files (a manifest, an index) with one rename: readers see a whole
session or none.
"""

import json
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import msgspec

from weightbus.core.checkpoint import SAFETENSORS_DTYPES
from weightbus.core.digest import tensor_digest
from weightbus.core.meta import TensorMeta
from weightbus.core.plan.bucket import byte_view
from weightbus.core.trainer.digests import BlockDigests, RankDigests, compute
from weightbus.core.trainer.digests import digest_plan as blocks_plan
from weightbus.core.trainer.layout import TrainerLayout
from weightbus.core.trainer.parts import SlotPart, range_parts
from weightbus.core.transport.sending import RankSender, RankWork

_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


class FileLayout(msgspec.Struct, frozen=True, array_like=True):
    """One file: its path, and where each tensor's bytes start in it."""

    path: str
    offsets: dict[str, int]


class FilesOrder(msgspec.Struct, frozen=True, kw_only=True):
    """The leader's order: write your part of these files (laid out and sized)."""

    files: list[FileLayout]


class FilesReport(msgspec.Struct, frozen=True, kw_only=True):
    """A rank's part written: its bytes, and its share of the digests."""

    sent_bytes: int
    digests: RankDigests


def create_file(path: Path, metas: Sequence[TensorMeta]) -> FileLayout:
    """A safetensors file of `metas`' size holding only its header; where each tensor's bytes go."""
    ordered = sorted(metas, key=lambda meta: -meta.element_bytes)
    header, data_offsets, position = {}, {}, 0
    for meta in ordered:
        header[meta.name] = {
            "dtype": _SAFETENSORS_NAMES[meta.dtype],
            "shape": list(meta.shape),
            "data_offsets": [position, position + meta.nbytes],
        }
        data_offsets[meta.name] = position
        position += meta.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % 8)  # the data starts 8-byte aligned
    start = 8 + len(encoded)
    with path.open("wb") as file:
        file.write(len(encoded).to_bytes(8, "little") + encoded)
        file.truncate(start + position)
    path.chmod(0o600)
    return FileLayout(str(path), {name: start + offset for name, offset in data_offsets.items()})


class FileRankSender(RankSender):
    """A trainer rank's side of file transports (the parts of each layout, kept while it is
    unchanged)."""

    order_type = FilesOrder
    report_type = FilesReport

    def __init__(self, group: object) -> None:
        super().__init__(group)  # type: ignore[arg-type]
        self._parts: tuple[tuple, list[list[SlotPart]]] | None = None

    def run(self, order: FilesOrder, work: RankWork) -> FilesReport:
        rank, layout = self.group.rank, work.layout
        whole: dict[str, str] = {}
        sent = 0
        parts = self._compile(layout, order)
        for file, file_parts in zip(order.files, parts, strict=True):
            descriptor = os.open(file.path, os.O_WRONLY)
            try:
                for name, offset in file.offsets.items():
                    if layout.sender(name) == rank:
                        tensor = work.holdings[name].tensor.detach().contiguous()
                        sent += os.pwrite(descriptor, byte_view(tensor).numpy(), offset)
                        whole[name] = tensor_digest(tensor)
                for part in file_parts:
                    if part.rank == rank:
                        data = work.holdings[part.name].bytes_of(part.start, part.numel)
                        sent += os.pwrite(descriptor, data, part.slot_offset)
            finally:
                os.close(descriptor)
            if work.remaining_s() <= 0:
                raise TimeoutError("the files were not written in time")
        plan = blocks_plan(layout)
        blocks = BlockDigests([])
        if plan.regions:
            blocks = compute(plan, work.holdings, work.group, f"{work.key}/digests", work.deadline)
        return FilesReport(sent_bytes=sent, digests=RankDigests(whole=whole, blocks=blocks))

    def _compile(self, layout: TrainerLayout, order: FilesOrder) -> list[list[SlotPart]]:
        """Who writes which part of each tensor sent in cells, per file (same on every rank)."""
        key = (
            layout.layout_hash,
            tuple((Path(f.path).name, tuple(f.offsets.items())) for f in order.files),
        )
        if self._parts is None or self._parts[0] != key:
            metas = layout.metas_by_name
            load: dict[int, int] = defaultdict(int)
            parts = [
                [
                    part
                    for name, offset in file.offsets.items()
                    if layout.sender(name) is None
                    for part in range_parts(
                        layout, metas[name], 0, metas[name].numel, offset=offset, load=load
                    )
                ]
                for file in order.files
            ]
            self._parts = (key, parts)
        return self._parts[1]
