"""`dist` parts mode over the layout matrix: per bucket, each engine rank's regions cut into
parts, each sent by a trainer rank that holds it (a tensor some rank holds whole: by its
sender, one part per region). Buckets small enough that tensors split across them, at row
boundaries and inside rows: the parts, copied from the senders' memory as the engine rank
receives them, give exactly the bytes of its regions, every element once."""

import pytest
import torch
from sharded_layouts import LAYOUTS, SHAPES, engine_slices, holdings, model

from weightbus.core.plan import plan_buckets
from weightbus.core.plan.bucket import BucketEntry, pack_entries
from weightbus.core.trainer.boxes import Box
from weightbus.core.trainer.cells import cell_view
from weightbus.core.trainer.layout import TrainerLayout, held_metas
from weightbus.core.transport.distributed.schedule import bucket_parts
from weightbus.core.transport.distributed.slices import (
    entry_box,
    rank_regions,
    region_matrix,
    slice_targets,
)
from weightbus.core.wire.messages import RankLayout, SentPart, SliceSpec

# smaller than every matrix: tensors split at row boundaries; and smaller than a row of
# `row.weight` (1200 bytes): split inside rows, as chunks of bytes
BUCKET_BYTES = (40_192, 1_024)
# and one process holding every tensor (a group of one: every part from rank 0, whole)
ALL_LAYOUTS = {
    **LAYOUTS,
    "one-process": [{name: Box.whole(shape) for name, (shape, _) in SHAPES.items()}],
}


def _rank_layouts(tp: int) -> list[RankLayout]:
    layouts = []
    for rank, copies in enumerate(engine_slices(tp)):
        specs = [
            SliceSpec(name, copy.src_dim, copy.src_start, copy.length)
            for name, (copy,) in copies.items()
            if tp > 1 and name != "norm.weight"
        ]
        layouts.append(RankLayout(group_rank=4 + rank, tp_rank=rank, tp_size=tp, slices=specs))
    return layouts


def _fill(matrix: torch.Tensor, part: SentPart, source: torch.Tensor, seen: torch.Tensor) -> None:
    rows, cols = slice(part.row_start, part.row_stop), slice(part.col_start, part.col_stop)
    matrix[rows, cols].copy_(source.view(matrix.dtype).view(matrix[rows, cols].shape))
    seen[rows, cols] += 1


@pytest.mark.parametrize("bucket_bytes", BUCKET_BYTES)
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("layout_name", list(ALL_LAYOUTS))
def test_parts_give_every_region_byte_once_from_a_holder(layout_name, tp, bucket_bytes):
    full = model(seed=4)
    held = [holdings(full, boxes) for boxes in ALL_LAYOUTS[layout_name]]
    layout = TrainerLayout(tuple(tuple(held_metas(h)) for h in held))
    by_rank = [{h.name: h for h in rank_held} for rank_held in held]
    plan = plan_buckets(layout.metas, bucket_bytes)
    targets = slice_targets(_rank_layouts(tp))
    parts = bucket_parts(layout, plan, targets)
    chunks = [e for b in plan.buckets for e in b.entries if e.is_chunk]
    in_rows = [e for e in chunks if entry_box(e, SliceSpec(e.name, 0, 0, e.shape[0])) is None]
    assert chunks
    assert bool(in_rows) == (bucket_bytes < 1200)
    for bucket, per_target in zip(plan.buckets, parts, strict=True):
        reference = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        pack_entries(reference, bucket.entries, full)
        for target, target_parts in zip(targets, per_target, strict=True):
            expected = rank_regions(bucket, reference, target.slices)
            received = torch.zeros_like(reference)
            regions = [region_matrix(r) for r in rank_regions(bucket, received, target.slices)]
            seen = [torch.zeros(m.shape, dtype=torch.int32) for m in regions]
            for send in target_parts:
                holding = by_rank[send.part.src][send.name]  # the sender holds it
                sender = layout.sender(send.name)
                assert sender in (None, send.part.src)  # a tensor held whole: by its sender
                same_entry = [p for p in target_parts if p.part.entry == send.part.entry]
                assert sender is None or same_entry == [send]  # ... in one part
                if send.cell is None:
                    source = torch.from_numpy(holding.bytes_of(send.start, send.numel))
                else:
                    local = holding.local.view(holding.box.rows, holding.box.cols)
                    source = cell_view(local, holding.box, send.cell).contiguous()
                    source = source.view(torch.uint8).view(-1)
                _fill(regions[send.part.entry], send.part, source, seen[send.part.entry])
            for index, (matrix, want) in enumerate(zip(regions, expected, strict=True)):
                assert torch.equal(matrix, region_matrix(want)), (bucket.index, index)
                assert torch.all(seen[index] == 1), (bucket.index, index)


def test_a_slice_after_the_second_dimension_is_refused_naming_the_tensor():
    entry = BucketEntry("conv.weight", "float32", (4, 4, 4), offset=0, nbytes=256)
    with pytest.raises(ValueError, match=r"tensor 'conv.weight': slices along dimension 2"):
        entry_box(entry, SliceSpec("conv.weight", 2, 0, 2))
