"""The demo's draft model: a one-layer Llama kept in step with the policy by distillation.

Speculative decoding is lossless only in what it outputs: how much it speeds generation up
depends on how often the main model accepts the draft's tokens. A draft left behind while the
policy trains is accepted less and less; this one is distilled on the policy's own rollouts
after every RL step and pushed with the policy as one version (names under `draft.`).

`acceptance_rate` is the standard measure of how well a draft `q` fits a policy `p`: a draft
token is accepted with probability `alpha = sum_x min(p(x), q(x))` under speculative sampling,
averaged here over the positions of real rollouts. An engine proposing `k` tokens per step
counts every proposal, and those after a rejection are never accepted: its rate is
`engine_rate(alpha, k)`, the form the demo prints next to the engine's measured one.
"""

import copy
import dataclasses
from pathlib import Path

import torch

from weightbus.apps.demo.task import Rollout
from weightbus.apps.demo.trainer import hf_llama_config
from weightbus.core.meta import DRAFT_PREFIX
from weightbus.engines.reference.models.config import ModelConfig

DRAFT_LAYERS = 1
WARMUP_ITERATIONS = 60  # distillation steps on the initial policy's samples, before step 1
STEP_ITERATIONS = 4  # distillation steps on each RL step's rollouts


def draft_config(config: ModelConfig) -> ModelConfig:
    """The draft's architecture: the policy's, with one layer (same vocabulary and width)."""
    return dataclasses.replace(config, num_hidden_layers=DRAFT_LAYERS)


def token_ids(rollouts: list[Rollout]) -> torch.Tensor:
    """`[num_rollouts, prompt + completion]` token ids (every rollout has the same lengths)."""
    return torch.tensor([r.prompt_ids + r.token_ids for r in rollouts])


def _completion_logits(model: torch.nn.Module, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits that predicted each completion token, `[n, completion, vocab]`."""
    return model(ids).logits[:, prompt_len - 1 : -1].float()


class DraftTrainer:
    """A one-layer `transformers` Llama distilled from the policy (forward KL, the policy's
    distributions as soft targets).

    Args:
        config: the policy's architecture.
        seed: seed of the draft's initial weights.
        lr: Adam learning rate of the distillation.
    """

    def __init__(self, config: ModelConfig, *, seed: int, lr: float = 3e-3) -> None:
        from transformers import LlamaForCausalLM

        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(hf_llama_config(draft_config(config))).float().train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)

    def distill(
        self, policy: torch.nn.Module, ids: torch.Tensor, prompt_len: int, iterations: int
    ) -> float:
        """Fit the draft to `policy`'s next-token distributions on `ids`; returns the last KL."""
        with torch.no_grad():
            target = _completion_logits(policy, ids, prompt_len).log_softmax(-1)
        kl = torch.zeros(())
        for _ in range(iterations):
            draft = _completion_logits(self.model, ids, prompt_len).log_softmax(-1)
            kl = (target.exp() * (target - draft)).sum(-1).mean()
            self.optimizer.zero_grad(set_to_none=True)
            kl.backward()
            self.optimizer.step()
        return float(kl.detach())

    def weights(self) -> dict[str, torch.Tensor]:
        """The draft's tensors under the names a push carries them (`draft.` + HF name)."""
        return {DRAFT_PREFIX + name: t for name, t in self.model.state_dict().items()}

    def frozen(self) -> torch.nn.Module:
        """A copy of the draft as it is now, never trained again (the comparison)."""
        return copy.deepcopy(self.model).eval()

    def save(self, directory: Path) -> None:
        """Write the draft as a Hugging Face checkpoint directory (the engine's --draft-model)."""
        self.model.save_pretrained(directory)


@torch.no_grad()
def acceptance_rate(
    policy: torch.nn.Module,
    draft: torch.nn.Module,
    ids: torch.Tensor,
    prompt_len: int,
    temperature: float,
) -> float:
    """Expected share of `draft`'s tokens `policy` accepts under speculative sampling at
    `temperature`, over the completion positions of `ids`: the mean of sum_x min(p(x), q(x))."""
    p = (_completion_logits(policy, ids, prompt_len) / temperature).softmax(-1)
    q = (_completion_logits(draft, ids, prompt_len) / temperature).softmax(-1)
    return float(torch.minimum(p, q).sum(-1).mean())


def engine_rate(alpha: float, k: int) -> float:
    """Accepted share of `k` proposals per step when each is accepted with probability `alpha`
    once its predecessors were: `(alpha + ... + alpha^k) / k`."""
    return sum(alpha**i for i in range(1, k + 1)) / k


@torch.no_grad()
def policy_samples(
    policy: torch.nn.Module, prompts: list[list[int]], samples: int, max_tokens: int, seed: int
) -> torch.Tensor:
    """`samples` sampled completions of every prompt from the trainer's policy: the initial
    draft's distillation data (the engine is not started yet)."""
    torch.manual_seed(seed)
    ids = torch.tensor(prompts).repeat_interleave(samples, dim=0)
    policy.eval()
    try:
        for _ in range(max_tokens):
            logits = policy(ids).logits[:, -1].float()
            ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1)], dim=1)
    finally:
        policy.train()
    return ids


@dataclasses.dataclass(slots=True)
class DraftStep:
    """How well the drafts fit the policy after one RL step: the accepted share of their
    proposals an engine should measure (`engine_rate`)."""

    kl: float  # the distillation's last KL(policy || draft)
    in_step: float  # the draft distilled every step
    frozen: float  # the draft as it was at step 0


class DraftRun:
    """The demo's draft across a run: warmed up on the initial policy, then distilled after
    every RL step, and compared with a copy frozen at step 0.

    Args:
        config: the policy's architecture.
        seed: seed of the draft's initial weights and of the warm-up samples.
        temperature: the rollouts' sampling temperature (acceptance depends on it).
        num_speculative_tokens: the engine's proposals per step.
    """

    def __init__(
        self, config: ModelConfig, *, seed: int, temperature: float, num_speculative_tokens: int
    ) -> None:
        self.trainer = DraftTrainer(config, seed=seed)
        self.temperature = temperature
        self.num_speculative_tokens = num_speculative_tokens
        self.frozen_model: torch.nn.Module | None = None

    def warm_up(self, policy: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> float:
        """Distill the draft on the initial policy's own samples, then freeze a copy of it."""
        ids = policy_samples(policy, prompts, samples=8, max_tokens=max_tokens, seed=0)
        kl = self.trainer.distill(policy, ids, len(prompts[0]), WARMUP_ITERATIONS)
        self.frozen_model = self.trainer.frozen()
        return kl

    def after_update(self, policy: torch.nn.Module, rollouts: list[Rollout]) -> DraftStep:
        """Distill on the step's rollouts toward the updated policy; measure both drafts."""
        assert self.frozen_model is not None, "warm_up first"
        ids, prompt_len = token_ids(rollouts), len(rollouts[0].prompt_ids)
        kl = self.trainer.distill(policy, ids, prompt_len, STEP_ITERATIONS)
        rate = [
            engine_rate(
                acceptance_rate(policy, draft, ids, prompt_len, self.temperature),
                self.num_speculative_tokens,
            )
            for draft in (self.trainer.model, self.frozen_model)
        ]
        return DraftStep(kl=kl, in_step=rate[0], frozen=rate[1])
