"""CUDA-graph runners: one per model runner, fixed buffers, graphs keyed by padded batch size.

A `GraphRunner` wraps one `ModelRunner` (the target, or draft runner k) and captures that runner's
uniform forwards — DECODE, TARGET_VERIFY or DRAFT_EXTEND, W rows per request — for a list of batch-size
buckets, through the shared skeleton of `capture.py`. Capture goes through the runner's own eager
forward on a batch view of the graph runner's fixed buffers, bound to that runner, so the refusal of a
foreign binding and the backend's plan check hold at capture exactly as in eager mode; `run` refuses
a batch bound elsewhere before touching a buffer. A live batch of bs requests is copied into the
buffers and padded to its bucket: padded rows use the pad request row (its request-to-token row is
all zeros), so they read and write only the pad slot 0 and never a real request's KV, and they are
rewritten on every replay so nothing of an earlier, larger batch leaks into a later one. Logits are
cut back to `num_logit_rows` of the live batch.

Row counts come from one rule. Each bucket's batch view carries `row_meta(mode, padded bs, W, pruned)`
for the configured tensor-parallel layout (`ForwardBatch.row_meta`), which sizes every gather inside
the captured forward. At capture that metadata is checked against a live batch of the bucket built
the way the worker builds one (from the request map, not the buffers) and, on CUDA, against the shapes
the captured forward produced: a draft-extend graph recording `[bs]` logprob rows where the forward
makes bs·W fails at start-up. A replay's metadata depends only on its bucket, so it is not rechecked.
On a machine without CUDA (`emulate`), the same buffers, padding and metadata run with an eager
forward instead of a replay, so the CPU tests exercise everything but the graph itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from mleagle.engine.executor.capture import (
    Capture,
    GraphStats,
    MetaMismatch,
    bucket_for,
    capture_buckets,
    held_output,
)
from mleagle.engine.executor.forward_batch import (
    ForwardBatch,
    ForwardMode,
    ForwardOutput,
    Layout,
    RowMeta,
    check_binding,
    row_meta,
    uniform_batch,
)
from mleagle.engine.executor.runner import ModelRunner


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
        self.caps: dict[int, Capture[RowMeta, ForwardOutput]] = {}
        self.stats = GraphStats()
        self._emu: dict[int, ForwardOutput] = {}  # emulated replays' outputs, per bucket (see `held_output`)

    # --- shapes -------------------------------------------------------------------------------
    def bucket(self, bs: int) -> int | None:
        return bucket_for(self.buckets, bs)

    def rows(self, bs: int) -> int:
        """Logit rows of a padded batch of `bs` requests, by the one rule."""
        return row_meta(self.mode, bs, self.width, pruned=self.pruned).logit_rows

    def _views(self, pbs: int) -> ForwardBatch:
        """The bucket's batch view over the fixed buffers (built once per bucket: the same objects, so a
        graph captured on them reads the same addresses at every replay), carrying the bucket's row
        metadata: the per-rank counts the captured forward's tensor-parallel gathers are sized by."""
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
            v = self._bucket_views[pbs] = dataclasses.replace(v, row_meta=v.meta(self.tp_size, self.layout))
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

    def live_meta(self, pbs: int) -> RowMeta:
        """What a live batch of `pbs` requests needs, built as the workers build one (`uniform_batch` from
        the request map, logit rows chosen per mode), not from this runner's buffers or `rows`."""
        r2t = self.runner.binding.req_to_token
        dev = r2t.req_to_token.device
        w = self.width
        rpi = torch.full((pbs,), self.pad_row, dtype=torch.int64, device=dev)
        if self.mode is ForwardMode.DECODE:
            rows = torch.arange(pbs, device=dev)
        elif self.pruned:
            rows = torch.arange(pbs, device=dev) * w + (w - 1)  # one row per request (any accepted count)
        else:
            rows = torch.arange(pbs * w, device=dev)
        live = uniform_batch(self.mode, input_ids=torch.zeros(pbs, w, dtype=torch.int64, device=dev),
                             req_pool_indices=rpi, kv_lens=torch.zeros(pbs, dtype=torch.int64, device=dev),
                             req_to_token=r2t.req_to_token, width=w, host_kv_lens=[0] * pbs, max_seq_len=w,
                             logit_rows=rows, pruned=self.pruned)
        m = live.meta(self.tp_size, self.layout)
        if int(live.logit_rows.shape[0]) != m.logit_rows:
            raise MetaMismatch(f"{self.runner.name}: a live batch of {pbs} selects {live.logit_rows.shape[0]} logit "
                               f"rows, the rule says {m.logit_rows}")
        return m

    # --- capture and replay --------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every bucket (largest first) through the runner's own eager forward."""
        backend = self.runner.binding.backend
        if backend.supports_graphs:
            backend.init_graph(self.buckets[-1], self.width)

        def prepare(pbs: int) -> RowMeta:
            meta = self.static_batch(None, pbs).row_meta
            assert meta is not None
            return meta

        def body(pbs: int) -> ForwardOutput:
            return self.runner.forward_eager(self._views(pbs), observe=False)

        def check(pbs: int, meta: RowMeta, out: ForwardOutput | None) -> None:
            want = self.live_meta(pbs)
            got = (meta, int(self._views(pbs).logit_rows.shape[0]))
            if got != (want, want.logit_rows):
                raise MetaMismatch(f"{self.runner.name} {self.mode.value} bucket {pbs}: graph records {meta} with "
                                   f"{got[1]} logit rows; a live batch needs {want}")
            if out is not None and (out.logits.shape[0], out.hidden.shape[0]) != (want.logit_rows, want.num_tokens):
                raise MetaMismatch(f"{self.runner.name} bucket {pbs}: the captured forward made "
                                   f"{tuple(out.logits.shape)} logits / {tuple(out.hidden.shape)} hidden; "
                                   f"a live batch needs {want.logit_rows} / {want.num_tokens} rows")

        self.caps = capture_buckets(self.buckets, prepare, body, check, emulate=self.emulate, pool=self.pool,
                                    stats=self.stats)

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
        check_binding(batch, self.runner.binding, f"graph runner of {self.runner.name}")
        pbs = self.bucket(batch.bs)
        assert pbs is not None
        cap = self.caps[pbs]
        out = replay(self.runner, cap, self.static_batch(batch, pbs), self._emu, pbs)
        self.stats.replays[pbs] += 1
        live = row_meta(self.mode, batch.bs, self.width, pruned=self.pruned)
        return ForwardOutput(out.logits[: live.logit_rows], out.hidden[: live.num_tokens], graph_bs=pbs)


def replay(runner: ModelRunner, cap: Capture[RowMeta, ForwardOutput], sb: ForwardBatch,
           emu: dict[int, ForwardOutput], key: int,
           body: Callable[[], ForwardOutput] | None = None) -> ForwardOutput:
    """A captured forward over its static batch `sb`: the runner's backend planned, then the graph
    replayed; emulated (no graph), what was captured run eagerly on the same buffers (`body`, by default
    the runner's eager forward), its output held in bucket `key`'s tensors as a replay's are
    (`held_output`). Both graph runners run through this."""
    if cap.graph is None:
        return held_output(emu, key, body() if body is not None else runner.forward_eager(sb, observe=False))
    runner.binding.backend.plan(sb)
    cap.graph.replay()
    assert cap.out is not None
    return cap.out
