"""Expert-parallel trainer layouts: what each rank holds of transformers 5's fused expert
tensors, as per-expert boxes, and who sends each expert.

Each rank of a 2x2 mesh (experts x FSDP) is simulated in this process on torch's fake process
group (only the rank's mesh coordinate matters to a DTensor's local block); the pushes of real
rank processes are in tests/core/pushes/test_moe_trainer_ranks.py.
"""

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from weightbus.core.experts import split_fused_experts
from weightbus.core.trainer import holdings as holdings_module
from weightbus.core.trainer.holdings import DeclaredShard, holdings_of
from weightbus.core.trainer.layout import TrainerLayout, held_metas

EXPERTS, HIDDEN, INTERMEDIATE = 8, 4, 6
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
DOWN = "model.layers.0.mlp.experts.down_proj"
MESH_PLACEMENTS = {  # the fused tensors' placements on an (experts, fsdp) mesh
    "ep_fsdp_rows": {GATE_UP: (Shard(0), Shard(1)), DOWN: (Shard(0), Shard(1))},
    "ep_fsdp_columns": {GATE_UP: (Shard(0), Shard(2)), DOWN: (Shard(0), Shard(2))},
    "ep_replicated": {GATE_UP: (Shard(0), Replicate()), DOWN: (Shard(0), Replicate())},
    "ep_fsdp_nested": {GATE_UP: (Shard(0), Shard(0)), DOWN: (Shard(0), Shard(0))},
}


def _fused(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        GATE_UP: torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator),
        DOWN: torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator),
    }


def _expected() -> dict[str, torch.Tensor]:
    """The per-expert tensors of the whole model (what a push names)."""
    return {k: v for name, t in _fused().items() for k, v in split_fused_experts(name, t)}


def _expert(name: str) -> int:
    return int(name.split(".experts.")[1].split(".", maxsplit=1)[0])


def _mesh_holdings(placements: dict) -> list[list]:
    """Each rank's holdings of the fused tensors as DTensors on its 2x2 mesh."""
    full = _fused()
    by_rank = []
    for rank in range(4):
        dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
        holdings_module._local_shape_and_offset.cache_clear()  # keyed by mesh, not by rank
        try:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "fsdp"))
            weights = {}
            for name, tensor in full.items():
                shape, offset = compute_local_shape_and_global_offset(
                    tensor.shape, mesh, placements[name]
                )
                index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
                weights[name] = DTensor.from_local(
                    tensor[index].clone(), mesh, placements[name], shape=tensor.shape,
                    stride=tensor.stride(), run_check=False,
                )  # fmt: skip
            by_rank.append(holdings_of(weights)[0])
        finally:
            dist.destroy_process_group()
            holdings_module._local_shape_and_offset.cache_clear()
    return by_rank


def _check_held_exactly(by_rank: list[list], expected: dict[str, torch.Tensor]) -> TrainerLayout:
    """Every rank's boxes hold the expert's bytes; the layout covers every expert."""
    for held in by_rank:
        for each in held:
            box = each.box
            part = expected[each.name][box.row_start : box.row_stop, box.col_start : box.col_stop]
            assert torch.equal(each.matrix(), part), each.name
    layout = TrainerLayout(tuple(tuple(held_metas(held)) for held in by_rank))
    assert {meta.name for meta in layout.metas} == set(expected)
    return layout


@pytest.mark.parametrize("mesh_case", list(MESH_PLACEMENTS))
def test_a_two_d_mesh_holds_each_expert_only_on_its_expert_ranks(mesh_case):
    by_rank = _mesh_holdings(MESH_PLACEMENTS[mesh_case])
    expected = _expected()
    layout = _check_held_exactly(by_rank, expected)
    for rank, held in enumerate(by_rank):
        experts = {_expert(h.name) for h in held}
        first = 4 * (rank // 2)  # the experts' mesh dimension: ranks 0-1 hold 0-3, 2-3 hold 4-7
        if mesh_case == "ep_fsdp_nested":
            first = 2 * rank
            assert experts == set(range(first, first + 2))
        else:
            assert experts == set(range(first, first + 4))
    whole_sent = [0] * 4
    for name, rank in layout.senders.items():
        whole_sent[rank] += layout.metas_by_name[name].nbytes
    total = sum(t.nbytes for t in expected.values())
    down = {n for n in expected if n.endswith("down_proj.weight")}
    if mesh_case == "ep_fsdp_columns":  # every matrix's columns cut: all sent in cells
        assert whole_sent == [0] * 4
    elif mesh_case == "ep_fsdp_rows":  # gate / up rows on the FSDP halves: whole; down in cells
        assert set(layout.senders) == set(expected) - down
        assert whole_sent == [(total - sum(expected[n].nbytes for n in down)) // 4] * 4
    else:  # whole experts on one rank, or on two replicas sharing the sends: each byte once
        assert set(layout.senders) == set(expected)
        assert whole_sent == [total // 4] * 4


def test_declared_expert_shards_and_per_expert_tensors_mix_on_the_ranks():
    full, expected = _fused(), _expected()
    rank0 = {  # Megatron-style: experts 0-4 declared as a block of the fused tensors
        name: DeclaredShard(tensor[:5], tuple(tensor.shape), (0, 0, 0))
        for name, tensor in full.items()
    }
    rank1 = {  # the checkpoint's per-expert tensors of experts 5-7
        name: tensor for name, tensor in expected.items() if _expert(name) >= 5
    }
    by_rank = [holdings_of(rank0)[0], holdings_of(rank1)[0]]
    layout = _check_held_exactly(by_rank, expected)
    sent = [0, 0]
    for name, rank in layout.senders.items():
        sent[rank] += layout.metas_by_name[name].nbytes
    per_expert = sum(t.nbytes for t in expected.values()) // EXPERTS
    assert sent == [5 * per_expert, 3 * per_expert]
    assert all(h.tensor.data_ptr() >= full[GATE_UP].data_ptr() for h in by_rank[0][:2])


def test_an_expert_no_rank_holds_and_a_block_outside_are_named():
    full = _fused()
    rank0 = {name: DeclaredShard(t[:3], tuple(t.shape), (0, 0, 0)) for name, t in full.items()}
    rank1 = {name: DeclaredShard(t[4:], tuple(t.shape), (4, 0, 0)) for name, t in full.items()}
    missing = re.escape("no trainer rank holds expert tensor 'model.layers.0.mlp.experts.3.gate_")
    with pytest.raises(ValueError, match=missing):
        TrainerLayout(tuple(tuple(held_metas(holdings_of(r)[0])) for r in (rank0, rank1)))
    outside = {GATE_UP: DeclaredShard(full[GATE_UP][:3], tuple(full[GATE_UP].shape), (6, 0, 0))}
    with pytest.raises(ValueError, match=rf"{GATE_UP}.*outside \[8, 12, 4\]"):
        holdings_of(outside)
    odd = {GATE_UP: DeclaredShard(torch.zeros(2, 5, 4), (8, 5, 4), (0, 0, 0))}
    with pytest.raises(ValueError, match="5 rows is odd"):
        holdings_of(odd)
