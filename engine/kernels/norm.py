"""Fused residual add + RMSNorm (vLLM style) in one Triton launch per call.

`add_rmsnorm(x, residual, w, eps)` returns (norm(x + residual) * w, x + residual); with no residual it
is a plain RMSNorm. The numerics follow the torch reference (engine/layers/norm.py) step by step: the
sum is rounded to the activation dtype before it is normalised (that rounded sum is also the new
residual stream), the normalised value is rounded before the weight multiplies it, and the mean of
squares is taken in float32. One program per token row: a whole row (576 or 4096 values) fits in
registers, so the row is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mleagle.engine.kernels import interpreter_compat, next_pow2

interpreter_compat()


@triton.jit
def _norm_store(v, w, out, i, m, eps, N: tl.constexpr):
    """Normalise the float32 row v and store weight * it at `out + i`, rounded as the reference rounds:
    the normalised value to the output dtype before the weight multiplies it."""
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, 0) / N + eps)
    y = (v * rstd).to(out.dtype.element_ty).to(tl.float32)
    wt = tl.load(w + i, mask=m, other=0.0).to(tl.float32)
    tl.store(out + i, (wt * y).to(out.dtype.element_ty), mask=m)


@triton.jit
def _add_rmsnorm_kernel(x, s_x, res, s_r, w, out, s_o, res_out, s_ro, eps, N: tl.constexpr,
                        BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    t = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    m = i < N
    v = tl.load(x + t * s_x + i, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(res + t * s_r + i, mask=m, other=0.0)
        v = (v.to(tl.float32) + r.to(tl.float32)).to(res_out.dtype.element_ty)
        tl.store(res_out + t * s_ro + i, v, mask=m)
    _norm_store(v.to(tl.float32), w, out + t * s_o, i, m, eps, N)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x, residual: [T, N] → (normed [T, N], x + residual [T, N] or None without a residual)."""
    if x.dim() != 2 or x.stride(1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    t, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if t == 0:
        return out, res_out
    r = residual if residual is not None else x
    if r.stride(-1) != 1:
        r = r.contiguous()
    ro = res_out if res_out is not None else out
    block = next_pow2(n)
    _add_rmsnorm_kernel[(t,)](x, x.stride(0), r, r.stride(0), weight, out, out.stride(0), ro, ro.stride(0), eps,
                              N=n, BLOCK=block, HAS_RES=residual is not None,
                              num_warps=max(1, min(8, block // 256)))
    return out, res_out


@triton.jit
def _group_rmsnorm_kernel(e, s_e, h, s_h, w, out, s_o, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    g = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    m = i < N
    if g == 0:
        v = tl.load(e + t * s_e + i, mask=m, other=0.0).to(tl.float32)
    else:
        v = tl.load(h + t * s_h + (g - 1) * N + i, mask=m, other=0.0).to(tl.float32)
    _norm_store(v, w + g * N, out + t * s_o + g * N, i, m, eps, N)


def group_rmsnorm(e: torch.Tensor, h: torch.Tensor, weights: torch.Tensor, eps: float) -> torch.Tensor:
    """A draft layer's input norms in one launch: e [T, N] and the G segments of h [T, G·N], each with its
    own weight (weights [1+G, N]) → [T, (1+G)·N] = [norm_0(e) | norm_1(h_1) | ... | norm_G(h_G)], each
    segment rounded as the reference RMSNorm rounds it."""
    n = e.shape[-1]
    groups = weights.shape[0]
    if e.stride(-1) != 1:
        e = e.contiguous()
    if h.stride(-1) != 1:
        h = h.contiguous()
    if h.shape[-1] != (groups - 1) * n or weights.shape[1] != n:
        raise ValueError(f"group_rmsnorm: e [T, {n}], h [T, {h.shape[-1]}] and weights {tuple(weights.shape)} disagree")
    t = e.shape[0]
    out = torch.empty(t, groups * n, dtype=e.dtype, device=e.device)
    if t:
        block = next_pow2(n)
        _group_rmsnorm_kernel[(t, groups)](e, e.stride(0), h, h.stride(0), weights, out, out.stride(0), eps,
                                           N=n, BLOCK=block, num_warps=max(1, min(8, block // 256)))
    return out
