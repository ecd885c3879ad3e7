"""The memory manager: request slots and KV pages for every runner, in one place.

It owns the shared `SlotAllocator` and a free list of request slots, and it writes each allocation
into every runner's request-to-token map, so the target and all draft runners always agree on which
slot holds which position. Requests grow by `ensure(req, n)`; everything a request holds comes back
with `release(req)`, whatever way the request ended.
"""

from __future__ import annotations

from typing import Protocol

import torch

from mleagle.engine.memory.allocator import SlotAllocator
from mleagle.engine.memory.req_to_token import ReqToTokenPool


class HoldsKV(Protocol):
    req_pool_idx: int | None
    pages: list[int]


class MemoryManager:
    def __init__(self, allocator: SlotAllocator, maps: list[ReqToTokenPool]):
        self.allocator = allocator
        self.maps = maps
        self.max_reqs = maps[0].max_reqs
        self.max_context = maps[0].max_context
        self.free_reqs: list[int] = list(range(self.max_reqs - 1, -1, -1))

    def add_map(self, m: ReqToTokenPool) -> None:
        if m.max_reqs != self.max_reqs or m.max_context != self.max_context:
            raise ValueError("every runner's request-to-token map must have the same shape")
        self.maps.append(m)

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    def pages_needed(self, req: HoldsKV, new_len: int) -> int:
        return max(0, -(-new_len // self.page_size) - len(req.pages))

    def can_ensure(self, req: HoldsKV, new_len: int, reserve_pages: int = 0) -> bool:
        need = self.pages_needed(req, new_len) + reserve_pages
        return need <= len(self.allocator.free_pages) and (req.req_pool_idx is not None or self.free_reqs)

    def ensure(self, req: HoldsKV, new_len: int) -> bool:
        """Give `req` slots for positions [0, new_len). False (nothing changed) if the pool is short."""
        if new_len > self.max_context:
            raise ValueError(f"position {new_len} beyond the request-to-token map ({self.max_context})")
        if req.req_pool_idx is None:
            if not self.free_reqs:
                return False
        need = self.pages_needed(req, new_len)
        pages = self.allocator.alloc(need) if need else []
        if pages is None:
            return False
        if req.req_pool_idx is None:
            req.req_pool_idx = self.free_reqs.pop()
        if pages:
            start = len(req.pages) * self.page_size
            req.pages.extend(pages)
            p = torch.tensor(pages, dtype=torch.int64)
            slots = (p[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
            for m in self.maps:
                m.req_to_token[req.req_pool_idx, start : start + len(slots)] = slots.to(m.req_to_token.device)
        return True

    def release(self, req: HoldsKV) -> None:
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        if req.req_pool_idx is not None:
            self.free_reqs.append(req.req_pool_idx)
            req.req_pool_idx = None

    @property
    def num_used_reqs(self) -> int:
        return self.max_reqs - len(self.free_reqs)
