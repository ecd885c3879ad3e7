"""Large zeroed buffers that cost nothing until they are written: the KV pools and the hidden-state pool.

On the CPU a `torch.zeros` of a pool writes every page of it at start-up: 1.5 GB for SmolLM2's default
32k-token pool, and on a virtual machine whose memory has not been touched yet that took 5-7 s per
engine (0.4 s on pages touched before). An anonymous `mmap` is zero by definition (POSIX) and gets its
pages from the kernel on first write, so a pool costs only the KV actually written. Other devices, and
small buffers, take `torch.zeros`.
"""

from __future__ import annotations

import math
import mmap

import torch

LAZY_MIN_BYTES = 1 << 20


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    n = math.prod(shape)
    nbytes = n * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < LAZY_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    # The tensor keeps the mapping alive (frombuffer holds the buffer); it is unmapped with the tensor.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=n).view(shape)
