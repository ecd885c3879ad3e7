"""Random weights of any `ModelArch` (load_format = "dummy"), for shape and performance work.

Matrices are N(0, 0.02) and norms are ones, made directly in the target dtype on the target device
from a generator seeded with `dummy_seed`, so the same seed always gives the same weights (on the
same device). CPU normal sampling runs at only ~100M values/s, so on CPU a large matrix (over
`_DIRECT` values) is filled from one shared pool of N(0, 0.02) values at a seeded random offset
(a memory copy): a 7B shape then appears in seconds; its values are still N(0, 0.02) each, only
correlated across matrices, which performance work does not care about.
"""

from __future__ import annotations

import torch

from mleagle.engine.contract.config import ModelArch
from mleagle.engine.model_loader.names import expected_shapes

_DIRECT = 1 << 20  # tensors up to this many values are sampled independently
_POOL = 1 << 24


def load_dummy(
    arch: ModelArch, seed: int, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    dev = torch.device(device)
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    pool: torch.Tensor | None = None
    w: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(arch).items():
        x = torch.empty(shape, dtype=dtype, device=dev)
        if name.endswith("norm.weight"):
            x.fill_(1.0)
        elif dev.type != "cpu" or x.numel() <= _DIRECT:
            x.normal_(0.0, 0.02, generator=g)
        else:
            if pool is None:
                pool = torch.empty(_POOL).normal_(0.0, 0.02, generator=g).to(dtype)
            flat, i = x.view(-1), 0
            while i < flat.numel():
                off = int(torch.randint(0, _POOL, (1,), generator=g))
                m = min(_POOL - off, flat.numel() - i)
                flat[i : i + m].copy_(pool[off : off + m])
                i += m
        w[name] = x
    return w
