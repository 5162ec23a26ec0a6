"""One trainer process on a cluster host, driven by its parent over stdin and stdout (JSON lines).

Run by `ranks.TrainerRanks` inside a host (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; the
trainer group's gloo runs over the hosts' links). Its argument (JSON) says what it holds:

- `{"checkpoint": DIR}`: the checkpoint's Llama, sharded with FSDP2's `fully_shard` over the
  trainer's ranks (each rank fills its own rows from the checkpoint: never the whole model);
- `{"tensors": DIR}`: the checkpoint's tensors as it names them, whole, in one process (a
  Qwen3-MoE's per-expert tensors, which transformers' own model class fuses);
- `{"trainer": CONFIG, "lr": LR, "frozen_embeddings": BOOL}`: the demo's RL trainer (fp32 Adam)
  on that model config, one process; its weights are pushed cast to bf16.

Then it answers one line per command, `{"ok": true, ...}` or `{"ok": false, "error": ...}`:

- `open`: a publisher `key` (`kind` `sharded`: a `Publisher` on every rank's group; `plain`: a
  `Publisher` on this process) with `engines` and constructor `options`;
- `push`: `key`, `version`, push `options`: the push's seconds, fingerprint, the bytes this rank
  sent and, on rank 0, the bytes each engine rank received;
- `step`: one RL step of the trainer (on-policy rollouts from its own model);
- `base`: tell publisher `key` that its engines serve the current weights as `version`.
"""

import dataclasses
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from weightbus.core.publisher import Publisher

_GROUP_TIMEOUT_S = 600


def fsdp_model(model_dir: str) -> torch.nn.Module:
    """The checkpoint's Llama in bf16, built on the meta device and sharded with FSDP2's
    `fully_shard` (per decoder layer and at the root) on a gloo CPU mesh of the default group;
    each rank fills its own rows from the checkpoint (never the whole model)."""
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as checkpoint, torch.no_grad():
        for name, param in model.state_dict().items():
            shape, offset = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements
            )
            param.to_local().copy_(checkpoint.get_slice(name)[offset[0] : offset[0] + shape[0]])
    return model


class _Trainer:
    """The demo's trainer: its RL step, and its weights as a bf16 engine serves them."""

    def __init__(self, spec: dict) -> None:
        from weightbus.apps.demo.trainer import Trainer, hf_llama_config
        from weightbus.engines.reference.models.config import tiny_config

        config = dataclasses.replace(tiny_config(), **spec["trainer"])
        self.trainer = Trainer(hf_llama_config(config), seed=0, lr=spec["lr"])
        if spec["frozen_embeddings"]:  # no gradient: Adam leaves the tensor alone
            self.trainer.model.get_input_embeddings().weight.requires_grad_(False)
        self.steps = 0
        if directory := spec.get("save"):
            self.trainer.save(Path(directory))

    def step(self) -> dict:
        from weightbus.apps.demo.onpolicy import GROUP_SIZE, rollouts_of

        self.steps += 1
        reward, _ = self.trainer.step(rollouts_of(self.trainer, seed=self.steps), GROUP_SIZE)
        return {"reward": reward}

    def weights(self) -> dict[str, torch.Tensor]:
        return {
            name: param.detach().to(torch.bfloat16)
            for name, param in self.trainer.model.named_parameters()
        }


class Rank:
    """What this process holds and the publishers it pushes through."""

    def __init__(self, spec: dict) -> None:
        self.publishers: dict[str, Publisher] = {}
        self.trainer = _Trainer(spec) if "trainer" in spec else None
        self.model = fsdp_model(spec["checkpoint"]) if "checkpoint" in spec else None
        self.tensors = (
            load_file(Path(spec["tensors"]) / "model.safetensors") if "tensors" in spec else None
        )

    def weights(self) -> Any:
        if self.trainer is not None:
            return self.trainer.weights()
        if self.tensors is not None:
            return self.tensors
        assert self.model is not None
        if dist.get_world_size() == 1:  # a plain publisher takes the whole (local) tensors
            return {name: p.to_local() for name, p in self.model.state_dict().items()}
        return self.model

    def open(self, command: dict) -> dict:
        group = {"group": dist.group.WORLD} if command["kind"] == "sharded" else {}
        publisher = Publisher(command["engines"], **group, **command["options"])
        if group := command.get("weights_group"):
            publisher.init_weights_group(group, timeout_s=_GROUP_TIMEOUT_S)
        self.publishers[command["key"]] = publisher
        return {}

    def push(self, command: dict) -> dict:
        publisher = self.publishers[command["key"]]
        start = time.perf_counter()
        result = publisher.push(self.weights(), version=command["version"], **command["options"])
        seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "fingerprint": result.fingerprint,
            "sent_bytes": result.rank_sent_bytes[publisher.rank],
            "engine_rank_bytes": [e.rank_nbytes for e in result.engines],
            "delta": None if result.delta is None else result.delta.sent,
            "nbytes": result.nbytes,
        }

    def base(self, command: dict) -> dict:
        self.publishers[command["key"]].set_delta_base(self.weights(), version=command["version"])
        return {}

    def step(self, command: dict) -> dict:
        assert self.trainer is not None, "step: this rank holds no trainer"
        return self.trainer.step()

    def close(self) -> None:
        for publisher in self.publishers.values():
            publisher.close()


def _reply(payload: dict) -> None:
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


def main() -> None:
    spec = json.loads(sys.argv[1])
    # one core per process unless told (`threads`): the hosts share this machine's cores
    torch.set_num_threads(spec.get("threads", 1))
    if "checkpoint" in spec:
        dist.init_process_group("gloo", timeout=timedelta(seconds=_GROUP_TIMEOUT_S))
    rank = Rank(spec)
    _reply({"ok": True, "ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        try:
            _reply({"ok": True, **getattr(rank, command["op"])(command)})
        except Exception as exc:  # noqa: BLE001 - the parent reads every failure
            _reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    rank.close()
    os._exit(0)  # no teardown of the gloo group: the parent closed our stdin, it is done


if __name__ == "__main__":
    main()
