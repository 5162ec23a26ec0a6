"""A sharded trainer for the tests: one process per rank (RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set), FSDP2 (`fully_shard` per decoder layer and at the root) on a gloo CPU mesh,
AdamW steps, pushes through a `Publisher` on the trainer's process group (every rank sends
what it holds). It runs the actions of its JSON argument in
order and writes one JSON line per action to `<out>/rank<r>.jsonl`; after each `push` with
`save`, rank 0 writes the gathered weights (for the test's checks only) to `<out>/<version>.pt`.

Actions: `train` (steps), `push` (version; `direct`: False packs the slots; `transport`:
`shm`, `nixl`, `dist` or `disk`; `quantize`: "fp8-block"; `experts`, for an MoE model whose
fused expert tensors FSDP2 cut by expert: `fsdp` (the model as is, the default), `declared`
(each rank's experts as `DeclaredShard`s of the fused tensors) or `per_expert` (the
checkpoint's per-expert tensors of the rank's experts); a push never gathers a DTensor),
`nan` (rank `on` holds a NaN), `raise` (rank `on` passes a non-tensor), `kill` (rank `on` dies
by SIGKILL as its copies start; over `dist`, as it packs its first parts).
"""

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from weightbus.core.publisher import DeclaredShard, Publisher
from weightbus.core.transport.shm.sender import ShmRankSender


def _model(source: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if source == "tiny":
        from weightbus.apps.demo.trainer import hf_llama_config
        from weightbus.engines.reference.models.config import tiny_config

        torch.manual_seed(0)
        return LlamaForCausalLM(hf_llama_config(tiny_config())).float()
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)  # the same batch on every rank
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 16), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _push(publisher: Publisher, model: torch.nn.Module, action: dict, rank: int) -> dict:
    weights: object = model
    if action["kind"] == "nan" and rank == action["on"]:
        name = "model.norm.weight"  # not the tied embeddings: a clone of those unties the head
        weights = {**model.state_dict(), name: model.state_dict()[name].detach().clone()}
        weights[name].to_local()[0] = float("nan")
    if action["kind"] == "raise" and rank == action["on"]:
        weights = {**model.state_dict(), "not.a.tensor": 3}
    if action["kind"] == "kill" and rank == action["on"]:
        die = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
        if action.get("transport") == "dist":
            from weightbus.core.transport.distributed.sender import DistRankSender

            DistRankSender._pack = die  # as its first bucket's parts are packed
        else:
            ShmRankSender._copy = die
    if action.get("experts", "fsdp") != "fsdp":
        weights = _expert_weights(model.state_dict(), action["experts"])
    options = dict(action.get("options", {}))
    with _no_gather():
        result = publisher.push(weights, version=action["version"], **options)
    return {
        "fingerprint": result.fingerprint,
        "quantization": result.quantization,
        "sent_bytes": result.rank_sent_bytes,
        "rank_nbytes": [e.rank_nbytes for e in result.engines],
    }


def _expert_weights(state: dict, form: str) -> dict:
    """The state dict with each fused expert DTensor as this rank's experts, declared
    (`DeclaredShard` at its first expert) or as the checkpoint's per-expert tensors."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    weights = {}
    for name, value in state.items():
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            weights[name] = value
            continue
        local = value.to_local()
        _, offset = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        if form == "declared":
            weights[name] = DeclaredShard(local, tuple(value.shape), tuple(offset))
            continue
        prefix, kind = name.rsplit(".", 1)
        half = value.shape[1] // 2
        for index in range(local.shape[0]):
            expert = f"{prefix}.{offset[0] + index}"
            if kind == "down_proj":
                weights[f"{expert}.down_proj.weight"] = local[index]
            else:
                weights[f"{expert}.gate_proj.weight"] = local[index, :half]
                weights[f"{expert}.up_proj.weight"] = local[index, half:]
    return weights


@contextlib.contextmanager
def _no_gather() -> Iterator[None]:
    """DTensor gathers raise while a push runs: no rank materialises what it does not hold."""
    from torch.distributed.tensor import DTensor

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a push gathered a DTensor")

    saved = DTensor.full_tensor, DTensor.redistribute
    DTensor.full_tensor = DTensor.redistribute = refuse
    try:
        yield
    finally:
        DTensor.full_tensor, DTensor.redistribute = saved


def _publisher(args: dict, direct: bool, transport: str, quantize: str | None) -> Publisher:
    engines = args["engines"]
    if args.get("vllm"):
        from weightbus.engines.vllm.target import VllmEngineTarget

        engines = [VllmEngineTarget(url) for url in engines]
    options = {} if direct else {"direct": False}
    return Publisher(
        engines, group=dist.group.WORLD, timeout_s=args["timeout_s"], transport=transport,
        transport_options=options, quantize=quantize,
    )  # fmt: skip


def main() -> None:
    args = json.loads(sys.argv[1])
    out = Path(args["out"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    model = _model(args["model"])
    layers = model.model.layers
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    publishers: dict[tuple[bool, str, str | None], Publisher] = {}
    with (out / f"rank{rank}.jsonl").open("w") as records:
        for index, action in enumerate(args["actions"]):
            if action["kind"] == "train":
                _train(model, optimizer, action["steps"], seed=index)
                continue
            record, start = {"action": action}, time.monotonic()
            try:
                key = (
                    action.get("direct", True),
                    action.get("transport", "shm"),
                    action.get("quantize"),
                )
                if key not in publishers:  # every rank builds it at the same action
                    publishers[key] = _publisher(args, *key)
                record |= {"ok": True, **_push(publishers[key], model, action, rank)}
            except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
                record |= {"ok": False, "error": type(exc).__name__, "message": str(exc)}
            record["seconds"] = time.monotonic() - start
            records.write(json.dumps(record) + "\n")
            records.flush()
            if record["ok"] and action.get("save"):
                gathered = {k: v.full_tensor() for k, v in model.state_dict().items()}
                if rank == 0:
                    torch.save(gathered, out / f"{action['version']}.pt")
    for publisher in publishers.values():
        publisher.close()
    os._exit(0)  # a killed peer would leave gloo's teardown waiting


if __name__ == "__main__":
    main()
