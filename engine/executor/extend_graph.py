"""Prefill under CUDA graphs: one runner's EXTEND forwards captured per token bucket.

Prefill batches are ragged (any number of requests, any tokens each, each after its own cached
prefix), so they cannot be captured by batch size like decode. An `ExtendGraphRunner` captures a
runner's EXTEND forward for token buckets (16, 32, 64, ... up to the configured maximum) with a fixed
number of request slots per bucket (`slots(T)`: the bucket's tokens or the engine's request slots,
whichever is fewer), as SGLang's prefill graphs do. A live batch of t tokens over b requests is copied
into the fixed buffers of the smallest bucket T >= t with b <= slots(T): the padding tokens after the
live ones carry position 0 and slot 0 (the reserved pad slot), so they write only the pad slot; the
padding requests are zero-length (no query rows, no keys, the pad request row), so they read and
write nothing. Each request's query offset and length live in device buffers the attention kernel
reads (`ForwardBatch.extend_start` / `extend_lens_t`), and its grid is sized by the bucket, so one
capture holds for any split of the bucket's tokens among its slots. Logit rows are each request's last
token (pad requests point at row 0) and are cut back to the live requests after the replay.

Where a batch does not fit (more tokens than the largest bucket, more requests than the bucket's
slots, prompt logprobs, which want every row's logits) it runs eagerly and the runner counts why, as
decode does. A replay is refused for a batch bound to another runner (`check_binding`), and capture
runs through the runner's own eager forward on the buffers, so its binding and plan checks hold at
capture too. Emulated on the CPU (`emulate`), the same buffers, padding and metadata run with an
eager forward: the CPU tests exercise everything but the graph itself.
"""

from __future__ import annotations

import dataclasses

import torch

from mleagle.engine.executor.capture import Capture, GraphStats, MetaMismatch, capture_buckets
from mleagle.engine.executor.forward_batch import (
    ForwardBatch,
    ForwardMode,
    ForwardOutput,
    Layout,
    RowMeta,
    check_binding,
    row_meta,
)
from mleagle.engine.executor.graph_runner import replay
from mleagle.engine.executor.runner import ModelRunner


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """Powers of two from `smallest` up to `max_tokens` (and `max_tokens` itself): padding a batch to
    its bucket never more than doubles its tokens past the smallest bucket."""
    if max_tokens <= 0:
        return []
    b, out = smallest, []
    while b < max_tokens:
        out.append(b)
        b *= 2
    return [*out, max_tokens]


class ExtendGraphRunner:
    """One runner's EXTEND graphs: `fits(batch)` says why a batch cannot replay (None: it can), `run`
    replays; `buckets` are token counts, `slots(T)` the request slots of bucket T."""

    mode = ForwardMode.EXTEND
    width = 1

    def __init__(self, runner: ModelRunner, *, buckets: list[int], max_reqs: int, hidden_size: int,
                 dtype: torch.dtype, emulate: bool = False, pool: object | None = None, tp_size: int = 1,
                 layout: Layout = "all_reduce"):
        self.runner = runner
        self.buckets = sorted(set(buckets))
        self.max_reqs = max_reqs
        self.emulate, self.pool = emulate, pool
        self.tp_size, self.layout = tp_size, layout
        r2t = runner.binding.req_to_token
        dev = r2t.req_to_token.device
        self.device = dev
        self.pad_row = r2t.pad_row
        t, r = self.buckets[-1], self.slots(self.buckets[-1])
        i64 = torch.int64
        self.buf = {
            "input_ids": torch.zeros(t, dtype=i64, device=dev),
            "positions": torch.zeros(t, dtype=i64, device=dev),
            "out_cache_loc": torch.zeros(t, dtype=i64, device=dev),
        }
        if hidden_size:
            self.buf["hidden_in"] = torch.zeros(t, hidden_size, dtype=dtype, device=dev)
        self.rpi = torch.full((r,), self.pad_row, dtype=i64, device=dev)
        self.logit_rows = torch.zeros(r, dtype=i64, device=dev)
        # Per request slot: KV length after the forward, first query row, rows (zero for a pad request).
        self.meta = torch.zeros(3, r, dtype=i64, device=dev)
        self._hi = t  # token rows that may hold live data (all of them before the first fill)
        self._views: dict[int, ForwardBatch] = {}
        self.caps: dict[int, Capture[RowMeta, ForwardOutput]] = {}
        self.stats = GraphStats()
        self._emu: dict[int, ForwardOutput] = {}  # emulated replays' outputs, per bucket (see `held_output`)

    # --- shapes -------------------------------------------------------------------------------
    def slots(self, tokens: int) -> int:
        """Request slots of the bucket of `tokens` tokens (a request has at least one token)."""
        return min(tokens, self.max_reqs)

    def bucket(self, tokens: int, bs: int) -> int | None:
        return next((b for b in self.buckets if b >= tokens and self.slots(b) >= bs), None)

    def view(self, t: int) -> ForwardBatch:
        """Bucket t's batch view over the fixed buffers (one object per bucket, so a graph captured on
        it reads the same addresses at every replay), with the bucket's row metadata."""
        v = self._views.get(t)
        if v is None:
            r = self.slots(t)
            v = ForwardBatch(
                mode=ForwardMode.EXTEND, input_ids=self.buf["input_ids"][:t], positions=self.buf["positions"][:t],
                out_cache_loc=self.buf["out_cache_loc"][:t], req_pool_indices=self.rpi[:r],
                seq_lens=self.meta[0, :r], extend_lens=[0] * r, prefix_lens=[0] * r, logit_rows=self.logit_rows[:r],
                binding=self.runner.binding, hidden_in=self.buf["hidden_in"][:t] if "hidden_in" in self.buf else None,
                max_seq_len=0, graph_bs=t, extend_start=self.meta[1, :r], extend_lens_t=self.meta[2, :r],
                max_extend=t)
            v = self._views[t] = dataclasses.replace(v, row_meta=self.rule(t))
        return v

    def rule(self, t: int) -> RowMeta:
        """The rule's row counts of bucket t: t token rows, one logit row per request slot."""
        return row_meta(ForwardMode.EXTEND, self.slots(t), num_tokens=t, tp_size=self.tp_size, layout=self.layout)

    def static_batch(self, batch: ForwardBatch | None, t: int) -> ForwardBatch:
        """Copy a live batch (None at capture: all padding) into the buffers, padded to bucket t."""
        base = self.view(t)
        r = self.slots(t)
        n, bs = (batch.num_tokens, batch.bs) if batch is not None else (0, 0)
        if batch is not None:
            if "hidden_in" in self.buf:
                if batch.hidden_in is None:
                    raise ValueError("a draft prefill batch without input hidden states")
                self.buf["hidden_in"][:n].copy_(batch.hidden_in)
            for k in ("input_ids", "positions", "out_cache_loc"):
                self.buf[k][:n].copy_(getattr(batch, k))
            self.rpi[:bs].copy_(batch.req_pool_indices)
            self.logit_rows[:bs].copy_(batch.logit_rows)
        # Padding: tokens n.._hi (what an earlier, larger batch left live) back to position 0 / slot 0.
        if self._hi > n:
            for k in ("input_ids", "positions", "out_cache_loc"):
                self.buf[k][n : self._hi].zero_()
        self._hi = n
        self.rpi[bs:r].fill_(self.pad_row)
        self.logit_rows[bs:r].zero_()
        # A fresh host tensor each time (a pageable copy): a reused pinned one could be rewritten before
        # an earlier replay's copy of it ran.
        seq, start, lens = [0] * r, [n] * r, [0] * r
        if batch is not None:
            s = 0
            for i, (p, e) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
                seq[i], start[i], lens[i] = p + e, s, e
                s += e
        self.meta[:, :r].copy_(torch.tensor([seq, start, lens], dtype=torch.int64), non_blocking=True)
        if batch is None:
            return base
        pad = [0] * (r - bs)
        return dataclasses.replace(base, extend_lens=list(batch.extend_lens) + pad,
                                   prefix_lens=list(batch.prefix_lens) + pad, rids=batch.rids,
                                   max_seq_len=batch.max_seq_len)

    # --- capture and replay --------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every bucket (largest first) through the runner's own eager forward."""

        def prepare(t: int) -> RowMeta:
            meta = self.static_batch(None, t).row_meta
            assert meta is not None
            return meta

        def body(t: int) -> ForwardOutput:
            return self.runner.forward_eager(self.view(t), observe=False)

        def check(t: int, meta: RowMeta, out: ForwardOutput | None) -> None:
            want = row_meta(ForwardMode.EXTEND, self.slots(t), num_tokens=t, tp_size=self.runner.tp_size,
                            layout=self.runner.layout)
            if meta != want:
                raise MetaMismatch(f"{self.runner.name} EXTEND bucket {t}: graph records {meta}; the rule says {want}")
            if out is not None and (out.logits.shape[0], out.hidden.shape[0]) != (want.logit_rows, t):
                raise MetaMismatch(f"{self.runner.name} EXTEND bucket {t}: the captured forward made "
                                   f"{tuple(out.logits.shape)} logits / {tuple(out.hidden.shape)} hidden")

        self.caps = capture_buckets(self.buckets, prepare, body, check, emulate=self.emulate, pool=self.pool,
                                    stats=self.stats)

    def fits(self, batch: ForwardBatch) -> str | None:
        """None when the batch can replay; else the reason it runs eagerly."""
        if batch.mode is not ForwardMode.EXTEND:
            return f"mode {batch.mode.value}"
        if batch.all_logit_rows:
            return "prompt logprobs"
        if batch.num_tokens == 0:
            return "empty"
        if batch.num_tokens > self.buckets[-1]:
            return "tokens>max_bucket"
        t = self.bucket(batch.num_tokens, batch.bs)
        if t is None:
            return "reqs>slots"
        if t not in self.caps:
            return "not captured"
        return None

    def run(self, batch: ForwardBatch) -> ForwardOutput:
        """Replay (or, emulated, run eagerly on the buffers) a batch that `fits`."""
        check_binding(batch, self.runner.binding, f"prefill graph runner of {self.runner.name}")
        t = self.bucket(batch.num_tokens, batch.bs)
        assert t is not None
        cap = self.caps[t]
        out = replay(self.runner, cap, self.static_batch(batch, t), self._emu, t)
        self.stats.replays[t] += 1
        return ForwardOutput(out.logits[: batch.bs], out.hidden[: batch.num_tokens], graph_bs=t)
