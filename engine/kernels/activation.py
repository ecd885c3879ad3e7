"""SiLU-and-mul (SwiGLU's gate): out = silu(gate) * up from the fused gate|up projection, one launch.

Rounded like the torch reference (`F.silu(g) * u`): silu in float32, rounded to the activation dtype,
then the product, rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mleagle.engine.kernels import interpreter_compat

interpreter_compat()


@triton.jit
def _silu_and_mul_kernel(x, s_x, out, s_o, N: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    g = tl.load(x + t * s_x + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x + t * s_x + N + i, mask=m, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + t * s_o + i, (a * u).to(out.dtype.element_ty), mask=m)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2N] (gate | up) → [T, N]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = x.reshape(-1, x.shape[-1])
    t, n = x2.shape[0], x2.shape[1] // 2
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t:
        block = 1024 if n >= 1024 else max(16, 1 << (n - 1).bit_length())
        _silu_and_mul_kernel[(t, triton.cdiv(n, block))](x2, x2.stride(0), out, out.stride(0), N=n, BLOCK=block,
                                                       num_warps=4 if block >= 512 else 1)
    return out.view(*x.shape[:-1], n)
