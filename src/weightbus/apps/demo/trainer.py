"""The demo's trainer: a Hugging Face `transformers` Llama with the engine's `tiny` architecture.

The trainer holds its weights under Hugging Face names, as a real RL trainer does; the engine
maps them onto its fused, sharded parameters when they are pushed.
"""

from pathlib import Path

import torch

from weightbus.apps.demo.task import Rollout, group_advantages, reward
from weightbus.core.fp8 import Fp8Block, dequantized_model
from weightbus.engines.reference.models.config import ModelConfig


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


class Trainer:
    """A policy-gradient learner over a `transformers.LlamaForCausalLM`.

    Args:
        config: the architecture (the engine's `tiny` config).
        seed: seed of the initial weights (transformers' own initialisation).
        lr: Adam learning rate.
    """

    def __init__(self, config: ModelConfig, *, seed: int, lr: float) -> None:
        from transformers import LlamaForCausalLM

        torch.manual_seed(seed)
        self.model = self._policy(LlamaForCausalLM(hf_llama_config(config)).float()).train()
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
