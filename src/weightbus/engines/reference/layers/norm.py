"""RMSNorm exactly as Hugging Face computes it (float32 statistics, weight applied last)."""

import torch
from torch import nn

from weightbus.engines.reference.layers.replicated import Replicated


class RMSNorm(Replicated, nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, replicated on every rank."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers' LlamaRMSNorm, so float32 results agree bit for bit.
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)
