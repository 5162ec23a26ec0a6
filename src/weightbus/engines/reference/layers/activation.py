"""SwiGLU's activation on a fused gate/up projection."""

import torch
from torch import nn
from torch.nn.functional import silu


class SiluAndMul(nn.Module):
    """`silu(gate) * up` where the input is `[gate, up]` along the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return silu(gate) * up
