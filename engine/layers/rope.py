"""Rotary position embedding (rotate-half convention, as HF Llama), with the Llama-3 scaling variant.

cos/sin are precomputed for every position once; a forward gathers them by `positions`, so any
batch layout (prefill chunks, decode, verify windows) gets the right rotation per token.
"""

from __future__ import annotations

import math

import torch

from mleagle.engine.contract.config import RopeScaling


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    f = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return f
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, a smooth ramp between.
    low_wl = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wl = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wl = 2 * math.pi / f
    scaled = torch.where(wl > low_wl, f / scaling.factor, f)
    smooth = (scaling.original_max_position_embeddings / wl - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    mid = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_mid = (wl >= high_wl) & (wl <= low_wl)
    return torch.where(is_mid, mid, scaled)


class RotaryEmbedding(torch.nn.Module):
    cos: torch.Tensor  # [max_pos, D] buffers, registered in __init__
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: RopeScaling | None, dtype: torch.dtype):
        super().__init__()
        t = torch.arange(max_pos, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq(head_dim, theta, scaling))
        emb = torch.cat([freqs, freqs], dim=-1)
        # Computed in float32 and cast, matching HF's numerics.
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D], positions: [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] (q and k heads side by side): one rotation for both halves the small ops."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
