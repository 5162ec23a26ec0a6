"""Pushing TRL's policy: the model TRL trains, from one process, or from every process of a
multi-process run with a `Publisher` on its process group (each sends the bytes it holds: DDP
replicas split the model, FSDP2 ranks send their shards; nothing is gathered). A PEFT (LoRA)
policy pushes its adapter only, onto the frozen base the engines serve
(`Publisher.push(..., adapter=...)`)."""

import time
from dataclasses import dataclass
from typing import Any

import torch

from weightbus.core.lora import base_weights
from weightbus.core.publisher import Publisher

# What weightbus cannot read from a trainer's parameters, and what to use instead.
_ZERO3 = (
    "DeepSpeed ZeRO-3 keeps each parameter as a flat partition of the whole model that "
    "weightbus cannot map to a Hugging Face tensor without gathering it; train with FSDP2 "
    "(accelerate fsdp_version: 2) and a Publisher(group=...) on every process, or with ZeRO-1/2"
)
_FSDP1 = (
    "FSDP1 flattens parameters into FlatParameters weightbus cannot map to Hugging Face "
    "tensors; use FSDP2 (accelerate fsdp_version: 2) with a Publisher(group=...) on every process"
)


@dataclass(frozen=True, slots=True)
class PushRecord:
    """One push of the policy: its version, the fingerprint the engines committed, how long the
    push took (the trainer waited that long) and the bytes each trainer process sent."""

    step: int
    version: str
    fingerprint: str
    push_s: float
    sent_bytes: list[int]


def _refuse_unmappable(trainer: Any, model: torch.nn.Module) -> None:
    """Refuse trainers whose parameters are not Hugging Face tensors or DTensor shards."""
    accelerator = trainer.accelerator
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and getattr(plugin, "zero_stage", 0) == 3:
        raise NotImplementedError(_ZERO3)
    # unwrap_model strips a top-level FSDP1 wrapper: ask accelerate, and look inside too
    fsdp1 = accelerator.distributed_type.name == "FSDP" and not accelerator.is_fsdp2
    wrapped = getattr(trainer, "model_wrapped", model)
    if fsdp1 or any(type(m).__name__ == "FullyShardedDataParallel" for m in wrapped.modules()):
        raise NotImplementedError(_FSDP1)


class PolicyPusher:
    """Pushes `trainer.model` as `<version_prefix><step>`.

    Args:
        publisher: this process's `Publisher` (one TRL process: a group of one; several:
            every process builds one on its process group, collectively).
        version_prefix: versions are this prefix and TRL's global step.
        push_options: more `push` options (`pause_mode`, `two_phase`, `delta`, ...).
    """

    def __init__(
        self,
        publisher: Publisher,
        *,
        version_prefix: str,
        push_options: dict[str, Any] | None = None,
    ) -> None:
        self.publisher = publisher
        self.version_prefix = version_prefix
        self.push_options = dict(push_options or {})
        self._base_fingerprint: str | None = None  # a PEFT policy's frozen base, once read

    def version_of(self, step: int) -> str:
        """The version of the policy at TRL step `step`."""
        return f"{self.version_prefix}{step}"

    def push(self, trainer: Any, step: int) -> PushRecord:
        """Push the policy TRL holds at `step` (every process calls it when sharded).

        A PEFT policy pushes its active adapter only (the engines serve adapters: `weightbus
        serve --lora-rank`); the base's fingerprint is read once, on the first push (LoRA
        training keeps the base frozen), and each engine checks it serves that base.

        Raises:
            NotImplementedError: a trainer weightbus cannot push from (ZeRO-3, FSDP1).
            ValueError: several TRL processes with a Publisher of one process (build one on
                every process with `group=`).
            PushError, NonFiniteWeightsError, TrainerRankError: as the publisher's `push`.
        """
        model = trainer.accelerator.unwrap_model(trainer.model)
        _refuse_unmappable(trainer, model)
        num_processes = trainer.accelerator.num_processes
        if self.publisher.world_size != num_processes:
            raise ValueError(
                f"TRL runs {num_processes} processes, the Publisher's trainer group "
                f"{self.publisher.world_size}: build one on every process with group=... (each "
                "sends the bytes it holds)"
            )
        version = self.version_of(step)
        start = time.perf_counter()
        options = self.push_options | self._adapter_options(model)
        result = self.publisher.push(model, version=version, **options)
        push_s = time.perf_counter() - start
        return PushRecord(step, version, result.fingerprint, push_s, result.rank_sent_bytes)

    def _adapter_options(self, model: torch.nn.Module) -> dict[str, Any]:
        """The push's adapter options for a PEFT model (none for a plain one)."""
        configs = getattr(model, "peft_config", None)
        if configs is None:
            return {}
        if self._base_fingerprint is None:  # collectively: each process digests its shards
            self._base_fingerprint = self.publisher.fingerprint(base_weights(model))
        return {
            "adapter": configs[model.active_adapter],
            "base_fingerprint": self._base_fingerprint,
        }
