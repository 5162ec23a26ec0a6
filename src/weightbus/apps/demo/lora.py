"""`weightbus demo --lora`: the policy is a `peft` LoRA adapter on the frozen tiny Llama, and
every step pushes the adapter alone onto the base the engine serves.

The engine starts from the base (`weightbus serve --lora-rank R`, every projection adapted) and
applies each pushed adapter unmerged. The trainer checks what it serves against its own
computation: the fingerprint of base and adapter together (`served_fingerprint`) and the
on-policy logprobs of the peft model.
"""

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from weightbus.apps.demo.trainer import Trainer
from weightbus.core.lora import adapter_spec, adapter_tensors, base_weights
from weightbus.core.publisher import Publisher, PushResult
from weightbus.core.wire.adapter import served_fingerprint

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DEFAULT_RANK = 8
# lora_alpha = 2 r: the update `B @ A` is scaled by 2 whatever the rank
ALPHA_PER_RANK = 2
# Adam on the adapter alone needs a larger step than on the whole model (3e-3)
DEFAULT_LORA_LR = 2e-2


class LoraTrainer(Trainer):
    """The demo's trainer with a LoRA adapter of rank `rank` on the projections `targets`
    (None: every projection, peft's `all-linear`): Adam trains `lora_A` and `lora_B`, the base
    stays as initialised. peft starts B at zero, so the initial policy is the base.
    """

    def __init__(
        self,
        hf_config: "PretrainedConfig",
        *,
        seed: int,
        lr: float,
        rank: int,
        targets: tuple[str, ...] | None = None,
    ) -> None:
        self.rank = rank
        self.targets = targets
        super().__init__(hf_config, seed=seed, lr=lr)

    def _policy(self, model: torch.nn.Module) -> torch.nn.Module:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=self.rank,
            lora_alpha=ALPHA_PER_RANK * self.rank,
            target_modules="all-linear" if self.targets is None else list(self.targets),
            lora_dropout=0.0,
        )
        return get_peft_model(model, config)

    @property
    def lora_config(self):
        """The adapter's peft `LoraConfig` (what `Publisher.push(adapter=...)` takes)."""
        return self.model.peft_config["default"]

    def weights(self) -> dict[str, torch.Tensor]:
        """The frozen base under Hugging Face names (what the engine starts from)."""
        return base_weights(self.model)

    def adapter(self) -> dict[str, torch.Tensor]:
        """The adapter's `lora_A` / `lora_B` matrices under peft's saved names."""
        return adapter_tensors(self.model)

    def save(self, directory: Path) -> None:
        """Write the base (no adapter) as a Hugging Face checkpoint directory."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the demo prints its own progress
        self.model.get_base_model().save_pretrained(directory, state_dict=self.weights())


def push_adapter(
    publisher: Publisher, trainer: LoraTrainer, *, version: str, base_fingerprint: str
) -> tuple[PushResult, str]:
    """Push the trainer's adapter alone onto the base `base_fingerprint`, as `version`.

    Returns:
        The push's result, and the fingerprint the engine must then serve, computed by the
        trainer: its base's, its adapter tensors' and the adapter's scale, hashed together.

    Raises:
        PushError: the engine refused (another base, another rank or targets) or failed.
    """
    result = publisher.push(
        trainer.model, version=version, adapter=trainer.lora_config,
        base_fingerprint=base_fingerprint,
    )  # fmt: skip
    spec = adapter_spec(trainer.lora_config, base_fingerprint)
    expected = served_fingerprint(spec, publisher.fingerprint(trainer.adapter()))
    return result, expected
