"""The attention backend interface.

A backend is built for one runner and holds that runner's KV pool and request-to-token map; it
never takes a pool from the batch. `plan(batch)` builds the per-forward metadata (shared by all the
runner's layers) and remembers which batch it was built for; `forward` refuses to run a batch it did
not plan, so stale metadata from another step or another runner cannot be used silently.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from mleagle.engine.executor.forward_batch import ForwardBatch
from mleagle.engine.memory.kv_pool import KVPool
from mleagle.engine.memory.req_to_token import ReqToTokenPool


class BindingError(RuntimeError):
    """A forward reached a runner, pool or backend it is not bound to."""


class AttentionBackend(ABC):
    name: str

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self._planned: ForwardBatch | None = None
        self.num_plans = 0

    def plan(self, batch: ForwardBatch) -> None:
        if batch.binding is None or batch.binding.backend is not self:
            raise BindingError(f"backend of {self.kv_pool.name} asked to plan a batch bound to "
                               f"{batch.binding.name if batch.binding else None}")
        self._build(batch)
        self._planned = batch
        self.num_plans += 1

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] → [T, Hq*D]. Writes k/v into this backend's pool first."""
        if self._planned is not batch:
            raise BindingError(f"backend of {self.kv_pool.name}: forward on a batch it did not plan")
        self.kv_pool.write(layer, batch.out_cache_loc, k, v)
        return self._attend(layer, q, batch)

    @abstractmethod
    def _build(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def _attend(self, layer: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor: ...
