"""Per-request decode state on the device, one row per request slot, updated in place every iteration.

A request's slot (`req_pool_idx`, the row of its request-to-token map) also indexes its row here: the
last emitted token (the next input), its drafts and their probabilities, its KV length, how many
tokens it has emitted, its sampling parameters and seed, the speculative iteration count, and the
penalty state (output-token counts, the prompt's token set, the tokens banned before
`min_new_tokens`). A decode iteration gathers the rows of its batch, computes, and scatters the new
values back: nothing done per step copies a request's history, so a step costs the same at token 10
and at token 10,000. The extra last row is the pad row: graph padding reads it and nothing writes it.
Rows are (re)filled when a request is admitted, in one batched copy; a few numpy mirrors
give the host the per-batch flags (any penalties, any filters, the largest logprobs count) without a
device read. Every write to the state goes through a method of this class: admission, the first token
of a prefill and every iteration's commit, greedy speculation's fused accept and draft steps (the
torch reference here, the Triton kernels of `mleagle.engine.kernels.spec_step` on CUDA, which take the
tensors this class hands them), and the drafts and draft distributions of sampled speculation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from mleagle.engine.core.request import Req
from mleagle.engine.executor.results import pack
from mleagle.engine.kernels import fused_layers_on
from mleagle.engine.sampling.processor import RowFlags, SamplingRows

PLAIN = RowFlags()
ADMIT_ROWS = 14  # an admitted row's field values as `admit(device_copy=False)` returns them: 6 ints, 6 floats, 2 bools


def accepted(drafts: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance: the number of leading drafts [bs, S] equal to the target's argmax of the rows
    before them (pred [bs, W]), per request."""
    return (drafts == pred[:, : drafts.shape[1]]).to(torch.int64).cumprod(1).sum(1)


class SlotState:
    def __init__(self, max_reqs: int, vocab: int, steps: int, device: torch.device, eos_ids: Sequence[int]):
        r = max_reqs + 1
        self.pad_row = max_reqs
        self.vocab, self.steps, self.device = vocab, steps, device
        self.eos_ids = sorted(set(eos_ids))

        def full(v: float | int | bool, dt: torch.dtype) -> torch.Tensor:
            return torch.full((r,), v, dtype=dt, device=device)

        f32, i64 = torch.float32, torch.int64
        # The fields admission fills live as rows of three tensors, one per dtype ([fields, R]: each
        # field a contiguous row view), so admitting requests is one copy per dtype, not per field.
        self._f = torch.tensor([[1.0], [1.0], [0.0], [1.0], [0.0], [0.0]], dtype=f32).repeat(1, r).to(device)
        self._i = torch.tensor([[vocab], [0], [0], [0], [0], [0]], dtype=i64).repeat(1, r).to(device)
        self._b = torch.tensor([[True], [False]]).repeat(1, r).to(device)
        self.temperature, self.top_p, self.min_p, self.rep, self.pres, self.freq = self._f.unbind(0)
        self.top_k, self.seed, self.min_new, self.n_out, self.iters, self.last_tok = self._i.unbind(0)
        # `coupled`: sampled with the request's own seed (see SamplingRows)
        self.greedy, self.coupled = self._b.unbind(0)
        self.kv_len = full(0, i64)
        self.drafts = torch.zeros(r, max(steps, 1), dtype=i64, device=device)
        self.draft_q: torch.Tensor | None = None  # [R, S, V] once a sampled request speculates
        self.counts: torch.Tensor | None = None  # [R, V] int32 output-token counts, once penalties appear
        self.prompt_seen: torch.Tensor | None = None  # [R, V] bool
        self.ban: torch.Tensor | None = None  # [R, V] bool, once min_new_tokens appears
        # Host mirrors: per-batch flags from numpy indexing, never from the device.
        self.h_greedy = np.ones(r, bool)
        self.h_pen = np.zeros(r, bool)
        self.h_filter = np.zeros(r, bool)
        self.h_minp = np.zeros(r, bool)
        self.h_minnew = np.zeros(r, np.int64)
        self.h_lp = np.full(r, -1, np.int64)
        self.h_coupled = np.zeros(r, bool)
        # The last batch's flags by its rows: a decoding batch keeps its rows from step to step, and the
        # mirrors change only at admission (which forgets this), so most steps reuse them.
        self._flags_rows: list[int] | None = None
        self._flags: RowFlags | None = None
        self._ar = torch.arange(max(steps, 1) + 1, device=device)
        self._unforced = full(-1, i64)[0]  # "no forced acceptance" for the greedy accept kernel

    def arange(self, n: int) -> torch.Tensor:
        """0..n-1 on the device for n ≤ S+1 (a verify window's rows), without allocating per step."""
        return self._ar[:n]

    # --- admission ---------------------------------------------------------------------------
    def admit(self, reqs: Sequence[Req], device_copy: bool = True) -> np.ndarray | None:
        """(Re)fill the rows of requests starting (or resuming) prefill, in one copy and one write per dtype.
        With `device_copy` False the fields' values are returned instead, [ADMIT_ROWS, n] int64 (the int
        fields, the float fields' float32 bits, the bools), for a prefill graph to write (`admit_where`);
        the host mirrors, and the rare per-vocabulary state (penalties, bans), are filled here either way."""
        if not reqs:
            return None
        v = self.vocab
        rows = [r.req_pool_idx for r in reqs]
        ps = [r.params for r in reqs]
        self._flags_rows = self._flags = None
        # The rows and every field's values go over in one copy of their bytes, split on the device into
        # views of each dtype (a copy per dtype costs a GPU's host a launch each, and a first token waits
        # for every operation queued before it). Each part's byte length is a multiple of 8 (6 float32 rows
        # of n: 24n bytes), the bools last, so every view starts where its dtype may.
        n = len(reqs)
        ints = [[p.top_k if 0 < p.top_k < v else v for p in ps], [r.seed for r in reqs], [p.min_new_tokens for p in ps],
                [len(r.output_ids) for r in reqs], [0] * n, [r.output_ids[-1] if r.output_ids else 0 for r in reqs]]
        floats = [[p.temperature if not p.greedy else 1.0 for p in ps], [p.top_p for p in ps], [p.min_p for p in ps],
                  [p.repetition_penalty for p in ps], [p.presence_penalty for p in ps], [p.frequency_penalty for p in ps]]
        bools = [[p.greedy for p in ps], [p.seed is not None and not p.greedy for p in ps]]
        host: list[np.ndarray] = [np.asarray(rows, dtype=np.int64), np.asarray(ints, dtype=np.int64),
                                  np.asarray(floats, dtype=np.float32), np.asarray(bools, dtype=np.bool_)]
        vals = None
        if device_copy:
            sizes = [a.nbytes for a in host]
            idx, i64, f32, b = torch.from_numpy(np.concatenate([a.reshape(-1).view(np.uint8) for a in host])).to(
                self.device, non_blocking=True).split_with_sizes(sizes)
            idx = idx.view(torch.int64)
            self._i.index_copy_(1, idx, i64.view(torch.int64).view(6, n))
            self._f.index_copy_(1, idx, f32.view(torch.float32).view(6, n))
            self._b.index_copy_(1, idx, b.view(torch.bool).view(2, n))
        else:  # (a float's bits as a signed int32, so that they survive int64 and back exactly)
            vals = np.concatenate([host[1], host[2].view(np.int32).astype(np.int64), host[3].astype(np.int64)])
        for i, (row, p) in enumerate(zip(rows, ps)):
            self.h_greedy[row] = p.greedy
            self.h_pen[row] = p.has_penalties
            self.h_filter[row] = not p.greedy and ((0 < p.top_k < v) or p.top_p < 1.0)
            self.h_minp[row] = not p.greedy and p.min_p > 0
            self.h_minnew[row] = p.min_new_tokens
            self.h_lp[row] = -1 if p.logprobs is None else p.logprobs
            self.h_coupled[row] = p.seed is not None and not p.greedy
            del i
        pen = [r for r in reqs if r.params.has_penalties]
        if pen:
            if self.counts is None:
                self.counts = torch.zeros(self.pad_row + 1, v, dtype=torch.int32, device=self.device)
                self.prompt_seen = torch.zeros(self.pad_row + 1, v, dtype=torch.bool, device=self.device)
            assert self.prompt_seen is not None
            pidx = torch.tensor([r.req_pool_idx for r in pen], dtype=torch.int64, device=self.device)
            self.counts.index_fill_(0, pidx, 0)
            self.prompt_seen.index_fill_(0, pidx, False)
            for r in pen:  # admission only (not per step): the prompt's and any resumed output's tokens
                row = int(r.req_pool_idx)  # type: ignore[arg-type]
                ids = torch.tensor([t for t in r.prompt_ids if 0 <= t < v], dtype=torch.int64).to(self.device)
                self.prompt_seen[row, ids] = True
                out = torch.tensor([t for t in r.output_ids if 0 <= t < v], dtype=torch.int64).to(self.device)
                if out.numel():
                    self.counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        mn = [r for r in reqs if r.params.min_new_tokens > 0]
        if mn:
            if self.ban is None:
                self.ban = torch.zeros(self.pad_row + 1, v, dtype=torch.bool, device=self.device)
            for r in mn:
                p = r.params
                banned = [t for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids)) if 0 <= t < v]
                row = int(r.req_pool_idx)  # type: ignore[arg-type]
                self.ban[row] = False
                if banned:
                    self.ban[row, torch.tensor(banned, dtype=torch.int64).to(self.device)] = True
        if self.steps and not all(p.greedy for p in ps) and self.draft_q is None:
            self.draft_q = torch.zeros(self.pad_row + 1, self.steps, v, dtype=torch.float32, device=self.device)
        return vals

    def admit_where(self, rpi: torch.Tensor, admit: torch.Tensor, vals: torch.Tensor) -> None:
        """`admit`'s device write inside a prefill graph, over its request slots: the rows `admit` flags
        take `vals` [ADMIT_ROWS, slots] (as `admit(device_copy=False)` returned them); every other slot
        writes its own values back (the padding slots all name the pad row, which so keeps its values)."""
        self._i.index_copy_(1, rpi, torch.where(admit, vals[0:6], self._i[:, rpi]))
        self._f.index_copy_(1, rpi, torch.where(admit, vals[6:12].to(torch.int32).view(torch.float32), self._f[:, rpi]))
        self._b.index_copy_(1, rpi, torch.where(admit, vals[12:14] != 0, self._b[:, rpi]))

    def set_kv_len(self, rows: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """The KV lengths of `rows` (both on the device already: a prefill copies them with its other inputs)."""
        self.kv_len.index_copy_(0, rows, kv_lens)

    # --- per batch -----------------------------------------------------------------------------
    def flags(self, rows: Sequence[int], reqs: Sequence[Req] | None = None) -> RowFlags:
        """Host flags for a batch from the mirrors (bans only while some request is under its minimum)."""
        if rows == self._flags_rows and self._flags is not None:
            flags = self._flags
        else:
            r = np.asarray(rows, dtype=np.int64)
            flags = RowFlags(all_greedy=bool(self.h_greedy[r].all()), penalties=bool(self.h_pen[r].any()),
                             filters=bool(self.h_filter[r].any()), min_p=bool(self.h_minp[r].any()),
                             bans=bool((self.h_minnew[r] > 0).any()), logprobs=int(self.h_lp[r].max()) if len(r) else -1,
                             coupled=bool(self.h_coupled[r].any()))
            self._flags_rows, self._flags = list(rows), flags
        if flags.bans and reqs is not None and \
                not any(len(q.output_ids) < q.params.min_new_tokens + self.steps + 1 for q in reqs):
            flags = dataclasses.replace(flags, bans=False)
        return flags

    def rows(self, rpi: torch.Tensor, width: int, flags: RowFlags, offset: int = 0,
             it_offset: int = 0) -> SamplingRows:
        """Sampling rows for `width` consecutive output positions per request (verify: W; decode: 1):
        row (b, j) decides output index n_out[b] + offset + j."""
        def g(t: torch.Tensor) -> torch.Tensor:
            x = t[rpi]
            return x.repeat_interleave(width) if width > 1 else x

        pos = (self.n_out[rpi].view(-1, 1) + offset + self._ar[:width].view(1, -1)).view(-1)
        return SamplingRows(greedy=g(self.greedy), temperature=g(self.temperature), top_k=g(self.top_k),
                            top_p=g(self.top_p), min_p=g(self.min_p), rep=g(self.rep), pres=g(self.pres),
                            freq=g(self.freq), seed=g(self.seed), pos=pos, it=g(self.iters) + it_offset, flags=flags,
                            coupled=g(self.coupled) if flags.coupled else None)

    def context(self, rpi: torch.Tensor, flags: RowFlags, drafts: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(counts, seen, ban) per row: row j of a request sees its output plus drafts d_1..d_j (verify),
        so penalties stay exact under speculation; bans apply while n_out + j < min_new_tokens."""
        w = 1 if drafts is None else drafts.shape[1] + 1
        counts = seen = ban = None
        if flags.penalties and self.counts is not None and self.prompt_seen is not None:
            c = self.counts[rpi]  # [bs, V]
            if drafts is None:
                counts = c
            else:
                add = torch.zeros(c.shape[0], w, self.vocab, dtype=torch.int32, device=c.device)
                add[:, 1:].scatter_(2, drafts.unsqueeze(-1), 1)
                counts = (c.unsqueeze(1) + add.cumsum(1, dtype=torch.int32)).view(-1, self.vocab)
            ps = self.prompt_seen[rpi]
            seen = (ps.repeat_interleave(w, 0) if w > 1 else ps) | (counts > 0)
        if flags.bans and self.ban is not None:
            active = (self.n_out[rpi].view(-1, 1) + self._ar[:w].view(1, -1)) < self.min_new[rpi].view(-1, 1)
            b = self.ban[rpi]
            ban = ((b.repeat_interleave(w, 0) if w > 1 else b) & active.view(-1, 1))
        return counts, seen, ban

    def commit(self, rpi: torch.Tensor, tokens: torch.Tensor, n_emit: torch.Tensor, flags: RowFlags,
               kv: bool = True, live: torch.Tensor | None = None, iteration: bool = False) -> None:
        """Advance the rows after an iteration: tokens [bs, W] (the first n_emit[b] valid). A decode or
        verify iteration wrote KV for n_emit positions (`kv`); a prefill's first token wrote none; a
        speculative iteration also counts itself (`iteration`: the RNG key's iteration field). With
        `live` (graph padding), rows where it is False keep their values: padded rows all name the pad
        row, which nothing may change."""
        if iteration:
            self.iters[rpi] += 1 if live is None else live.to(torch.int64)
        bs, w = tokens.shape
        last = tokens.gather(1, (n_emit - 1).view(-1, 1)).view(-1)
        if live is None:
            self.last_tok[rpi] = last
            self.n_out[rpi] += n_emit
            if kv:
                self.kv_len[rpi] += n_emit
        else:
            keep = live.to(torch.int64)
            self.last_tok[rpi] = torch.where(live, last, self.last_tok[rpi])
            self.n_out[rpi] += n_emit * keep
            if kv:
                self.kv_len[rpi] += n_emit * keep
        if flags.penalties and self.counts is not None:
            valid = (self._ar[:w].view(1, -1) < n_emit.view(-1, 1)).to(torch.int32)
            self.counts.index_put_((rpi.view(-1, 1).expand(bs, w).reshape(-1), tokens.reshape(-1)),
                                   valid.reshape(-1), accumulate=True)

    def commit_first(self, rpi: torch.Tensor, tok: torch.Tensor, flags: RowFlags) -> None:
        """A prefill's first tokens [bs] for rows that have emitted nothing yet (admission set their count
        to 0): `commit` of one token each without KV (the prefill wrote it), in two operations for the rows'
        last token and count (each operation costs a GPU's host a launch, and a first token waits for
        them) rather than `commit`'s general gather and add."""
        self.last_tok.index_copy_(0, rpi, tok)
        self.n_out.index_fill_(0, rpi, 1)
        if flags.penalties and self.counts is not None:
            self.counts.index_put_((rpi, tok), torch.ones_like(tok, dtype=torch.int32), accumulate=True)

    def commit_where(self, rpi: torch.Tensor, tok: torch.Tensor, seq_lens: torch.Tensor, commit: torch.Tensor,
                     kv_set: torch.Tensor) -> None:
        """A prefill graph's `commit_first` and `set_kv_len` over its request slots [slots]: `tok` committed
        in the slots `commit` names, as a first token where it is 1 (the count set to 1) and as a decoding
        row's next token where it is 2 (a fused mixed step's: the count advanced by one), and the KV
        lengths (`seq_lens`) of the slots `kv_set` flags. Every slot writes, the unflagged ones their own
        values back (the padding slots all name the pad row, which so keeps its values). No penalties:
        the graph commits only plain rows."""
        last = self.last_tok[rpi]
        n = self.n_out[rpi]
        self.last_tok.index_copy_(0, rpi, torch.where(commit != 0, tok, last))
        self.n_out.index_copy_(0, rpi, torch.where(commit == 1, 1, torch.where(commit == 2, n + 1, n)))
        self.kv_len.index_copy_(0, rpi, torch.where(kv_set, seq_lens, self.kv_len[rpi]))

    # --- speculation ---------------------------------------------------------------------------
    def verify_greedy(self, logits: torch.Tensor, w: int, rpi: torch.Tensor, live: torch.Tensor | None,
                      forced: torch.Tensor | None = None, fused: bool | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A plain greedy verify's accept and commit: logits [bs·W, V] of the verify rows → (emitted
        [bs, W]: accepted drafts then the target's argmax, the first n+1 valid; n [bs] accepted drafts;
        the packed result [bs, W+1]; sel [bs]: each request's draft-extend logit row b·W + n). Commits
        the live rows (n+1 tokens and KV positions, one iteration). `forced` (a device scalar ≥ 0, for
        measurement only) overrides the accepted count; `fused` forces a side (the kernel tests)."""
        sim = self._unforced if forced is None else forced
        if fused_layers_on(logits) if fused is None else fused:
            from mleagle.engine.kernels.spec_step import greedy_accept

            # The kernel reads each request's drafts from the table itself: no gather launched for it.
            return greedy_accept(logits, w, rpi, live, sim, self.drafts, self.last_tok, self.n_out, self.kv_len,
                                 self.iters)
        drafts = self.drafts[rpi, : w - 1]  # a shallower iteration verifies the first S' drafts
        s, bs = w - 1, int(rpi.shape[0])
        pred = logits.argmax(-1).view(bs, w)
        n = torch.where(sim >= 0, sim.clamp(max=s), accepted(drafts, pred))
        # Accepted drafts (equal to the target's argmax unless forced), then the target's tokens from row n.
        emitted = torch.where(self._ar[:w].view(1, w) < n.view(-1, 1), torch.cat([drafts, drafts[:, -1:]], 1), pred)
        n_emit = n + 1
        self.commit(rpi, emitted, n_emit, PLAIN, live=live, iteration=True)
        sel = torch.arange(bs, device=logits.device) * w + n
        return emitted, n, pack(emitted, n_emit, None, w), sel

    def draft_greedy(self, logits: torch.Tensor, vocab_ids: torch.Tensor | None, rpi: torch.Tensor, k: int,
                     live: torch.Tensor | None, ids: torch.Tensor, n: torch.Tensor, fused: bool | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """A greedy draft step: draft k+1 of each request from the draft's logits [bs, Vd] (argmax, mapped
        through `vocab_ids` when the draft has a reduced vocabulary), written to the live rows' drafts,
        and the next step's id window: `ids` [bs, W] rotated left by one, the new draft at column n (the
        last accepted row). Returns (drafts [bs], the new window)."""
        if fused_layers_on(logits) if fused is None else fused:
            from mleagle.engine.kernels.spec_step import greedy_draft_step

            return greedy_draft_step(logits, vocab_ids, self.drafts, rpi, k, live, ids, n)
        idx = logits.argmax(-1)
        d = idx if vocab_ids is None else vocab_ids[idx]
        self.set_drafts(rpi, k, d, live)
        return d, rotate(ids, n, d)

    def set_drafts(self, rpi: torch.Tensor, k: int, d: torch.Tensor, live: torch.Tensor | None = None) -> None:
        """Draft k+1 of the rows `rpi` (live rows only under graph padding)."""
        self.drafts[rpi, k] = d if live is None else torch.where(live, d, self.drafts[rpi, k])

    def set_draft_q(self, rpi: torch.Tensor, k: int, q: torch.Tensor) -> None:
        """The distribution draft k+1 was drawn from [bs, V] (rejection sampling reads it at verify)."""
        if self.draft_q is None:
            self.draft_q = torch.zeros(self.pad_row + 1, self.steps, self.vocab, dtype=torch.float32, device=self.device)
        self.draft_q[rpi, k] = q


def rotate(ids: torch.Tensor, n: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The next draft step's id window: every window [bs, W] shifted left by one, draft d [bs] at column n."""
    return torch.cat([ids[:, 1:], ids[:, -1:]], dim=1).scatter(1, n.view(-1, 1), d.view(-1, 1))
