"""CUDA-graph runners: one per model runner, fixed buffers, graphs keyed by (mode, padded batch size).

A `GraphRunner` wraps one `ModelRunner` (the target, or draft runner k) and captures that runner's
uniform forwards — DECODE, TARGET_VERIFY or DRAFT_EXTEND, W rows per request — for a list of batch-size
buckets. Capture goes through the runner's own eager forward on a batch view of the graph runner's
fixed buffers, bound to that runner, so the refusal of a foreign binding and the backend's plan check
hold at capture exactly as in eager mode; `run` refuses a batch bound elsewhere before touching a
buffer. A live batch of bs requests is copied into the buffers and padded to its bucket: padded rows
use the pad request row (its request-to-token row is all zeros), so they read and write only the pad
slot 0 and never a real request's KV, and they are rewritten on every replay so nothing of an earlier,
larger batch leaks into a later one. Logits are cut back to `num_logit_rows` of the live batch.

Row counts come from one rule: each captured bucket records `row_meta(mode, padded bs, W, pruned)` (the
per-rank token and logprob counts of the configured tensor-parallel layout) and a replay recomputes
them from the live batch after padding; the two must agree (`MetaMismatch` otherwise), which is the
check that would have caught a draft-extend graph recording `[bs]` logprob rows where the forward
makes bs·W. Each bucket's batch view carries its captured metadata (`ForwardBatch.row_meta`), so the
tensor-parallel gathers inside the captured forward are sized by exactly what the check compares. On a
machine without CUDA (`emulate`), the same buffers, padding and metadata run with an eager forward
instead of a replay, so the CPU tests exercise everything but the graph itself.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mleagle.engine.attention.base import BindingError
from mleagle.engine.executor.forward_batch import ForwardBatch, ForwardMode, Layout, RowMeta, row_meta

if TYPE_CHECKING:
    from mleagle.engine.executor.runner import ForwardOutput, ModelRunner


class MetaMismatch(AssertionError):
    """A replay's row metadata differs from what its graph was captured with."""


# Fault injection for the metadata tests: draft-extend logprob counts filled with [bs] where the forward
# makes bs·W rows (the bug this project exists to never have). True: at replay only (the parity check
# must catch it); "capture": at capture and replay alike (as SGLang's capture did), so parity holds and
# the wrong counts drive the tensor-parallel gathers (the logits test must catch it). Never set outside
# tests.
FAULT_DRAFT_LOGPROB_BS: bool | str = False


def default_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, every 16 to 256: dense where decode batches usually are."""
    b = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 257, 16)]
    return sorted({x for x in b if x < max_bs} | {max_bs})


def bucket_for(buckets: list[int], bs: int) -> int | None:
    """The smallest captured batch size (ascending `buckets`) that holds `bs` requests, or None."""
    return next((b for b in buckets if b >= bs), None)


@dataclass
class Capture:
    graph: torch.cuda.CUDAGraph | None
    out: ForwardOutput | None
    meta: RowMeta


@dataclass
class GraphStats:
    replays: Counter[int] = field(default_factory=Counter)
    eager: Counter[str] = field(default_factory=Counter)
    capture_s: float = 0.0
    capture_mb: float = 0.0


class GraphRunner:
    def __init__(self, runner: ModelRunner, *, mode: ForwardMode, width: int, buckets: list[int],
                 hidden_size: int, dtype: torch.dtype, pruned: bool = False, emulate: bool = False,
                 pool: object | None = None, tp_size: int = 1, layout: Layout = "all_reduce"):
        if not mode.uniform:
            raise ValueError("only uniform modes (DECODE, TARGET_VERIFY, DRAFT_EXTEND) are captured")
        self.runner, self.mode, self.width, self.pruned = runner, mode, width, pruned
        self.buckets = sorted(set(buckets))
        self.emulate, self.pool = emulate, pool
        self.tp_size, self.layout = tp_size, layout
        r2t = runner.binding.req_to_token
        dev = r2t.req_to_token.device
        mb, w = self.buckets[-1], width
        t = mb * w
        self.pad_row = r2t.pad_row
        i64 = torch.int64
        # The fixed buffers every graph of this runner reads (their addresses are baked into the graphs),
        # and the pad template their padded tails are refilled from on every replay.
        self.buf = {
            "input_ids": torch.zeros(t, dtype=i64, device=dev),
            "positions": torch.arange(w, device=dev).repeat(mb),
            "out_cache_loc": torch.zeros(t, dtype=i64, device=dev),
            "req_pool_indices": torch.full((mb,), self.pad_row, dtype=i64, device=dev),
            "seq_lens": torch.full((mb,), w, dtype=i64, device=dev),
            "logit_rows": (torch.arange(mb, device=dev) * w) if pruned else torch.arange(t, device=dev),
        }
        if mode is ForwardMode.DRAFT_EXTEND:
            self.buf["hidden_in"] = torch.zeros(t, hidden_size, dtype=dtype, device=dev)
        self.pad = {k: v.clone() for k, v in self.buf.items()}
        # (buffer, its rows per request): W token rows, one request row, the rule's logit rows.
        self._per = [(k, self.rows(1) if k == "logit_rows" else 1 if k in ("req_pool_indices", "seq_lens") else w)
                     for k in self.buf]
        self._hi = mb  # requests' worth of rows that may hold live data (all of them before the first fill)
        self._bucket_views: dict[int, ForwardBatch] = {}
        self.caps: dict[int, Capture] = {}
        self.stats = GraphStats()

    # --- shapes -------------------------------------------------------------------------------
    def bucket(self, bs: int) -> int | None:
        return bucket_for(self.buckets, bs)

    def rows(self, bs: int) -> int:
        """Logit rows of a padded batch of `bs` requests, by the one rule."""
        return row_meta(self.mode, bs, self.width, pruned=self.pruned).logit_rows

    def _views(self, pbs: int) -> ForwardBatch:
        """The bucket's batch view over the fixed buffers (built once per bucket: the same objects, so a
        graph captured on them reads the same addresses at every replay). It carries the bucket's row
        metadata (`row_meta`): the per-rank counts the captured forward's tensor-parallel gathers are
        sized by, which every replay of the bucket must reproduce (`run` checks)."""
        v = self._bucket_views.get(pbs)
        if v is None:
            w, tot = self.width, pbs * self.width
            v = ForwardBatch(
                mode=self.mode, input_ids=self.buf["input_ids"][:tot], positions=self.buf["positions"][:tot],
                out_cache_loc=self.buf["out_cache_loc"][:tot], req_pool_indices=self.buf["req_pool_indices"][:pbs],
                seq_lens=self.buf["seq_lens"][:pbs], extend_lens=[w] * pbs, prefix_lens=[0] * pbs,
                logit_rows=self.buf["logit_rows"][: self.rows(pbs)], binding=self.runner.binding, width=w,
                hidden_in=self.buf["hidden_in"][:tot] if "hidden_in" in self.buf else None, pruned=self.pruned,
                max_seq_len=w, graph_bs=pbs)
            v = self._bucket_views[pbs] = dataclasses.replace(v, row_meta=self.meta_of(v))
        return v

    def static_batch(self, batch: ForwardBatch | None, pbs: int) -> ForwardBatch:
        """Copy a live batch (None at capture: all pad rows) into the buffers, padded to `pbs`.

        Rows past the live ones hold the pad template: refilled only where an earlier, larger batch
        left live data (`_hi`, in requests), so steady decoding copies nothing but the live rows."""
        base = self._views(pbs)
        bs = batch.bs if batch is not None else 0
        if batch is not None:
            if "hidden_in" in self.buf and batch.hidden_in is None:
                raise ValueError("a draft-extend batch without input hidden states")
            for k, per in self._per:
                n = per * bs
                self.buf[k][:n].copy_(getattr(batch, k).reshape(self.buf[k][:n].shape))
        if self._hi > bs:
            for k, per in self._per:
                self.buf[k][per * bs : per * self._hi].copy_(self.pad[k][per * bs : per * self._hi])
        self._hi = bs
        if batch is None:
            return base
        return dataclasses.replace(base, prefix_lens=list(batch.prefix_lens) + [0] * (pbs - bs), rids=batch.rids,
                                   max_seq_len=max(batch.max_seq_len, self.width))

    def meta_of(self, sb: ForwardBatch) -> RowMeta:
        """The metadata a padded static batch produces (at capture: all pad rows; at replay: live + pad)."""
        m = sb.meta(self.tp_size, self.layout)
        fault = FAULT_DRAFT_LOGPROB_BS
        if fault and self.mode is ForwardMode.DRAFT_EXTEND and (sb.rids or fault == "capture"):
            m = dataclasses.replace(m, global_num_tokens_for_logprob=(sb.bs,) * self.tp_size)
        return m

    # --- capture and replay --------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every bucket, largest first (so smaller graphs reuse the pool's memory)."""
        t0 = time.perf_counter()
        cuda = not self.emulate
        free0 = torch.cuda.mem_get_info()[0] if cuda else 0
        backend = self.runner.binding.backend
        if backend.supports_graphs:
            backend.init_graph(self.buckets[-1], self.width)
        for pbs in sorted(self.buckets, reverse=True):
            sb = self.static_batch(None, pbs)
            meta = sb.row_meta  # the bucket's: what the captured gathers are sized by (`_views`)
            assert meta is not None
            if int(sb.logit_rows.shape[0]) != meta.logit_rows:
                raise MetaMismatch(f"{self.runner.name}: buffer of {sb.logit_rows.shape[0]} logit rows, rule {meta.logit_rows}")
            if not cuda:
                self.caps[pbs] = Capture(None, None, meta)
                continue
            for _ in range(2):  # warm-up: lazy inits, Triton JIT, cuBLAS handles, outside the capture
                self.runner.forward_eager(sb, observe=False)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self.runner.forward_eager(sb, observe=False)
            self.caps[pbs] = Capture(g, out, meta)
        if cuda:
            torch.cuda.synchronize()
            self.stats.capture_mb = (free0 - torch.cuda.mem_get_info()[0]) / 2**20
        self.stats.capture_s = time.perf_counter() - t0

    def fits(self, batch: ForwardBatch) -> str | None:
        """None when the batch can replay; else the reason it runs eagerly."""
        if batch.mode is not self.mode:
            return "extend" if batch.mode is ForwardMode.EXTEND else f"mode {batch.mode.value}"
        if batch.width != self.width or batch.pruned != self.pruned:
            return "shape"
        pbs = self.bucket(batch.bs)
        if pbs is None:
            return "bs>max_bucket"
        if pbs not in self.caps:
            return "not captured"
        return None

    def run(self, batch: ForwardBatch) -> ForwardOutput:
        """Replay (or, emulated, run eagerly on the buffers) a batch that `fits`."""
        from mleagle.engine.executor.runner import ForwardOutput

        if batch.binding is not self.runner.binding:
            raise BindingError(f"graph runner of {self.runner.name} refuses a batch bound to "
                               f"{batch.binding.name if batch.binding else 'nothing'}")
        pbs = self.bucket(batch.bs)
        assert pbs is not None
        cap = self.caps[pbs]
        sb = self.static_batch(batch, pbs)
        meta = self.meta_of(sb)
        if meta != cap.meta:
            raise MetaMismatch(f"{self.runner.name} {self.mode.value} bs {batch.bs}→{pbs}: replay {meta} != capture {cap.meta}")
        if cap.graph is None:  # emulated: the same buffers and padding, an eager forward
            out = self.runner.forward_eager(sb, observe=False)
        else:
            self.runner.binding.backend.plan(sb)
            cap.graph.replay()
            out = cap.out
            assert out is not None
        self.stats.replays[pbs] += 1
        live = row_meta(self.mode, batch.bs, self.width, pruned=self.pruned)
        return ForwardOutput(out.logits[: live.logit_rows], out.hidden[: live.num_tokens], graph_bs=pbs)
