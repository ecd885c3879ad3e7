"""The draft layers' fill as one CUDA graph per token bucket: every layer's EXTEND and the first drafts.

A draft fill (a new request's draft prefill, or a catch-up over positions decoded without drafts) runs
each of the S draft layers over the same rows, layer k reading the token k+1 positions on, and ends
with each request's first S drafts. Run as S separate prefill-graph replays it cost the host, per
fill, S sets of buffer copies, a host-built batch with its own uploads, and the id windows and draft
tokens of each layer as a dozen eager kernels: on the H200 a served fill took 5-6.5 ms of host time,
while the GPU work is a fraction of a millisecond (results/gpu/first_token_sync). A `FillGraph`
captures the whole fill for one token bucket: the host packs the fill's index arrays into one array,
one non-blocking copy takes it to the device, and one replay runs every layer.

What the captured body does, all from that array and the device state: each row's KV slot from the
request-to-token map (`r2t[row_rpi, position]`; padding rows use the pad row, so they write the pad
slot); the input hidden states (gathered from the worker's hidden-state pool at those slots, or copied
by the caller into a static buffer: a prefill's stashed target states); each request's bonus token
from the slot state (`last_tok`, which is the token after the last position whether the request just
prefilled or is catching up); per layer the id window (`seq`, each request's tokens with its bonus at
the end, then the drafts of the layers before), the layer's EXTEND forward on views shaped like an
`ExtendGraphRunner`'s (per-request query offsets and lengths in device buffers), and the greedy draft
written to the slot state. Padding requests are zero-length on the pad row. Only greedy, unconstrained
fills take it (a grammar's matchers or a sampled draft need the host between layers); everything else,
and a fill larger than the largest bucket, keeps the per-layer path. Emulated on the CPU, replays run
the body eagerly on the same buffers, so the CPU tests check the packing against the per-layer path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from mleagle.engine.executor.capture import Capture, GraphStats, MetaMismatch, capture_buckets
from mleagle.engine.executor.extend_graph import ExtendGraphRunner
from mleagle.engine.executor.forward_batch import ForwardBatch, ForwardMode, RowMeta, row_meta
from mleagle.engine.executor.runner import ModelRunner
from mleagle.engine.executor.slot_state import SlotState

# The packed index array's fields after `seq` (the token windows: each request's tokens and its bonus,
# T+R entries, plus S+2 of room for the reads of the last window's rows and the padding's spare bonus
# entry), in order: one entry per token row, then one per request slot.
_PER_TOKEN = (
    "row_base",  # index in seq of the row's own token t_p
    "room",  # steps from t_p to the request's bonus (t_{p+room} is the bonus)
    "row_req",  # the row's request slot (for the drafts of earlier layers)
    "row_rpi",  # the row's request-to-token row (the pad row for padding)
    "positions",
)
_PER_SLOT = (
    "bonus_at",  # index in seq of each request's bonus (the spare entry for padding)
    "rpi",
    "seq_lens",  # KV length after the fill
    "q_start",  # first query row
    "q_lens",  # query rows (0 for padding)
    "logit_rows",  # each request's last row (row 0 for padding)
)


class FillGraph:
    """The draft fill of `drafts` (S layers) captured per token bucket of `like` (the first draft
    runner's prefill graphs: the same buckets and request slots)."""

    def __init__(self, drafts: Sequence[ModelRunner], heads: Sequence[torch.Tensor | None], like: ExtendGraphRunner,
                 state: SlotState, r2t: torch.Tensor, *, chain: bool, hpool: torch.Tensor | None,
                 hidden_size: int, dtype: torch.dtype, emulate: bool, pool: object | None):
        self.drafts, self.heads = list(drafts), list(heads)
        self.buckets, self.slots = like.buckets, like.slots
        self.bucket = like.bucket
        self.tp_size, self.layout = like.tp_size, like.layout
        self.state, self.r2t, self.chain, self.hpool = state, r2t, chain, hpool
        self.steps = len(self.drafts)
        self.pad_row = like.pad_row
        self.emulate, self.pool = emulate, pool
        self.t_max = self.buckets[-1]
        self.r_max = self.slots(self.t_max)
        dev = r2t.device
        self.device = dev
        sizes = {"seq": self.t_max + self.r_max + self.steps + 2, **dict.fromkeys(_PER_TOKEN, self.t_max),
                 **dict.fromkeys(_PER_SLOT, self.r_max)}
        self._offs: dict[str, tuple[int, int]] = {}
        o = 0
        for name, n in sizes.items():
            self._offs[name] = (o, n)
            o += n
        self.packed = torch.zeros(o, dtype=torch.int64, device=dev)
        self.f = {k: self.packed[a : a + n] for k, (a, n) in self._offs.items()}
        # A prefill's stashed hidden states are copied here; a catch-up gathers them from `hpool` instead.
        self.hidden = torch.zeros(self.t_max, hidden_size, dtype=dtype, device=dev) if hpool is None else None
        self.caps: dict[int, Capture[RowMeta, torch.Tensor]] = {}
        self.stats = GraphStats()
        self._views: dict[int, list[ForwardBatch]] = {}

    # --- capture ------------------------------------------------------------------------------
    def rule(self, t: int) -> RowMeta:
        return row_meta(ForwardMode.EXTEND, self.slots(t), num_tokens=t, tp_size=self.tp_size, layout=self.layout)

    def _view(self, t: int, k: int, ids: torch.Tensor, loc: torch.Tensor, h: torch.Tensor,
              host: tuple[list[int], list[int]] | None) -> ForwardBatch:
        r, f = self.slots(t), self.f
        prefix, extend = host if host is not None else ([0] * r, [0] * r)
        return ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=ids, positions=f["positions"][:t], out_cache_loc=loc,
            req_pool_indices=f["rpi"][:r], seq_lens=f["seq_lens"][:r], extend_lens=extend, prefix_lens=prefix,
            logit_rows=f["logit_rows"][:r], binding=self.drafts[k].binding, hidden_in=h, max_seq_len=0, graph_bs=t,
            extend_start=f["q_start"][:r], extend_lens_t=f["q_lens"][:r], max_extend=t, row_meta=self.rule(t))

    def body(self, t: int, host: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
        """The fill over bucket t's buffers: every layer, then the drafts into the slot state; returns
        the drafts [slots, S+1] (column 0 unused). `host`: the requests' prefix and query lengths, padded
        to the bucket's slots, for an emulated replay (a CPU backend reads them; a graph's kernels read
        the device buffers)."""
        r, f, s = self.slots(t), self.f, self.steps
        pos, rpi = f["positions"][:t], f["rpi"][:r]
        loc = self.r2t[f["row_rpi"][:t], pos]
        h0 = self.hpool[loc] if self.hpool is not None else self.hidden[:t]  # type: ignore[index]
        seq = f["seq"].clone()
        seq[f["bonus_at"][:r]] = self.state.last_tok[rpi]
        base, room, req = f["row_base"][:t], f["room"][:t], f["row_req"][:t]
        tail = torch.zeros(r, s + 1, dtype=torch.int64, device=self.device)
        h = h0
        views = []
        for k, runner in enumerate(self.drafts):
            over = (k + 1) - room  # > 0: past the bonus, a draft of an earlier layer
            ids = torch.where(over <= 0, seq[base + (k + 1)], tail[req, over.clamp(0, s)])
            v = self._view(t, k, ids, loc, h, host)
            views.append(v)
            o = runner.forward_eager(v, observe=False)
            idx = o.logits.argmax(-1)
            vocab = self.heads[k]
            d = idx if vocab is None else vocab[idx]
            tail[:, k + 1] = d
            self.state.set_drafts(rpi, k, d)
            h = o.hidden if self.chain else h0
        self._views[t] = views
        return tail

    def capture(self) -> None:
        def prepare(t: int) -> RowMeta:
            self._fill_padding(t)
            return self.rule(t)

        def check(t: int, meta: RowMeta, out: torch.Tensor | None) -> None:
            want = row_meta(ForwardMode.EXTEND, self.slots(t), num_tokens=t, tp_size=self.tp_size, layout=self.layout)
            if meta != want:
                raise MetaMismatch(f"draft fill bucket {t}: graph records {meta}; the rule says {want}")
            if out is not None and tuple(out.shape) != (self.slots(t), self.steps + 1):
                raise MetaMismatch(f"draft fill bucket {t}: the captured body made drafts {tuple(out.shape)}")

        self.caps = capture_buckets(self.buckets, prepare, self.body, check, emulate=self.emulate, pool=self.pool,
                                    stats=self.stats)

    def _fill_padding(self, t: int) -> None:
        """Bucket t's fields all padding (capture): no live request, every row on the pad row."""
        self.packed.copy_(torch.from_numpy(self._pack(t, [], [], [], [])))

    # --- replay -------------------------------------------------------------------------------
    def fits(self, lens: Sequence[int]) -> int | None:
        """The bucket a fill of these per-request lengths replays at, or None."""
        t = self.bucket(sum(lens), len(lens))
        return t if t is not None and t in self.caps else None

    def _pack(self, t: int, rpis: Sequence[int], starts: Sequence[int], lens: Sequence[int],
              windows: Sequence[Sequence[int]]) -> np.ndarray:
        """The packed array for bucket t: request i fills positions starts[i]..+lens[i] and its window is
        windows[i] (its tokens there; the bonus entry after them is filled on the device)."""
        r, s = self.slots(t), self.steps
        out = np.zeros(self.packed.shape[0], dtype=np.int64)
        v = {k: out[a : a + n] for k, (a, n) in self._offs.items()}
        bs = len(lens)
        ln = np.asarray(lens, dtype=np.int64)
        n = int(ln.sum())
        offs = np.concatenate([[0], np.cumsum(ln + 1)[:-1]]).astype(np.int64) if bs else np.zeros(0, np.int64)
        if bs:
            v["seq"][: n + bs] = np.fromiter((x for w in windows for x in (*w, 0)), dtype=np.int64, count=n + bs)
            row_req = np.repeat(np.arange(bs, dtype=np.int64), ln)
            first = np.concatenate([[0], np.cumsum(ln)[:-1]]).astype(np.int64)
            rel = np.arange(n, dtype=np.int64) - first[row_req]
            v["row_base"][:n] = offs[row_req] + rel
            v["room"][:n] = ln[row_req] - rel
            v["row_req"][:n] = row_req
            v["row_rpi"][:n] = np.asarray(rpis, dtype=np.int64)[row_req]
            v["positions"][:n] = np.asarray(starts, dtype=np.int64)[row_req] + rel
            v["bonus_at"][:bs] = offs + ln
            v["rpi"][:bs] = rpis
            v["seq_lens"][:bs] = np.asarray(starts, dtype=np.int64) + ln
            v["q_start"][:bs] = first
            v["q_lens"][:bs] = ln
            v["logit_rows"][:bs] = first + ln - 1
        # Padding rows: the pad row at position 0 (its slot is the pad slot), a window read that stays in
        # the buffer (`room` past every layer); padding requests: zero rows at the end, the spare bonus entry.
        v["room"][n:t] = s + 1
        v["row_rpi"][n:t] = self.pad_row
        v["bonus_at"][bs:r] = v["seq"].shape[0] - 1
        v["rpi"][bs:r] = self.pad_row
        v["q_start"][bs:r] = n
        return out

    def run(self, rpis: Sequence[int], starts: Sequence[int], lens: Sequence[int],
            windows: Sequence[Sequence[int]], hidden: torch.Tensor | None = None,
            plan: Callable[[ModelRunner, ForwardBatch], None] | None = None) -> int:
        """Replay the fill of these requests (request-to-token rows, first positions, lengths, token
        windows); `hidden` (the rows' target hidden states) where the graph does not gather them from the
        pool. Returns the bucket it ran at."""
        t = self.fits(lens)
        assert t is not None
        host = torch.from_numpy(self._pack(t, rpis, starts, lens, windows))
        if self.device.type == "cuda":
            host = host.pin_memory()  # from the caching host allocator: not reused before this copy ran
        self.packed.copy_(host, non_blocking=True)
        if self.hidden is not None:
            assert hidden is not None
            n = int(sum(lens))
            self.hidden[:n].copy_(hidden)
        cap = self.caps[t]
        if cap.graph is None:  # emulated: the body on the same buffers
            pad = [0] * (self.slots(t) - len(lens))
            self.body(t, ([*starts, *pad], [*lens, *pad]))
        else:
            for k, runner in enumerate(self.drafts):
                runner.binding.backend.plan(self._views[t][k])
            cap.graph.replay()
        self.stats.replays[t] += 1
        return t
