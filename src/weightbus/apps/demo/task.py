"""The toy task of the demo: make the policy write digits.

The tiny model's byte-level vocabulary has 512 ids (0-255 are bytes, 256 BOS, 257 EOS); ten of
them are the ASCII digits, so a freshly initialised policy writes a digit ~2% of the time and
the reward has room to rise visibly within a few dozen steps.
"""

from dataclasses import dataclass

import torch

BOS_TOKEN_ID = 256
DIGIT_TOKEN_IDS = frozenset(range(ord("0"), ord("9") + 1))
# Equal lengths let the trainer score every sequence in one padded-free batch.
PROMPT_TEXTS = ("a=", "b=", "c=", "d=", "e=", "f=", "g=", "h=")


@dataclass(frozen=True, slots=True)
class Rollout:
    """One sampled completion with the engine's logprobs of its tokens."""

    prompt_ids: list[int]
    token_ids: list[int]
    engine_logprobs: list[float]
    weight_version: str


def prompts(num_prompts: int) -> list[list[int]]:
    """`num_prompts` token-id prompts of equal length (BOS + bytes)."""
    if not 1 <= num_prompts <= len(PROMPT_TEXTS):
        raise ValueError(f"--prompts must be in 1..{len(PROMPT_TEXTS)}, got {num_prompts}")
    return [[BOS_TOKEN_ID, *text.encode()] for text in PROMPT_TEXTS[:num_prompts]]


def reward(token_ids: list[int]) -> float:
    """Fraction of the completion's tokens that are ASCII digits."""
    return sum(t in DIGIT_TOKEN_IDS for t in token_ids) / max(len(token_ids), 1)


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO-style advantages: each reward minus its group's mean, over the group's std.

    Args:
        rewards: `[num_groups * group_size]`, the samples of one prompt adjacent.
    """
    groups = rewards.view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    # a group where every sample scored the same carries no signal: its advantages stay 0
    return (centered / (groups.std(dim=1, keepdim=True) + 1e-4)).view(-1)


def render(token_ids: list[int]) -> str:
    """Printable view of a completion: ASCII as is, anything else as a middle dot."""
    return "".join(chr(t) if 32 <= t < 127 else "\u00b7" for t in token_ids)
