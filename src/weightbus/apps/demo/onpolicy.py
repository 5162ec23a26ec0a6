"""On-policy rollouts sampled from the demo trainer's own model (no engine): `weightbus bench
delta` and the cluster bench's RL trainer step on them, so every step changes the weights as a
real RL step does. The logprobs are the trainer's own: the on-policy check passes."""

import torch

from weightbus.apps.demo.task import Rollout, prompts
from weightbus.apps.demo.trainer import Trainer
from weightbus.engines.reference.models.config import tiny_config

# the demo's batch (`weightbus demo` defaults)
NUM_PROMPTS, GROUP_SIZE, MAX_TOKENS = 4, 8, 16


def rollouts_of(trainer: Trainer, seed: int) -> list[Rollout]:
    """The demo's batch sampled from the trainer's own model; its logprobs as the engine's."""
    prompt_ids = [p for p in prompts(NUM_PROMPTS) for _ in range(GROUP_SIZE)]
    ids = torch.tensor(prompt_ids)
    torch.manual_seed(seed)
    with torch.no_grad():
        generated = trainer.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,  # the engine's ignore_eos: every completion is full length
            pad_token_id=tiny_config().eos_token_ids[0],
        )
    tokens = generated[:, ids.shape[1] :].tolist()
    drafts = [Rollout(p, t, [], "trainer") for p, t in zip(prompt_ids, tokens, strict=True)]
    with torch.no_grad():
        logprobs = trainer.token_logprobs(drafts).tolist()
    return [
        Rollout(p, t, lp, "trainer") for p, t, lp in zip(prompt_ids, tokens, logprobs, strict=True)
    ]
