"""A paged token KV pool: per layer a K and a V buffer of [num_slots, kv_heads, head_dim].

Each runner owns one (the target's with all its layers, draft runner k's with its one layer). A pool
has an identity (`name`) so bindings and tests can check which pool a forward touched, and it
counts its writes, so a spy can prove a step wrote only its own pool.
"""

from __future__ import annotations

import torch

from mleagle.engine.memory.zeros import lazy_zeros


class KVPool:
    def __init__(self, name: str, num_layers: int, num_slots: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, page_size: int = 1):
        self.name = name
        self.num_layers, self.num_slots, self.page_size = num_layers, num_slots, page_size
        # One allocation viewed per layer, zero without touching its pages on the CPU (see `lazy_zeros`).
        self.buf = lazy_zeros((num_layers, 2, num_slots, kv_heads, head_dim), dtype, device)
        self.k = [self.buf[i, 0] for i in range(num_layers)]
        self.v = [self.buf[i, 1] for i in range(num_layers)]
        self.num_writes = 0

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][loc] = k
        self.v[layer][loc] = v
        self.num_writes += 1

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()

    @staticmethod
    def slot_bytes(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
