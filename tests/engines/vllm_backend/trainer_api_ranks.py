"""One rank of a trainer that pushes through vLLM's own trainer API (`torchrun`-style: RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): a `WeightSource` whose `held_names()` are this
rank's pipeline stage (the embeddings and its layers; the last rank the norm and head), sent
with backend `weightbus` from every rank. Rank 0 saves the weights it trained for the test."""

import json
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.plugins import load_general_plugins
from vllm_harness import trained

from weightbus.engines.vllm.trainer import WeightbusTrainerInitInfo


class PipelineSource(WeightSource):
    """Stage `rank` of `world` of `model`: layer i on rank i % world, the embeddings on rank 0,
    the final norm and the head on the last rank."""

    def __init__(self, model: torch.nn.Module, rank: int, world: int) -> None:
        self.params = dict(model.named_parameters())
        self.rank, self.world = rank, world

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.params.items()]

    def held_names(self) -> set[str]:
        return {name for name in self.params if self._stage(name) == self.rank}

    def _stage(self, name: str) -> int:
        if ".layers." in name:
            return int(name.split(".layers.")[1].split(".", maxsplit=1)[0]) % self.world
        return 0 if "embed_tokens" in name else self.world - 1

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        held = self.held_names()
        for group in self.groups():
            for name in group:
                yield name, self.params[name].detach() if name in held else None


def main() -> None:
    args = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    load_general_plugins()  # a trainer process loads vLLM's plugins itself: backend weightbus
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args["model_dir"], dtype=torch.float32)
    model = trained(model, seed=args["seed"])  # the same step on every rank
    info = WeightbusTrainerInitInfo(
        rank=rank, world_size=world, engine_tp_size=2, version_prefix=args["prefix"]
    )
    client = HTTPVLLMWeightSyncClient(args["url"], timeout=60)
    record = {"rank": rank, "held": sorted(PipelineSource(model, rank, world).held_names())}
    try:
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=client, source=PipelineSource(model, rank, world)
        )
        engine.send_weights()
        record["sent_bytes"] = engine.last_push.rank_sent_bytes
        record["fingerprint"] = engine.last_push.fingerprint
        engine.shutdown()
        record["ok"] = True
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
        record |= {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out = Path(args["out"])
    if rank == 0:
        torch.save(model.state_dict(), out / "trained.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    os._exit(0)


if __name__ == "__main__":
    main()
