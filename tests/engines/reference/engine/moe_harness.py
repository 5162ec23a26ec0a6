"""One rank of the mixture-of-experts runs at 2 ranks: each layout of the experts (split over
TP, expert parallel linear / round-robin / with redundant slots), a re-placement, and corrupted
replicas. Saves logits and greedy tokens per scenario for `test_moe_vs_hf.py`.

Started as `python moe_harness.py JSON_ARGS` (plain argv, nothing pickled).
"""

import json
import os
import sys
from pathlib import Path

import torch
from engine_harness import NUM_GREEDY_TOKENS, PROMPT, greedy_generate
from safetensors.torch import save_file

from weightbus.engines.reference.engine.model_runner import ModelRunner
from weightbus.engines.reference.layers.parallel import destroy_tp_group, init_tp_group
from weightbus.engines.reference.models.experts import ExpertLayout, ExpertMap, place_experts
from weightbus.engines.reference.models.loader import resolve_config

# the maps experts move to: under TP a permutation of the one row's slots; under EP with 2
# redundant slots, experts that change rank (7 to rank 0) and other replicated ones (0 and 1)
TP_MOVED_MAP = ExpertMap(8, ((7, 6, 5, 4, 3, 2, 1, 0),))
EP_MOVED_MAP = ExpertMap(8, ((7, 5, 3, 1, 0), (6, 4, 2, 0, 1)))
REDUNDANT = ExpertLayout(expert_parallel=True, redundant_experts=2)


def _runner(model_dir: str, layout: ExpertLayout) -> ModelRunner:
    return ModelRunner(
        config=resolve_config(model_dir, expert_layout=layout),
        source=model_dir,
        dtype=torch.float32,
        max_num_seqs=1,
        max_model_len=64,
    )


def _generate(runner: ModelRunner) -> dict[str, torch.Tensor]:
    logits, tokens = greedy_generate(runner, PROMPT, NUM_GREEDY_TOKENS)
    return {"logits": logits.contiguous(), "tokens": torch.tensor(tokens)}


def _layouts(model_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    results = {}
    for name, layout in {
        "ep2_linear": ExpertLayout(expert_parallel=True),
        "ep2_round_robin": ExpertLayout(expert_parallel=True, placement="round_robin"),
        "ep2_redundant": REDUNDANT,
    }.items():
        results[name] = _generate(_runner(model_dir, layout))
    return results


def _moved(model_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    tp = _runner(model_dir, ExpertLayout())
    tp.model.place_experts(TP_MOVED_MAP)
    # an engine's live and staging models move alike
    live, staging = _runner(model_dir, REDUNDANT), _runner(model_dir, REDUNDANT)
    place_experts([live.model, staging.model], EP_MOVED_MAP)
    return {
        "tp2_moved": _generate(tp),
        "ep2_moved_live": _generate(live),
        "ep2_moved_staging": _generate(staging),
    }


def _routed_parities(runner: ModelRunner) -> dict[int, set[int]]:
    """Expert -> parities of the prompt tokens routed to it (in any MoE layer)."""
    parities: dict[int, set[int]] = {}

    def record(module: torch.nn.Module, args: tuple, output: tuple) -> None:
        for token, ids in enumerate(output[1].tolist()):
            for expert in ids:
                parities.setdefault(expert, set()).add(token % 2)

    gates = [layer.mlp.gate for layer in runner.model.model.layers if hasattr(layer.mlp, "gate")]
    hooks = [gate.register_forward_hook(record) for gate in gates]
    greedy_generate(runner, PROMPT, 1)
    for hook in hooks:
        hook.remove()
    return parities


def _replicas_both_parities_reach(runner: ModelRunner) -> ExpertMap:
    """Rank 0 [0 1 2 3 x], rank 1 [4 5 6 7 y] with x and y experts that prompt tokens of
    both parities reach (so both copies of each get tokens: token i takes copy i % 2)."""
    parities = _routed_parities(runner)

    def best(candidates: range) -> int:
        return max(candidates, key=lambda e: (len(parities.get(e, ())), e))

    return ExpertMap(8, ((0, 1, 2, 3, best(range(4, 8))), (4, 5, 6, 7, best(range(4)))))


def _corrupted_replicas(model_dir: str, rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """Prompt logits with one copy of a replicated expert corrupted (in every MoE layer), for
    each copy in turn; and the logits uncorrupted (`ep2_replicas_placed`)."""
    runner = _runner(model_dir, REDUNDANT)
    runner.model.place_experts(_replicas_both_parities_reach(runner))
    results = {"ep2_replicas_placed": _generate(runner)}
    expert_map = runner.model.expert_map
    layers = [
        layer.mlp.experts for layer in runner.model.model.layers if hasattr(layer.mlp, "experts")
    ]
    for expert in range(expert_map.num_experts):
        copies = expert_map.replicas(expert)
        for holder, slot in copies if len(copies) > 1 else ():
            saved = [layer.w13_weight.data[slot].clone() for layer in layers]
            if holder == rank:
                for layer in layers:
                    layer.w13_weight.data[slot] += 1.0
            logits, _ = greedy_generate(runner, PROMPT, 1)
            for layer, weight in zip(layers, saved, strict=True):
                layer.w13_weight.data[slot] = weight
            results[f"corrupt_e{expert}_rank{holder}"] = {"logits": logits.contiguous()}
    return results


def _fp8(fp8_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """Block-FP8 experts: split over TP (weights and scales sliced on block edges), and
    expert parallel after a move (scales move with their experts)."""
    ep = _runner(fp8_dir, REDUNDANT)
    ep.model.place_experts(EP_MOVED_MAP)
    return {"tp2_fp8": _generate(_runner(fp8_dir, ExpertLayout())), "ep2_fp8_moved": _generate(ep)}


def moe_rank_main(
    rank: int, tp_size: int, store_port: int, model_dir: str, fp8_dir: str, out_dir: str
) -> None:
    """Body of one rank process: every scenario, saved to `out_dir/rank{rank}.safetensors`
    as `{scenario}.logits` and `{scenario}.tokens`."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    init_tp_group(
        tp_rank=rank, tp_size=tp_size, store_host="127.0.0.1", store_port=store_port, timeout_s=60
    )
    try:
        results = _layouts(model_dir) | _moved(model_dir) | _corrupted_replicas(model_dir, rank)
        results |= _fp8(fp8_dir)
        tensors = {
            f"{scenario}.{key}": value
            for scenario, saved in results.items()
            for key, value in saved.items()
        }
        save_file(tensors, str(Path(out_dir) / f"rank{rank}.safetensors"))
    finally:
        destroy_tp_group()


if __name__ == "__main__":
    moe_rank_main(*json.loads(sys.argv[1]))
