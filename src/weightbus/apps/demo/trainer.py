"""The demo's trainer: a Hugging Face `transformers` causal LM, by default a Llama with the
engine's `tiny` architecture (`DEMO_MODELS`: `weightbus demo --model`).

The trainer holds its weights under Hugging Face names, as a real RL trainer does (a Qwen3-MoE's
experts as transformers 5's fused 3-D tensors); the engine maps them onto its fused, sharded
parameters when they are pushed.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from weightbus.apps.demo.task import Rollout, group_advantages, reward
from weightbus.core.fp8 import Fp8Block, dequantized_model
from weightbus.engines.reference.models.config import ModelConfig, tiny_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def hf_llama_config(config: ModelConfig):
    """A `transformers.LlamaConfig` with the architecture of `config`."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=list(config.eos_token_ids) or None,
        pad_token_id=None,
    )


def tiny_hf_config() -> "PretrainedConfig":
    """The engine's `tiny` Llama as a `transformers.LlamaConfig` (the demo's default model)."""
    return hf_llama_config(tiny_config())


def qwen3_moe_hf_config() -> "PretrainedConfig":
    """A tiny `transformers.Qwen3MoeConfig` with the `tiny` vocabulary (the demo's task): every
    layer an MoE block of 8 experts, 2 per token, their weights renormalised."""
    from transformers import Qwen3MoeConfig

    tiny = tiny_config()
    return Qwen3MoeConfig(
        vocab_size=tiny.vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        max_position_embeddings=tiny.max_position_embeddings,
        rope_theta=tiny.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=tiny.bos_token_id,
        eos_token_id=list(tiny.eos_token_ids),
        pad_token_id=None,
    )


@dataclass(frozen=True, slots=True)
class DemoModel:
    """A model `weightbus demo --model` trains.

    Attributes:
        hf_config: builds the transformers config of the trainer's model.
        lr: the default Adam learning rate of a whole-model run (`--lr`).
        lora_targets: the projections a `--lora` adapter adapts; None: every linear layer
            (peft's `all-linear`).
    """

    hf_config: Callable[[], "PretrainedConfig"]
    lr: float
    lora_targets: tuple[str, ...] | None = None


DEMO_MODELS = {
    "tiny": DemoModel(tiny_hf_config, lr=3e-3),
    # at 3e-3 its reward reaches ~0.6 by step 30, at 1e-2 ~1.0 (as tiny's at 3e-3). Its
    # experts take no adapter (the engine refuses one), so --lora adapts the attention: every
    # check passes, but the reward barely moves (~0.01 -> 0.03), the frozen 64-wide head
    # leaving attention little room to raise the digits' logits
    "qwen3-moe": DemoModel(
        qwen3_moe_hf_config, lr=1e-2, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")
    ),
}


class Trainer:
    """A policy-gradient learner over the `transformers` causal LM of `hf_config`
    (`AutoModelForCausalLM`: a `LlamaConfig` builds a `LlamaForCausalLM`, a `Qwen3MoeConfig` a
    `Qwen3MoeForCausalLM`).

    Args:
        hf_config: the architecture (`DEMO_MODELS`; `hf_llama_config` of an engine config).
        seed: seed of the initial weights (transformers' own initialisation).
        lr: Adam learning rate.
    """

    def __init__(self, hf_config: "PretrainedConfig", *, seed: int, lr: float) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config).float()
        self.model = self._policy(model).train()
        trained = [param for param in self.model.parameters() if param.requires_grad]
        self.optimizer = torch.optim.Adam(trained, lr=lr)

    def _policy(self, model: torch.nn.Module) -> torch.nn.Module:
        """The trained policy built on the freshly initialised `model`: the model itself."""
        return model

    def weights(self) -> dict[str, torch.Tensor]:
        """The model the engine serves, under Hugging Face names (what a whole push carries)."""
        return dict(self.model.state_dict())

    def save(self, directory: Path) -> None:
        """Write the weights as a Hugging Face checkpoint directory (config + safetensors)."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the demo prints its own progress
        self.model.save_pretrained(directory)

    def token_logprobs(self, rollouts: list[Rollout]) -> torch.Tensor:
        """`[num_rollouts, num_tokens]` logprobs of the sampled tokens under the trainer."""
        return token_logprobs(self.model, rollouts)

    def served_policy(self, quantize: Fp8Block) -> torch.nn.Module:
        """The policy as a block-FP8 engine serves it after a push: a copy whose quantized
        matrices hold what their fp8 values and scales stand for."""
        return dequantized_model(self.model, quantize)

    def step(
        self, rollouts: list[Rollout], group_size: int, served: torch.nn.Module | None = None
    ) -> tuple[float, float]:
        """One REINFORCE update with a group baseline.

        Args:
            served: the policy the engine serves when it is not the trainer's own weights
                (`served_policy`: FP8); the on-policy check compares the engine with it.

        Returns:
            (mean reward, largest |engine logprob - served logprob| over the sampled tokens):
            the second is the on-policy check, computed before the update.
        """
        logprobs = self.token_logprobs(rollouts)
        engine = torch.tensor([r.engine_logprobs for r in rollouts])
        if served is None:
            reference = logprobs.detach()
        else:
            with torch.no_grad():
                reference = token_logprobs(served, rollouts)
        logprob_gap = float((reference - engine).abs().max())
        rewards = torch.tensor([reward(r.token_ids) for r in rollouts])
        advantages = group_advantages(rewards, group_size)
        loss = -(advantages.unsqueeze(-1) * logprobs).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(rewards.mean()), logprob_gap


def token_logprobs(model: torch.nn.Module, rollouts: list[Rollout]) -> torch.Tensor:
    """`[num_rollouts, num_tokens]` logprobs of the sampled tokens under `model`."""
    prompt_len = len(rollouts[0].prompt_ids)
    ids = torch.tensor([r.prompt_ids + r.token_ids for r in rollouts])
    logits = model(ids).logits[:, prompt_len - 1 : -1].float()
    targets = ids[:, prompt_len:]
    return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
