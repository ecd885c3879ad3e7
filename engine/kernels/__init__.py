"""GPU kernels (Triton): paged attention, rotary + KV store, fused add-RMSNorm, a draft layer's grouped
input norm, SiLU-and-mul, and greedy speculation's bookkeeping (row argmax, accept + commit, draft step).

Every kernel has a torch reference it is tested against (the attention backends' torch path, the
layers' reference forward, `SlotState.verify_greedy` / `.draft_greedy`). The callers pick the Triton kernel only for CUDA
tensors with Triton installed and the fused layers not switched off, so the CPU path never imports
Triton. The switch is process-wide (an engine process runs one engine); `EngineConfig.fused_layers =
false` sets it, for debugging a suspected kernel against the reference on the same GPU.

The kernels are written to be captured in CUDA graphs: their grids depend only on host-side shapes
(padded batch size, width), and whatever they read per forward (slot maps, request rows, lengths)
they read from device tensors at launch, so a replay sees the live values.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

_fused = True
_has_triton: bool | None = None


def has_triton() -> bool:
    global _has_triton
    if _has_triton is None:
        _has_triton = importlib.util.find_spec("triton") is not None
    return _has_triton


def set_fused_layers(on: bool) -> None:
    """Process-wide: False makes the fused layers run their torch reference even on CUDA."""
    global _fused
    _fused = on


def fused_layers_on(x: torch.Tensor) -> bool:
    """Whether a fused layer should run its Triton kernel on this tensor."""
    return _fused and x.is_cuda and has_triton()


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


_compat_done = False


def interpreter_compat() -> None:
    """Under TRITON_INTERPRET=1 (the CPU tests): triton 3.6's interpreter turns a loaded scalar into an
    int with int() of a shape-(1,) array, which numpy >= 2.4 refuses, so loop bounds read from memory
    fail; later triton releases squeeze first. Do the same. Called by each kernel module at import."""
    global _compat_done
    if _compat_done or os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched
    _compat_done = True
