"""The trainer side of backend `weightbus` in vLLM's own trainer API: on every trainer rank,
`WeightTransferTrainerFactory.trainer_init(WeightbusTrainerInitInfo(rank=r, world_size=n),
client=..., source=...)`, then `send_weights()` per round, also on every rank.

Each rank builds a weightbus `Publisher` on the trainer's process group (one rank: a group of
one), whose one engine, on rank 0, is the vLLM client; each round every rank sends what it
holds of the `WeightSource`: the names of its `held_names()` (pipeline stages, expert
parallelism: vLLM's ownership contract), or, for a `ModuleSource` over an FSDP2 module, its
own shards (read where they are: no `full_tensor()` gather).
"""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)

from weightbus.core.plan import DEFAULT_BUCKET_BYTES
from weightbus.core.publisher import Publisher
from weightbus.engines.vllm import BACKEND
from weightbus.engines.vllm.messages import VllmInitInfo
from weightbus.engines.vllm.target import VllmClientTarget, VllmEngineTarget


def _server_tp_size(client: object, timeout_s: float) -> int:
    """The workers of the server `client` talks to (`VllmEngineTarget.tp_size` on its URL)."""
    base_url = getattr(client, "base_url", None)
    if base_url is None:
        raise ValueError(
            f"WeightbusTrainerInitInfo.engine_tp_size: {type(client).__name__} has no base_url "
            "to ask the server's TP size: give engine_tp_size"
        )
    target = VllmEngineTarget(base_url)
    try:
        return target.tp_size(timeout_s)
    finally:
        target.close()


@dataclass
class WeightbusTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of backend `weightbus`.

    Attributes:
        world_size: the trainer ranks that send (each calls `trainer_init` and
            `send_weights`); with more than one, `group` (or the default process group) holds
            them, rank 0 the sender that talks to vLLM.
        group: the trainer's `torch.distributed` process group of those ranks (None: the
            default one).
        transport: the weightbus transport (`shm` on one host; `disk` anywhere a shared
            directory is; `nixl`, `dist`).
        engine_tp_size: the engine's number of workers (None: asked of the server, through the
            client's `base_url`, as `HTTPVLLMWeightSyncClient` has).
        control_host: an address of rank 0 every rank reaches (the ranks' store).
    """

    backend: ClassVar[str] = BACKEND
    world_size: int = 1
    group: Any = None
    transport: str = "shm"
    engine_tp_size: int | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 120.0
    version_prefix: str = "v"
    control_host: str = "127.0.0.1"


class WeightbusTrainerEngine(TrainerWeightTransferEngine[WeightbusTrainerInitInfo]):
    """Pushes the trainer's `WeightSource` with weightbus each round, every rank sending what
    it holds (`last_push`: the last round's `PushResult`, the same on every rank)."""

    init_info_cls = WeightbusTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        """Every rank: build this rank's Publisher (rank 0 opens vLLM's session first). The
        `source` may be set later, before `send_weights` (TRL's server mode sets it per sync).

        Raises:
            ValueError: a world of several ranks without a process group.
        """
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.rounds = 0
        engine.version_prefix = init_info.version_prefix
        engine.last_push = None
        targets = None
        if engine.is_sender:
            client.init_weight_transfer_engine(msgspec.to_builtins(VllmInitInfo()))
            tp_size = init_info.engine_tp_size or _server_tp_size(client, init_info.timeout_s)
            targets = [VllmClientTarget(client, tp_size=tp_size)]
        engine.publisher = Publisher(
            targets,
            group=_group(init_info),
            transport=init_info.transport,
            bucket_bytes=init_info.bucket_bytes,
            timeout_s=init_info.timeout_s,
            control_host=init_info.control_host,
        )
        return engine

    def send_weights(self, version: str | None = None) -> None:
        """Every rank: push what it holds of the source as `version` (default:
        `<prefix><round>`).

        Raises:
            ValueError: no source was given, or a name of the source's metadata no rank holds
                (named).
            PushError, TrainerRankError: as `Publisher.push`.
        """
        if self.source is None:
            raise ValueError(
                "backend weightbus sends a WeightSource: pass source= to trainer_init or set "
                "the engine's source before send_weights"
            )
        self.rounds += 1
        self.last_push = self.publisher.push(
            held_weights(self.source), version=version or f"{self.version_prefix}{self.rounds}"
        )

    def shutdown(self) -> None:
        self.publisher.close()


def _group(init_info: WeightbusTrainerInitInfo) -> Any:
    if init_info.world_size <= 1:
        return None
    group = init_info.group if init_info.group is not None else dist.group.WORLD
    if dist.get_world_size(group) != init_info.world_size or dist.get_rank(group) != init_info.rank:
        raise ValueError(
            f"WeightbusTrainerInitInfo: rank {init_info.rank} of {init_info.world_size}, but the "
            f"process group says rank {dist.get_rank(group)} of {dist.get_world_size(group)}"
        )
    return group


def held_weights(source: WeightSource) -> Any:
    """What this rank holds of `source`: a `ModuleSource`'s module state (FSDP2: the rank's
    shards, no gather), else the tensors it yields for its `held_names()` (vLLM's ownership
    contract: the rest come as None)."""
    module = getattr(source, "_module", None)
    if isinstance(source, ModuleSource) and isinstance(module, torch.nn.Module):
        return dict(module.named_parameters())
    return dict(_held_pairs(source))


def _held_pairs(source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    held = source.held_names()
    for names, tensors in source.iter_groups():
        for name, tensor in zip(names, tensors, strict=True):
            if tensor is not None and (held is None or name in held):
                yield name, tensor
