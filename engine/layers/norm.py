"""RMSNorm computed in float32 (as HF Llama does) and cast back to the activation dtype, optionally
fused with the residual add that precedes it (vLLM style).

`norm(x)` → normed; `norm(x, residual)` → (norm(x + residual), x + residual): the decoder carries
the residual stream beside the hidden state, so the add and the norm are one pass (one Triton launch
on CUDA, `engine/kernels/norm.py`). The torch reference below is what the CPU runs and what the
kernel is tested against; both round the sum to the activation dtype before normalising it, as the
unfused `h = h + attn(...)` followed by `norm(h)` did.
"""

from __future__ import annotations

import torch
from torch import nn

from mleagle.engine.kernels import fused_layers_on


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dt)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dim() == 2 and fused_layers_on(x) and not self.weight.requires_grad:
            from mleagle.engine.kernels.norm import add_rmsnorm

            y, r = add_rmsnorm(x, residual, self.weight, self.eps)
            return y if r is None else (y, r)
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)
        s = x + residual
        return rms_norm_ref(s, self.weight, self.eps), s
