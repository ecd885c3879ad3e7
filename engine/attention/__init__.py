"""Attention backends: the interface (base), the torch reference (torch_native, the CPU path), Triton
(the GPU default) and FlashInfer (optional). `create_backend` picks one by name; the GPU backends are
imported only when chosen, so the CPU path never imports Triton or FlashInfer."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mleagle.engine.attention.base import AttentionBackend
    from mleagle.engine.memory.kv_pool import KVPool
    from mleagle.engine.memory.req_to_token import ReqToTokenPool

BACKENDS = ("auto", "torch", "triton", "flashinfer")


def resolve_backend(name: str, device: torch.device | str) -> str:
    """'auto' is Triton on CUDA (when installed), the torch reference elsewhere."""
    from mleagle.engine.kernels import has_triton

    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: one of {', '.join(BACKENDS)}")
    cuda = torch.device(device).type == "cuda"
    if name == "auto":
        return "triton" if cuda and has_triton() else "torch"
    # The Triton interpreter (TRITON_INTERPRET=1, tests) runs the Triton kernels on CPU tensors.
    interp = name == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    if name in ("triton", "flashinfer") and not cuda and not interp:
        raise ValueError(f"attention backend {name!r} needs device 'cuda' (the CPU runs the torch backend)")
    if name == "triton" and not has_triton():
        raise ValueError("attention backend 'triton' needs the triton package")
    return name


def create_backend(name: str, kv_pool: KVPool, req_to_token: ReqToTokenPool,
                   num_q_heads: int | None = None) -> AttentionBackend:
    """A backend of kind `name` (already resolved, or 'auto') over one runner's pool and map."""
    name = resolve_backend(name, kv_pool.k[0].device if kv_pool.k else "cpu")
    if name == "triton":
        from mleagle.engine.attention.triton_backend import TritonBackend

        return TritonBackend(kv_pool, req_to_token, num_q_heads)
    if name == "flashinfer":
        from mleagle.engine.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(kv_pool, req_to_token, num_q_heads)
    from mleagle.engine.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend(kv_pool, req_to_token, num_q_heads)
