"""SiLU-and-mul, the SwiGLU gate over the fused gate|up projection: one Triton launch on CUDA
(`engine/kernels/activation.py`), the torch reference elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mleagle.engine.kernels import fused_layers_on


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    g, u = x.chunk(2, dim=-1)
    return F.silu(g) * u


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_layers_on(x) and not x.requires_grad:
            from mleagle.engine.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        return silu_and_mul_ref(x)
