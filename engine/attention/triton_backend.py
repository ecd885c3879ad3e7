"""The Triton attention backend: the GPU default, graph-capturable.

Uniform batches (DECODE, TARGET_VERIFY, DRAFT_EXTEND) take one launch per layer: `decode_attention`
rotates q and k, stores k and v into this backend's pool and attends (plus a merge launch when the
keys are split: at small batches to fill the SMs, and at least the tile's `min_splits` at any batch, so
that the longest request's keys are not one program's alone). EXTEND takes two: `rope_store`, then `extend_attention`.
The kernels read the slot map, the request rows and the lengths from the batch's own device
tensors, so a uniform batch needs no device metadata at all: `plan` only records host-side shapes
(batch size, width, KV splits), which is why it is safe before a capture and before every replay,
and why `init_graph` has nothing to allocate. An eager EXTEND batch copies its query offsets and
lengths from the host lists; a prefill graph's EXTEND view carries them on the device
(`ExtendGraphRunner`), so its plan is host-side only too (`supports_extend_graphs`).
"""

from __future__ import annotations

import torch

from mleagle.engine.attention.base import AttentionBackend
from mleagle.engine.executor.forward_batch import ForwardBatch
from mleagle.engine.kernels.attention import (
    decode_attention,
    decode_tile,
    extend_attention,
    num_kv_splits,
    rope_store,
)
from mleagle.engine.layers.rope import RotaryEmbedding
from mleagle.engine.memory.kv_pool import KVPool
from mleagle.engine.memory.req_to_token import ReqToTokenPool


def triton_rope_store(be: AttentionBackend, layer: int, qkv: torch.Tensor, positions: torch.Tensor,
                      rope: RotaryEmbedding, batch: ForwardBatch) -> torch.Tensor:
    """Rotary + K/V store in one Triton launch into `be`'s own pool (the Triton and FlashInfer backends)."""
    q = rope_store(qkv, positions, rope.cos, rope.sin, batch.out_cache_loc, be.kv_pool.k[layer],
                   be.kv_pool.v[layer], be.q_heads(qkv))
    be.kv_pool.num_writes += 1
    return q


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the CPU interpreter: exercise the split path with a few splits


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_graphs = True
    supports_extend_graphs = True
    # Upper bound on KV splits (see num_kv_splits); 1 turns splitting off, the tile's minimum included.
    max_kv_splits = 16

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool, num_q_heads: int | None = None):
        super().__init__(kv_pool, req_to_token, num_q_heads)
        self.device = kv_pool.k[0].device
        self.num_sms = _num_sms(self.device)
        self.num_splits = 1
        self.tile = decode_tile(kv_pool.k[0].shape[2])  # the decode kernel's launch shape, fixed at start
        self._ext: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def init_graph(self, max_bs: int, max_width: int) -> None:
        """Nothing to allocate: the kernels read the batch's own (fixed) buffers."""

    def splits_for(self, bs: int) -> int:
        return num_kv_splits(bs, self.num_kv_heads, self.num_sms, self.max_kv_splits, self.tile.min_splits)

    def _build(self, batch: ForwardBatch) -> None:
        if batch.mode.uniform:
            # Host-side only: the padded batch size fixes the grid; lengths are read on the device.
            self.num_splits = self.splits_for(batch.bs)
            self._ext = None
        elif batch.extend_start is not None and batch.extend_lens_t is not None:
            # A prefill graph's view: offsets and lengths already on the device, the grid by its bucket.
            self._ext = (batch.extend_start, batch.extend_lens_t, batch.max_extend)
        else:
            starts, s = [], 0
            for e in batch.extend_lens:
                starts.append(s)
                s += e
            meta = torch.tensor([starts, batch.extend_lens], dtype=torch.int32).to(self.device, non_blocking=True)
            self._ext = (meta[0], meta[1], max(batch.extend_lens, default=0))

    def _forward(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                 batch: ForwardBatch) -> torch.Tensor:
        if self._ext is not None:
            return super()._forward(layer, qkv, positions, rope, batch)
        o = decode_attention(qkv, positions, rope.cos, rope.sin, batch.out_cache_loc, self.kv_pool.k[layer],
                             self.kv_pool.v[layer], self.req_to_token.req_to_token, batch.req_pool_indices,
                             batch.seq_lens, self.q_heads(qkv), batch.width, self.num_splits, self.scale,
                             tile=self.tile)
        self.kv_pool.num_writes += 1
        return o.view(qkv.shape[0], -1)

    def _rope_store(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                    batch: ForwardBatch) -> torch.Tensor:
        return triton_rope_store(self, layer, qkv, positions, rope, batch)

    def _attend(self, layer: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self._ext is None:
            raise RuntimeError("uniform batches attend in decode_attention (rotary and store included)")
        qo_start, ext_lens, max_ext = self._ext
        o = extend_attention(q, self.kv_pool.k[layer], self.kv_pool.v[layer], self.req_to_token.req_to_token,
                             batch.req_pool_indices, batch.seq_lens, qo_start, ext_lens, max_ext, self.scale)
        return o.view(q.shape[0], -1)
