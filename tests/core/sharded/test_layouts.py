"""Who sends what, and the gather-free digests, over a matrix of trainer layouts (FSDP uneven,
FSDP x TP, Megatron TP, pipeline stages, replicated) into engines of TP 1 and 2, each trainer
rank simulated in this process: a tensor some rank holds whole goes whole from one of them (its
sender), the others in cells; every engine byte written once, from a rank that holds it,
bit-exact; digests equal to the whole tensors'."""

import pytest
import torch
import xxhash
from sharded_layouts import LAYOUTS, SHAPES, engine_slices, holdings, model

from weightbus.core.digest import combine_leaves, tensor_digest
from weightbus.core.plan.shard import ShardCopy
from weightbus.core.trainer.boxes import Box
from weightbus.core.trainer.cells import as_matrix, cell_view, make_schedule, slice_box
from weightbus.core.trainer.digests import DigestPlan, Region
from weightbus.core.trainer.layout import TrainerLayout, held_metas


def _layout(full, boxes_by_rank):
    held = [holdings(full, boxes) for boxes in boxes_by_rank]
    layout = TrainerLayout(tuple(tuple(held_metas(h)) for h in held))
    return layout, [{h.name: h for h in rank_held} for rank_held in held]


def _simulated_digests(plan: DigestPlan, held_by_rank) -> list[str]:
    """Each block hashed from the segments' owners' memory, as the ranks do between them."""
    blocks = [[b""] * count for count in plan.block_counts]
    for block in plan.blocks:
        name = plan.regions[block.region].name
        hasher = xxhash.xxh3_128()
        for segment in block.segments:
            hasher.update(held_by_rank[segment.rank][name].bytes_of(segment.start, segment.numel))
        blocks[block.region][block.index] = hasher.digest()
    metas = plan.layout.metas_by_name
    return [
        combine_leaves(region.box.rows, region.box.cols * metas[region.name].element_bytes, leaves)
        for region, leaves in zip(plan.regions, blocks, strict=True)
    ]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_every_engine_byte_once_from_its_holder_and_digests_without_a_gather(layout_name, tp):
    full = model(seed=3)
    layout, held = _layout(full, LAYOUTS[layout_name])
    slices = engine_slices(tp)
    pieces = make_schedule(layout, slices)

    # execute the schedule: each engine rank's slice filled exactly once, bit-exact
    written = [
        {name: torch.zeros_like(copies[0].source(full[name])) for name, copies in rank.items()}
        for rank in slices
    ]
    counts = [
        {name: torch.zeros(as_matrix(t).shape, dtype=torch.int32) for name, t in rank.items()}
        for rank in written
    ]
    sent = [0] * len(held)
    sent_unreplicated = [0] * len(held)  # of the tensors no two ranks hold the same part of
    for piece in pieces:
        holding = held[piece.owner][piece.name]  # the owner holds the cell
        source = cell_view(
            holding.local.view(holding.box.rows, holding.box.cols), holding.box, piece.cell
        )
        cell_view(as_matrix(written[piece.target][piece.name]), piece.slice_box, piece.cell).copy_(
            source
        )
        cell_view(counts[piece.target][piece.name], piece.slice_box, piece.cell).add_(1)
        sent[piece.owner] += source.nbytes
        if piece.name != "norm.weight":
            sent_unreplicated[piece.owner] += source.nbytes
    for name, sender in layout.senders.items():  # whole, from its sender
        whole = held[sender][name].tensor
        assert held[sender][name].whole
        for target, copies in enumerate(slices):
            (copy,) = copies[name]
            written[target][name].copy_(copy.source(whole))
            counts[target][name].add_(1)
            sent[sender] += copy.source(whole).nbytes
            if name != "norm.weight":
                sent_unreplicated[sender] += copy.source(whole).nbytes
    for rank, copies in enumerate(slices):
        for name, (copy,) in copies.items():
            assert torch.equal(written[rank][name], copy.source(full[name])), (rank, name)
            assert torch.all(counts[rank][name] == 1), (rank, name)
    engine_bytes = sum(
        copy.source(full[n]).nbytes for rank in slices for n, (copy,) in rank.items()
    )
    assert sum(sent) == engine_bytes  # a replicated byte leaves once
    if layout_name.startswith(
        ("fsdp-3", "megatron", "pipeline")
    ):  # nothing replicated but the norm
        for rank, rank_held in enumerate(held):
            holds = sum(
                (slice_box(h.meta, copy).intersect(h.box) or Box(0, 0, 0, 0)).numel
                * h.meta.element_bytes
                for h in rank_held.values()
                for engine in slices
                for copy in engine.get(h.name, [])
                if h.name != "norm.weight"
            )
            assert sent_unreplicated[rank] == holds  # exactly what it holds of what engines need
    # the digests: whole tensors (the fingerprint) and every engine rank's slice
    regions = [Region(name, Box.whole(shape)) for name, (shape, _) in SHAPES.items()]
    regions += [Region(p.name, p.slice_box) for p in pieces]
    plan = DigestPlan(layout, regions)
    digests = _simulated_digests(plan, held)
    for region, digest in zip(regions, digests, strict=True):
        box = region.box
        matrix = as_matrix(full[region.name])[
            box.row_start : box.row_stop, box.col_start : box.col_stop
        ]
        assert digest == tensor_digest(matrix), region


def test_a_part_no_rank_holds_is_named():
    full = model()
    boxes = LAYOUTS["fsdp-3-uneven"][:2]  # the third rank's rows are missing
    with pytest.raises(
        ValueError, match=r"tensor 'col.weight': no trainer rank holds rows 200:300"
    ):
        _layout(full, boxes)


def test_ranks_disagreeing_on_a_tensor_are_named():
    full = model()
    other = {**full, "norm.weight": full["norm.weight"].double()}
    held = [holdings(full, LAYOUTS["replicated-2"][0]), holdings(other, LAYOUTS["replicated-2"][1])]
    with pytest.raises(ValueError, match=r"'norm.weight': trainer rank 1 holds it as float64"):
        TrainerLayout(tuple(tuple(held_metas(h)) for h in held))


def test_empty_and_scalar_tensors_digest_like_the_gathered_ones():
    full = {"empty.weight": torch.empty(0, 4), "scale": torch.tensor(2.5)}
    boxes = [{name: Box.whole(tuple(t.shape)) for name, t in full.items()}] * 2  # replicated
    layout, held = _layout(full, boxes)
    regions = [Region(name, Box.whole(tuple(t.shape))) for name, t in full.items()]
    digests = _simulated_digests(DigestPlan(layout, regions), held)
    assert digests == [tensor_digest(t) for t in full.values()]
    assert layout.senders == {"scale": 0, "empty.weight": 1}  # whole: one replica each
    assert make_schedule(layout, [{"scale": [ShardCopy.whole(())]}]) == []
