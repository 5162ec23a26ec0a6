"""The trainer side of backend `weightbus` in vLLM's own trainer API
(`WeightTransferTrainerFactory.trainer_init(WeightbusTrainerInitInfo(rank=...), client=...,
source=...)`, then `send_weights()` per round): a weightbus `Publisher` whose one engine is
the vLLM client."""

from dataclasses import dataclass
from typing import ClassVar

import msgspec
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

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
        transport: the weightbus transport (`shm` on one host; `disk` anywhere a shared
            directory is).
        engine_tp_size: the engine's number of workers (None: asked of the server, through the
            client's `base_url`, as `HTTPVLLMWeightSyncClient` has).
    """

    backend: ClassVar[str] = BACKEND
    transport: str = "shm"
    engine_tp_size: int | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 120.0
    version_prefix: str = "v"


class WeightbusTrainerEngine(TrainerWeightTransferEngine[WeightbusTrainerInitInfo]):
    """Pushes the trainer's `WeightSource` with weightbus each round (sender rank only)."""

    init_info_cls = WeightbusTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.rounds = 0
        engine.version_prefix = init_info.version_prefix
        engine.publisher = None
        if engine.is_sender:
            client.init_weight_transfer_engine(msgspec.to_builtins(VllmInitInfo()))
            tp_size = init_info.engine_tp_size or _server_tp_size(client, init_info.timeout_s)
            target = VllmClientTarget(client, tp_size=tp_size)
            engine.publisher = Publisher(
                [target],
                transport=init_info.transport,
                bucket_bytes=init_info.bucket_bytes,
                timeout_s=init_info.timeout_s,
            )
        return engine

    def send_weights(self, version: str | None = None) -> None:
        """Push the source's tensors as `version` (default: `<prefix><round>`)."""
        self.rounds += 1
        if self.publisher is None or self.source is None:
            return
        self.publisher.push(
            list(self.source), version=version or f"{self.version_prefix}{self.rounds}"
        )

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
