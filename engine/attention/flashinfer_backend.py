"""The FlashInfer attention backend (optional: needs the `flashinfer` package and CUDA).

Rotary and the KV store run in the Triton `rope_store` kernel (the same one as the Triton backend);
attention runs in FlashInfer's paged kernels over this backend's pool seen as pages of one token
([num_slots, 1, Hk, D], NHD), with the page list gathered from the request-to-token map on the device
(`fill_kv_indices`). DECODE uses `BatchDecodeWithPagedKVCacheWrapper` (tensor cores from a GQA group
of 4, as SGLang does); TARGET_VERIFY / DRAFT_EXTEND (W > 1) and EXTEND use
`BatchPrefillWithPagedKVCacheWrapper` with `causal=True`, whose mask is aligned bottom-right: query
row i of a request with q_len rows and kv_len keys sees keys j <= kv_len - q_len + i, the engine's
position rule.

FlashInfer plans on the host: it needs the per-request lengths as host values. Those come from the
batch's host lists (`prefix_lens` + `extend_lens`), never from a device read, so planning before a
graph replay costs no sync. After `init_graph(max_bs, max_width)`, uniform batches of up to `max_bs`
requests use wrappers built with `use_cuda_graph=True`, one per (kind, batch size, width), over fixed
index buffers that every `plan` rewrites in place; larger batches and EXTEND use dynamic wrappers.
`plan` called while a stream is capturing (a capture that goes through the runner's forward) only
checks that the bucket was planned before the capture: host planning cannot be captured.
One 128 MB float workspace per device is shared by every FlashInfer backend of the process (runners
run one after another on one stream, as SGLang shares it).
"""

from __future__ import annotations

from typing import Any

import torch

from mleagle.engine.attention.base import AttentionBackend
from mleagle.engine.attention.triton_backend import triton_rope_store
from mleagle.engine.executor.forward_batch import ForwardBatch, ForwardMode
from mleagle.engine.kernels.attention import fill_kv_indices
from mleagle.engine.layers.rope import RotaryEmbedding
from mleagle.engine.memory.kv_pool import KVPool
from mleagle.engine.memory.req_to_token import ReqToTokenPool

WORKSPACE_BYTES = 128 * 1024 * 1024
_workspaces: dict[torch.device, torch.Tensor] = {}


def import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as err:  # the message is for the user who asked for this backend
        raise RuntimeError(
            "attention backend 'flashinfer' needs the flashinfer package (flashinfer-python 0.7.x, CUDA); "
            f"it is not importable here ({err}). Install it, or use --attention-backend triton."
        ) from err
    return flashinfer


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _workspaces:
        _workspaces[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    supports_graphs = True
    needs_host_lens = True

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool, num_q_heads: int | None = None):
        super().__init__(kv_pool, req_to_token, num_q_heads)
        self.fi = import_flashinfer()
        if num_q_heads is None:
            raise ValueError("the flashinfer backend plans before the first forward: pass num_q_heads")
        self.device = kv_pool.k[0].device
        if self.device.type != "cuda":
            raise RuntimeError("attention backend 'flashinfer' runs on CUDA only")
        self.dtype = kv_pool.k[0].dtype
        self.tensor_cores = num_q_heads // self.num_kv_heads >= 4
        ws = _workspace(self.device)
        self._decode = self.fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=self.tensor_cores)
        self._prefill = self.fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        self._graph: dict[tuple[str, int, int], Any] = {}
        self._max_bs = 0
        self._run: Any = None
        self._caches = [(k.unsqueeze(1), v.unsqueeze(1)) for k, v in zip(kv_pool.k, kv_pool.v)]

    # --- graphs ---------------------------------------------------------------------------------------
    def init_graph(self, max_bs: int, max_width: int) -> None:
        """Fixed index buffers for graph batches of up to max_bs requests of width <= max_width."""
        dev, i32 = self.device, torch.int32
        max_ctx = self.req_to_token.max_context
        self._max_bs, self._max_width = max_bs, max_width
        self._qo_indptr = torch.zeros(max_bs + 1, dtype=i32, device=dev)
        self._kv_indptr = torch.zeros(max_bs + 1, dtype=i32, device=dev)
        self._kv_last = torch.ones(max_bs, dtype=i32, device=dev)
        self._kv_indices = torch.zeros(max_bs * max_ctx, dtype=i32, device=dev)  # the wrappers' own copy
        self._kv_fill = torch.zeros(max_bs * max_ctx, dtype=i32, device=dev)  # what fill_kv_indices writes

    def _graph_wrapper(self, kind: str, bs: int, w: int) -> Any:
        key = (kind, bs, w)
        if key not in self._graph:
            ws = _workspace(self.device)
            if kind == "decode":
                self._graph[key] = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
                    paged_kv_indptr_buffer=self._kv_indptr[: bs + 1], paged_kv_indices_buffer=self._kv_indices,
                    paged_kv_last_page_len_buffer=self._kv_last[:bs])
            else:
                self._graph[key] = self.fi.BatchPrefillWithPagedKVCacheWrapper(
                    ws, "NHD", use_cuda_graph=True, qo_indptr_buf=self._qo_indptr[: bs + 1],
                    paged_kv_indptr_buf=self._kv_indptr[: bs + 1], paged_kv_indices_buf=self._kv_indices,
                    paged_kv_last_page_len_buf=self._kv_last[:bs])
        return self._graph[key]

    # --- plan -----------------------------------------------------------------------------------------
    def _build(self, batch: ForwardBatch) -> None:
        bs, w = batch.bs, batch.width
        kind = "decode" if batch.mode is ForwardMode.DECODE or (batch.mode.uniform and w == 1) else "prefill"
        graph = batch.mode.uniform and 0 < bs <= self._max_bs and w <= self._max_width
        if graph and torch.cuda.is_current_stream_capturing():
            # A capture going through the runner's forward: the graph runner planned this bucket just
            # before capturing; host planning (and its copies) cannot be recorded in the graph.
            key = (kind, bs, w)
            if key not in self._graph:
                raise RuntimeError(f"flashinfer: capture of {key} without a plan before it")
            self._run = (kind, self._graph[key])
            return
        seq = batch.seq_lens_cpu
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.tensor(seq, dtype=torch.int32).cumsum(0)
        qo_indptr = torch.zeros(bs + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.tensor(batch.extend_lens, dtype=torch.int32).cumsum(0)
        total = int(kv_indptr[-1])
        last = torch.ones(bs, dtype=torch.int32)
        if graph:
            wrapper = self._graph_wrapper(kind, bs, w)
            dev_indptr = self._kv_indptr[: bs + 1]
            dev_indptr.copy_(kv_indptr, non_blocking=True)
            indices = self._kv_fill[:total]
        else:
            wrapper = self._decode if kind == "decode" else self._prefill
            dev_indptr = kv_indptr.to(self.device, non_blocking=True)
            indices = torch.empty(total, dtype=torch.int32, device=self.device)
        fill_kv_indices(self.req_to_token.req_to_token, batch.req_pool_indices, batch.seq_lens, dev_indptr, indices)
        hq, hk, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        if kind == "decode":
            wrapper.plan(kv_indptr, indices, last, hq, hk, d, 1, pos_encoding_mode="NONE", **common)
        else:
            wrapper.plan(qo_indptr, kv_indptr, indices, last, hq, hk, d, 1, causal=True, **common)
        self._run = (kind, wrapper)

    # --- forward --------------------------------------------------------------------------------------
    def _rope_store(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                    batch: ForwardBatch) -> torch.Tensor:
        return triton_rope_store(self, layer, qkv, positions, rope, batch)

    def _attend(self, layer: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        _, wrapper = self._run
        o = wrapper.run(q, self._caches[layer])
        return o.view(q.shape[0], -1)
