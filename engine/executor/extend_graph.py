"""Prefill under CUDA graphs: one runner's EXTEND forwards captured per token bucket.

Prefill batches are ragged (any number of requests, any tokens each, each after its own cached
prefix), so they cannot be captured by batch size like decode. An `ExtendGraphRunner` captures a
runner's EXTEND forward for token buckets (16, 32, 64, ... up to the configured maximum) with a fixed
number of request slots per bucket (`slots(T)`: the bucket's tokens or the engine's request slots,
whichever is fewer), as SGLang's prefill graphs do. A live batch of t tokens over b requests is copied
into the fixed buffers of the smallest bucket T >= t with b <= slots(T) (the bucket's integer inputs in
one copy from the host values the batch was built with, padding included), or written there straight
from the worker's host lists (`stage`: no batch built, nothing uploaded but that one copy). Each token
row's KV slot is read from the request-to-token map inside the graph; the padding tokens after the live
ones carry position 0 on the pad row, so they write only the pad slot; the padding requests are
zero-length (no query rows, no keys, the pad request row), so they read and write nothing. The target's
graph ends with a tail (`TargetWorker.graph_tail`): the admitted requests' slot-state rows, each
request's greedy first token and, where the staged rows ask, its commit and KV length, so a plain
prompt's first token needs no host operation between the copy in and the copy back. Each request's query offset and length live in device buffers the attention kernel
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
from collections.abc import Callable

import numpy as np
import torch

from mleagle.engine.executor.capture import Capture, GraphStats, MetaMismatch, capture_buckets
from mleagle.engine.executor.forward_batch import (
    ForwardBatch,
    ForwardMode,
    ForwardOutput,
    Layout,
    RowMeta,
    check_binding,
    ragged_rows,
    row_meta,
)
from mleagle.engine.executor.graph_runner import replay
from mleagle.engine.executor.runner import ModelRunner

Tail = Callable[[ForwardBatch, ForwardOutput, torch.Tensor], torch.Tensor]


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
                 layout: Layout = "all_reduce", tail: Tail | None = None, tail_rows: int = 0,
                 ids_from: torch.Tensor | None = None):
        self.runner = runner
        # Token ids read on the device (the target's graphs under fused mixed steps): a staged id below 0
        # is replaced in the graph, before the forward, by `ids_from` at its row's request slot (the
        # token the iteration in flight commits for a decoding row: `SlotState.last_tok`).
        self.ids_from = ids_from
        # The target's tail (`TargetWorker.graph_tail`): run in the graph after the forward, on (the bucket's
        # view, its output, `tail_rows` integer rows per request slot that `stage` filled) -> each slot's
        # greedy token. None for a draft runner.
        self.tail, self.tail_rows = tail, tail_rows if tail is not None else 0
        self.buckets = sorted(set(buckets))
        self.max_reqs = max_reqs
        self.emulate, self.pool = emulate, pool
        self.tp_size, self.layout = tp_size, layout
        r2t = runner.binding.req_to_token
        dev = r2t.req_to_token.device
        self.device = dev
        self.pad_row = r2t.pad_row
        # Each bucket's integer inputs live in one buffer of its own (`ints[t]`, laid out as `_layout`
        # says), so that a replay writes all of them, padding included, from one host array of the
        # bucket's size in one copy (`static_batch`). A draft's input hidden states (copied from the
        # device) share one buffer across buckets.
        self._layouts = {b: self._layout(b) for b in self.buckets}
        self.ints = {b: torch.zeros(sum(n for _, n in lay.values()), dtype=torch.int64, device=dev)
                     for b, lay in self._layouts.items()}
        self._fields = {b: {k: self.ints[b][a : a + n] for k, (a, n) in lay.items()} for b, lay in self._layouts.items()}
        for f in self._fields.values():
            f["rpi"].fill_(self.pad_row)
        self.hidden_in = torch.zeros(self.buckets[-1], hidden_size, dtype=dtype, device=dev) if hidden_size else None
        self.r2t = r2t.req_to_token
        self.loc = torch.zeros(self.buckets[-1], dtype=torch.int64, device=dev)  # written by the graph itself
        self._staged: tuple[ForwardBatch, ForwardBatch] | None = None  # (the live batch, its bucket's view)
        self._views: dict[int, ForwardBatch] = {}
        self.caps: dict[int, Capture[RowMeta, ForwardOutput]] = {}
        self.stats = GraphStats()
        self._emu: dict[int, ForwardOutput] = {}  # emulated replays' outputs, per bucket (see `held_output`)

    # --- shapes -------------------------------------------------------------------------------
    def _layout(self, t: int) -> dict[str, tuple[int, int]]:
        """(offset, length) of each field in bucket t's `ints`: the token rows' (id, position, request
        row: the KV slot is read from the request-to-token map inside the graph), then the request slots'
        (`meta`: per slot the KV length after the forward, the first query row, the rows; zero rows for
        a pad request; `tail`: the tail's rows, zeros unless `stage` fills them)."""
        r = self.slots(t)
        sizes = {"input_ids": t, "positions": t, "row_req": t, "rpi": r, "logit_rows": r, "meta": 3 * r,
                 "tail": self.tail_rows * r}
        out, o = {}, 0
        for k, n in sizes.items():
            out[k] = (o, n)
            o += n
        return out

    def slots(self, tokens: int) -> int:
        """Request slots of the bucket of `tokens` tokens (a request has at least one token)."""
        return min(tokens, self.max_reqs)

    def bucket(self, tokens: int, bs: int) -> int | None:
        return next((b for b in self.buckets if b >= tokens and self.slots(b) >= bs), None)

    def fields(self, t: int) -> dict[str, torch.Tensor]:
        """Bucket t's input buffers by name (views of `ints[t]`; `meta` is [3, slots])."""
        f = self._fields[t]
        return {**f, "meta": f["meta"].view(3, self.slots(t))}

    def view(self, t: int) -> ForwardBatch:
        """Bucket t's batch view over its fixed buffers (one object per bucket, so a graph captured on
        it reads the same addresses at every replay), with the bucket's row metadata."""
        v = self._views.get(t)
        if v is None:
            f = self.fields(t)
            meta = f["meta"]
            v = ForwardBatch(
                mode=ForwardMode.EXTEND, input_ids=f["input_ids"], positions=f["positions"],
                out_cache_loc=self.loc[:t], req_pool_indices=f["rpi"], seq_lens=meta[0],
                extend_lens=[0] * self.slots(t), prefix_lens=[0] * self.slots(t), logit_rows=f["logit_rows"],
                binding=self.runner.binding, hidden_in=self.hidden_in[:t] if self.hidden_in is not None else None,
                max_seq_len=0, graph_bs=t, extend_start=meta[1], extend_lens_t=meta[2], max_extend=t)
            v = self._views[t] = dataclasses.replace(v, row_meta=self.rule(t))
        return v

    def rule(self, t: int) -> RowMeta:
        """The rule's row counts of bucket t: t token rows, one logit row per request slot."""
        return row_meta(ForwardMode.EXTEND, self.slots(t), num_tokens=t, tp_size=self.tp_size, layout=self.layout)

    def static_batch(self, batch: ForwardBatch | None, t: int) -> ForwardBatch:
        """Copy a live batch (None at capture: all padding) into the buffers, padded to bucket t.

        The bucket's integer buffer is written whole from one host array in one non-blocking copy: the batch's
        host values where `build_batch` left them (`ForwardBatch.host`), padding everywhere else (token
        rows on position 0 and the pad row, so their KV slot is the pad slot; request slots on the pad row
        with no rows). Only what the host does not hold follows as a device copy each: a field replaced
        since the batch was built (a draft's input ids), and a draft's hidden states. The KV slots are
        not copied at all: the graph reads them from the request-to-token map. On a GPU each small copy
        or fill costs the host a launch; this was one per field and padding range before. A batch built
        by `stage` is in the buffers already."""
        if batch is not None and self._staged is not None and self._staged[0] is batch:
            return self._staged[1]
        base = self.view(t)
        r = self.slots(t)
        n, bs = (batch.num_tokens, batch.bs) if batch is not None else (0, 0)
        if batch is not None and self.hidden_in is not None and batch.hidden_in is None:
            raise ValueError("a draft prefill batch without input hidden states")
        rows = batch.host.fields.get("row_req") if batch is not None and batch.host is not None else None
        if batch is not None and rows is None:  # (each token's request row: the graph's KV-slot lookup)
            raise ValueError("a prefill batch without its host rows: build it with build_batch, or stage it")
        out, v, meta = self._host_buffer(t)
        f = self._fields[t]
        later: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, device tensor) copied after the packed copy
        if batch is not None:
            h = batch.host
            # (the host value's name, the batch's tensor, the buffer it goes to, its rows)
            for k, dev, name, m in (("input_ids", batch.input_ids, "input_ids", n),
                                    ("positions", batch.positions, "positions", n),
                                    ("req_pool_indices", batch.req_pool_indices, "rpi", bs),
                                    ("logit_rows", batch.logit_rows, "logit_rows", bs)):
                got = h.get(k, dev) if h is not None else None
                if got is None:
                    later.append((f[name][:m], dev))
                else:
                    v[name][:m] = got
            ext = np.asarray(batch.extend_lens, dtype=np.int64)
            assert rows is not None
            v["row_req"][:n] = rows[0]
            meta[0, :bs] = np.asarray(batch.prefix_lens, dtype=np.int64) + ext
            meta[1, :bs] = np.cumsum(ext) - ext
            meta[2, :bs] = ext
        self._pad(v, meta, n, bs)
        self.ints[t].copy_(torch.from_numpy(out), non_blocking=True)
        for dst, src in later:
            dst.copy_(src)
        if batch is None:
            return base
        if self.hidden_in is not None:
            assert batch.hidden_in is not None  # (checked above, before anything was written)
            self.hidden_in[:n].copy_(batch.hidden_in)
        pad = [0] * (r - bs)
        return dataclasses.replace(base, extend_lens=list(batch.extend_lens) + pad,
                                   prefix_lens=list(batch.prefix_lens) + pad, rids=batch.rids,
                                   max_seq_len=batch.max_seq_len)

    def _host_buffer(self, t: int) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
        """A zeroed host image of bucket t's integer buffer, its fields' views, and `meta` as [3, slots]."""
        out = np.zeros(self.ints[t].shape[0], dtype=np.int64)
        v = {k: out[a : a + m] for k, (a, m) in self._layouts[t].items()}
        return out, v, v["meta"].reshape(3, self.slots(t))

    def _pad(self, v: dict[str, np.ndarray], meta: np.ndarray, n: int, bs: int) -> None:
        """Padding in a host image past n live tokens and bs live requests (the rest is zeros)."""
        v["row_req"][n:] = self.pad_row  # the pad row's position 0: the pad slot
        v["rpi"][bs:] = self.pad_row
        meta[1, bs:] = n  # padding requests start after the live rows, with none

    def stage_bucket(self, tokens: int, bs: int) -> int | None:
        """The captured bucket `stage` would put a batch of `tokens` tokens over `bs` requests in, or None."""
        t = self.bucket(tokens, bs)
        return t if tokens > 0 and t is not None and t in self.caps else None

    def stage(self, ids: list[int], rpi: list[int], prefix_lens: list[int], extend_lens: list[int],
              tail: np.ndarray | None = None, rids: tuple[str, ...] = ()) -> ForwardBatch | None:
        """A prefill batch written straight into its bucket's buffers from host lists (one copy, no
        `build_batch`: no uploads of its own, no KV-slot gather), or None where no captured bucket holds
        it. The returned batch is live-sized views of those buffers (its KV slots valid once it has run),
        and `run` replays it without copying anything. `tail` [tail_rows, requests] goes into the tail's
        rows (zeros where None: a tail that does nothing). Meant for an immediate `forward`: the next
        staging or static batch of the bucket overwrites the buffers."""
        n, bs = len(ids), len(rpi)
        t = self.stage_bucket(n, bs)
        if t is None:
            return None
        out, v, meta = self._host_buffer(t)
        pos, row_req, rpi_a, starts, last, seq = ragged_rows(prefix_lens, extend_lens, rpi)
        v["input_ids"][:n] = ids
        v["positions"][:n] = pos
        v["row_req"][:n] = row_req
        v["rpi"][:bs] = rpi_a
        v["logit_rows"][:bs] = last
        meta[0, :bs] = seq
        meta[1, :bs] = starts
        meta[2, :bs] = extend_lens
        if tail is not None:
            v["tail"].reshape(self.tail_rows, self.slots(t))[:, :bs] = tail
        self._pad(v, meta, n, bs)
        self.ints[t].copy_(torch.from_numpy(out), non_blocking=True)
        base, f = self.view(t), self.fields(t)
        pad = [0] * (self.slots(t) - bs)
        seq_max = int(seq.max())
        sb = dataclasses.replace(base, extend_lens=list(extend_lens) + pad, prefix_lens=list(prefix_lens) + pad,
                                 rids=rids, max_seq_len=seq_max)
        live = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=f["input_ids"][:n], positions=f["positions"][:n],
                            out_cache_loc=self.loc[:n], req_pool_indices=f["rpi"][:bs], seq_lens=f["meta"][0, :bs],
                            extend_lens=list(extend_lens), prefix_lens=list(prefix_lens),
                            logit_rows=f["logit_rows"][:bs], binding=self.runner.binding, rids=rids,
                            max_seq_len=seq_max)
        self._staged = (live, sb)
        return live

    # --- capture and replay --------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every bucket (largest first) through the runner's own eager forward."""

        def prepare(t: int) -> RowMeta:
            meta = self.static_batch(None, t).row_meta
            assert meta is not None
            return meta

        def body(t: int) -> ForwardOutput:
            return self._body(t, self.view(t))

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

    def _body(self, t: int, sb: ForwardBatch) -> ForwardOutput:
        """What bucket t's graph runs over its buffers (`sb`: the bucket's view; emulated, the live batch's
        padded view, whose host lengths a CPU backend reads): each token row's KV slot from the runner's
        own request-to-token map, the forward, then the tail where there is one."""
        f = self._fields[t]
        torch.index_select(self.r2t.view(-1), 0, f["row_req"] * self.r2t.shape[1] + f["positions"], out=self.loc[:t])
        if self.ids_from is not None:
            ids = f["input_ids"]
            ids.copy_(torch.where(ids < 0, self.ids_from.index_select(0, f["row_req"]), ids))
        out = self.runner.forward_eager(sb, observe=False)
        if self.tail is not None:
            out.tokens = self.tail(sb, out, f["tail"].view(self.tail_rows, self.slots(t)))
        return out

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
        sb = self.static_batch(batch, t)
        self._staged = None
        out = replay(self.runner, cap, sb, self._emu, t, body=lambda: self._body(t, sb))
        self.stats.replays[t] += 1
        return ForwardOutput(out.logits[: batch.bs], out.hidden[: batch.num_tokens], graph_bs=t,
                             tokens=out.tokens[: batch.bs] if out.tokens is not None else None)
