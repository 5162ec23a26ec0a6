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
# A quantized probe's default tolerance is at least this many times the logprob change the
# serving dtype's rounding makes (measured on the trainer): the engine rounds in its own
# summation order, and the trainer's probe carries its own rounding too (up to twice it), so
# four leaves a margin. A bf16 engine differed by 0.10 where a tenth of the quantization's
# change was 0.05: that default failed good pushes.
ROUNDING_MARGIN = 4


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
        serving_dtype: torch.dtype | None = None,
    ) -> "LogprobProbe":
        """The probe of `model` as a block-FP8 engine serves it after a push with `quantize`:
        the trainer's model with the same quantize-dequantize applied.

        Args:
            tolerance: None: the larger of a tenth of the largest logprob change the
                quantization itself makes on these tokens (a scale in a wrong block moves
                logprobs by about as much or more) and `ROUNDING_MARGIN` times what computing
                in `serving_dtype` instead of float32 changes them (an engine's own rounding:
                ~1e-6 in float32, about a tenth of a nat in bf16 on a trained model, where a
                mis-load moves logprobs by nats). At least 1e-5.
            serving_dtype: the dtype the engine computes in; None: the model's own.
        """
        served = dequantized_model(model, quantize)  # in eval mode, the caller's model as it is
        probe = cls.of_model(served, token_ids, tolerance=1.0)
        if tolerance is None:
            exact = cls.of_model(copy.deepcopy(model).eval(), token_ids, tolerance=1.0)
            tolerance = max(probe.gap(exact.logprobs) / 10, _MIN_TOLERANCE)
            dtype = serving_dtype or _floating_dtype(model)
            if dtype != torch.float32:
                in_float32 = cls.of_model(served.float(), token_ids, tolerance=1.0)
                rounded = cls.of_model(served.to(dtype), token_ids, tolerance=1.0)
                rounding = rounded.gap(in_float32.logprobs)
                tolerance = max(tolerance, ROUNDING_MARGIN * rounding)
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


def _floating_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of `model`'s first floating parameter (float32 when it has none)."""
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32
