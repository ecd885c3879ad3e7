"""The reference attention backend: rotary by the reference ops, the KV store by index assignment,
paged KV gathered by the slot map, then torch SDPA.

EXTEND batches (ragged prompt chunks) attend request by request, so a request's prefill is computed
the same way alone or in a batch. Uniform batches (DECODE, TARGET_VERIFY, DRAFT_EXTEND: W rows per
request) run one batched SDPA over [bs, W] queries and keys padded to the longest sequence, with a
boolean mask that admits key j for the query at position p iff j <= p. The metadata (gather indices
and mask) is built once per forward and shared by every layer. This is the CPU path and the
reference every GPU backend is tested against; it cannot be captured in a CUDA graph (its plan
builds metadata sized by the longest sequence, and SDPA with a boolean mask re-plans per length).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mleagle.engine.attention.base import AttentionBackend
from mleagle.engine.executor.forward_batch import ForwardBatch
from mleagle.engine.layers.rope import RotaryEmbedding


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"

    def _build(self, batch: ForwardBatch) -> None:
        r2t = self.req_to_token.req_to_token
        seq = batch.seq_lens_cpu
        if batch.mode.uniform:
            # The host bound, not the host lengths: with a step in flight those lag the device's.
            bs, w, lk = batch.bs, batch.width, max(batch.max_seq_len, max(seq))
            self.kv_idx = r2t[batch.req_pool_indices, :lk]  # [bs, Lk]
            # Flat slot list for index_select: a 2-D advanced index (kb[kv_idx]) takes aten::index's
            # generic path, 2-6x slower, and at batch 32 that gather was most of a decode step.
            self.kv_flat = self.kv_idx.reshape(-1)
            keys = torch.arange(lk, device=r2t.device)
            qpos = batch.positions.view(bs, w)
            self.mask = (keys.view(1, 1, lk) <= qpos.view(bs, w, 1)).unsqueeze(1)  # [bs, 1, W, Lk]
        else:
            rpi = batch.req_pool_indices.tolist()
            self.spans = []
            start = 0
            for i, (p, e) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
                if e == 0:  # a prefill graph's padding request (emulated): no rows, nothing to attend
                    continue
                kv_idx = r2t[rpi[i], : p + e]
                keys = torch.arange(p + e, device=r2t.device)
                qpos = torch.arange(p, p + e, device=r2t.device)
                mask = None if p == 0 else keys.view(1, -1) <= qpos.view(-1, 1)
                self.spans.append((start, e, kv_idx, mask))
                start += e

    def _rope_store(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                    batch: ForwardBatch) -> torch.Tensor:
        hk, d = self.num_kv_heads, self.head_dim
        hq = self.q_heads(qkv)
        t, nqk = qkv.shape[0], (hq + hk) * d
        # q and k heads are adjacent in the fused output: rotate them in one pass (same math, half the ops)
        qk = rope.rotate(positions, qkv[:, :nqk].view(t, hq + hk, d))
        self.kv_pool.write(layer, batch.out_cache_loc, qk[:, hq:], qkv[:, nqk:].view(t, hk, d))
        return qk[:, :hq]

    def _attend(self, layer: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        kb, vb = self.kv_pool.k[layer], self.kv_pool.v[layer]
        hq, d = q.shape[1], q.shape[2]
        if batch.mode.uniform:
            bs, w = batch.bs, batch.width
            shape = (bs, self.kv_idx.shape[1], kb.shape[1], d)
            k = kb.index_select(0, self.kv_flat).view(shape).transpose(1, 2)  # [bs, Hk, Lk, D]
            v = vb.index_select(0, self.kv_flat).view(shape).transpose(1, 2)
            qq = q.view(bs, w, hq, d).transpose(1, 2)  # [bs, Hq, W, D]
            o = F.scaled_dot_product_attention(qq, k, v, attn_mask=self.mask, enable_gqa=True)
            return o.transpose(1, 2).reshape(bs * w, hq * d)
        # A padded (emulated prefill graph) batch has rows no request covers: zeros, not garbage.
        alloc = torch.empty if sum(batch.extend_lens) == q.shape[0] else torch.zeros
        out = alloc(q.shape[0], hq * d, dtype=q.dtype, device=q.device)
        for start, e, kv_idx, mask in self.spans:
            k = kb.index_select(0, kv_idx).transpose(0, 1).unsqueeze(0)  # [1, Hk, L, D]
            v = vb.index_select(0, kv_idx).transpose(0, 1).unsqueeze(0)
            qq = q[start : start + e].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
            out[start : start + e] = o[0].transpose(0, 1).reshape(e, hq * d)
        return out
