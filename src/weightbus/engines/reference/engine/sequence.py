"""A request inside the engine: its tokens, sampling parameters and progress."""

import enum
from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to pick the next tokens of one sequence.

    Attributes:
        max_tokens: completion tokens to generate at most.
        temperature: 0 means greedy.
        top_p: nucleus mass kept when sampling.
        seed: seed of this sequence's own generator (None: a random one).
        num_logprobs: top alternatives to report per token (None: no logprobs).
        ignore_eos: keep generating after an end-of-sequence token.
        prompt_logprobs: report each prompt token's logprob (teacher-forced scoring: what a
            logprob probe reads).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    num_logprobs: int | None = None
    ignore_eos: bool = False
    prompt_logprobs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt plus generated tokens of one request, and how many of them the KV cache holds."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.slot = -1
        self.num_cached_tokens = 0
        # the weights epoch its KV was computed under (prefix caching: `engine/prefix_cache.py`)
        self.kv_epoch = 0
        # tokens of this sequence the draft model's KV cache holds (speculative decoding)
        self.num_draft_cached_tokens = 0
        # its KV was computed again on new weights; reported with its next token
        self.kv_recomputed = False
        # filled at prefill when `params.prompt_logprobs`, sent with the first token
        self.prompt_logprobs: list[float | None] | None = None
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator()
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def new_token_ids(self) -> list[int]:
        """Tokens not yet in the KV cache: the prompt at prefill, the last token at decode."""
        return self.token_ids[self.num_cached_tokens :]
