"""The attention backend interface.

A backend is built for one runner and holds that runner's KV pool and request-to-token map; it
never takes a pool from the batch. `plan(batch)` builds the per-forward metadata (shared by all the
runner's layers) and remembers which batch it was built for; `forward` refuses to run a batch it did
not plan, so stale metadata from another step or another runner cannot be used silently.

`forward(layer, qkv, positions, rope, batch)` takes the fused QKV projection of this rank's heads,
[T, (Hq + 2·Hk)·D], applies rotary to q and k, stores k and v at `batch.out_cache_loc` in layer
`layer` of its own pool, attends, and returns [T, Hq·D]. Rotary and the store are the backend's job
so that a GPU backend can do both in one kernel; the torch backend does them with the reference ops.

CUDA graphs (`supports_graphs`): a graph runner calls `init_graph(max_bs, max_width)` once, then
`plan(batch)` before capture and before every replay, with a uniform batch (DECODE, TARGET_VERIFY,
DRAFT_EXTEND) whose tensors are views of the runner's fixed buffers and whose host lists describe the
padded batch. For such a batch a graph-capable backend's `plan` reads no device value on the host,
and every device tensor its kernels read lives at an address that does not change between calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from mleagle.engine.executor.forward_batch import BindingError, ForwardBatch
from mleagle.engine.layers.rope import RotaryEmbedding
from mleagle.engine.memory.kv_pool import KVPool
from mleagle.engine.memory.req_to_token import ReqToTokenPool


class AttentionBackend(ABC):
    name: str
    supports_graphs: bool = False
    # EXTEND (prefill) under graphs: the plan of an `ExtendGraphRunner` view reads nothing on the host
    # and its kernels take their per-request offsets from the view's device tensors.
    supports_extend_graphs: bool = False
    # Plans from the batch's host lengths, so they must be exact: no step may be in flight (overlap
    # scheduling keeps the host's lengths one iteration behind the device's).
    needs_host_lens: bool = False

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool, num_q_heads: int | None = None):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        # [num_slots, Hk, D] per layer: the pool fixes this rank's KV heads and the head size.
        self.num_kv_heads, self.head_dim = (int(x) for x in kv_pool.k[0].shape[1:]) if kv_pool.k else (0, 0)
        self.num_q_heads = num_q_heads  # None: taken from the first forward's qkv width
        self.scale = self.head_dim ** -0.5 if self.head_dim else 1.0
        self._planned: ForwardBatch | None = None
        self.num_plans = 0

    def plan(self, batch: ForwardBatch) -> None:
        if batch.binding is None or batch.binding.backend is not self:
            raise BindingError(f"backend of {self.kv_pool.name} asked to plan a batch bound to "
                               f"{batch.binding.name if batch.binding else None}")
        self._build(batch)
        self._planned = batch
        self.num_plans += 1

    def init_graph(self, max_bs: int, max_width: int) -> None:
        """Allocate whatever fixed buffers graph replays need (called once, before any capture)."""
        if not self.supports_graphs:
            raise NotImplementedError(f"attention backend {self.name} does not support CUDA graphs")

    def forward(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                batch: ForwardBatch) -> torch.Tensor:
        """qkv: [T, (Hq + 2·Hk)·D] → [T, Hq·D]. Writes rotated k and v into this backend's pool first."""
        if self._planned is not batch:
            raise BindingError(f"backend of {self.kv_pool.name}: forward on a batch it did not plan")
        return self._forward(layer, qkv, positions, rope, batch)

    def _forward(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                 batch: ForwardBatch) -> torch.Tensor:
        """Rotary + store, then attention; a backend may fuse the two (Triton does for uniform batches)."""
        return self._attend(layer, self._rope_store(layer, qkv, positions, rope, batch), batch)

    def q_heads(self, qkv: torch.Tensor) -> int:
        hq = qkv.shape[1] // self.head_dim - 2 * self.num_kv_heads
        if hq <= 0 or hq % self.num_kv_heads or qkv.shape[1] % self.head_dim:
            raise ValueError(f"qkv width {qkv.shape[1]} does not fit {self.num_kv_heads} KV heads of {self.head_dim}")
        if self.num_q_heads is not None and hq != self.num_q_heads:
            raise ValueError(f"qkv holds {hq} query heads, the backend was built for {self.num_q_heads}")
        return hq

    @abstractmethod
    def _build(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def _rope_store(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                    batch: ForwardBatch) -> torch.Tensor:
        """Rotate q and k, write k and v at `batch.out_cache_loc` in this backend's pool; return q [T, Hq, D]."""

    @abstractmethod
    def _attend(self, layer: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D] against this backend's pool → [T, Hq·D]."""
