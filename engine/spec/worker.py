"""The speculative worker: verify → accept → draft-extend, with one runner per draft step, on the device.

Each draft runner k owns layer k's weights, its own KV pool, request-to-token map and attention
backend (see `ModelRunner`); the worker composes them. One iteration for a batch of bs requests,
W = S+1 rows each, with no read back to the host until its single result copy:

1. verify: TARGET_VERIFY over [bonus, d1..dS] at positions kv_len..kv_len+S (bs·W logit rows). The
   bonus and the drafts come from the slot state (`SlotState.last_tok`, `.drafts`); positions, slots
   and lengths are computed once on the device and shared by every step of the iteration.
2. accept: greedy `cumprod(drafts == argmax)` over the target's penalised rows (row j's penalties see
   the output plus d1..dj, so penalties stay exact), or Leviathan/Chen rejection sampling with the
   draft's stored distributions, branch-free over the batch, then a residual (or bonus) draw; random
   draws are keyed by (seed, output position, stream, iteration), so a seeded request is
   batch-invariant. Logprobs of emitted tokens come from these target logits. A plain greedy batch
   (no penalties, bans or logprobs: the common case) takes `greedy.accept`, one kernel after the
   argmax on CUDA, and greedy draft steps `greedy.draft_step`.
3. draft-extend: for k = 0..S-1 one DRAFT_EXTEND over the same W rows per request, derived from one
   immutable view with `dataclasses.replace` (only input ids, input hidden and binding change),
   logits pruned to each request's last accepted row (a device index); the id window rotates left by
   one and the new draft lands at that row before the next step. The new drafts (and, for sampled
   requests, their distributions) are written into the slot state for the next verify.

Prefill runs the target (possibly in chunks, stashing its hidden states), and when a request's
prefill completes, each draft runner k runs over the positions this prefill computed, filling its own
pool: the whole sequence, or after a prefix-cache hit only the positions past the cached prefix, whose
KV every draft pool already holds (as its owner left it; see README, "Prefix caching"). A hit leaves
the last S cached positions to recompute (`prefix_margin`): there the owner's draft KV read tokens
past the prefix. The draft layers' last outputs are the first drafts.

Boundary-KV policy: **accept the staleness** (as SGLang does for MiMo-style stacks). After an
iteration accepting n drafts, layer k's KV at the last k committed positions was computed from
tokens that were drafts at the time; where the next verify rejects those drafts that KV stays
stale. It can lower acceptance, never change output (the target verifies every token).
`boundary_kv_stale_positions` counts such positions so the cost is observable. The `recompute`
reference policy re-runs every draft layer over the whole committed sequence each iteration (it
reads the accepted counts back first: a measuring tool, not a serving mode).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from mleagle.engine.contract.outputs import SpecStats
from mleagle.engine.core.request import Req
from mleagle.engine.executor.forward_batch import ForwardBatch, ForwardMode, RowMeta, build_batch
from mleagle.engine.executor.runner import ModelRunner
from mleagle.engine.executor.worker import FwdInfo, HostView, Pending, StepResult, TargetWorker, Timer, pack
from mleagle.engine.sampling import rng
from mleagle.engine.sampling.processor import RowFlags, SamplingRows, penalize, probs_from_logits
from mleagle.engine.sampling.sampler import draw, logprobs
from mleagle.engine.spec import greedy


@dataclass
class DraftState:
    hidden_stash: list[torch.Tensor] = field(default_factory=list)  # target hidden per prefill chunk
    start: int = 0  # first position the stash covers (a prefix-cache hit's length; 0 without one)


@dataclass
class IterationStats:
    """What the last decode iteration did (for events and benchmarks)."""

    bs: int = 0
    accepted: list[int] = field(default_factory=list)  # accepted drafts per request
    verify_s: float = 0.0
    draft_s: float = 0.0
    draft_layer_s: list[float] = field(default_factory=list)  # time of each draft step's forward


class SpecWorker(TargetWorker):
    def __init__(self, target: ModelRunner, drafts: list[ModelRunner], chain: bool, steps: int,
                 device: torch.device | str = "cpu", eos_ids: frozenset[int] = frozenset(),
                 boundary_kv: str = "stale", vocab: int = 0, max_reqs: int = 0):
        if boundary_kv not in ("stale", "recompute"):
            raise ValueError(f"boundary_kv must be 'stale' or 'recompute', not {boundary_kv!r}")
        if not 1 <= steps <= len(drafts):
            raise ValueError(f"spec steps {steps} must be in 1..{len(drafts)} (the draft's layers)")
        super().__init__(target, device, eos_ids, vocab, max_reqs, steps)
        self.boundary_kv = boundary_kv
        self.drafts = drafts[:steps]
        self.chain, self.steps = chain, steps
        self.lookahead = steps + 1
        self.stats = SpecStats(accepted_per_depth=[0] * steps)
        self.last = IterationStats()
        self.boundary_kv_stale_positions = 0
        self.step_batches: list[ForwardBatch] = []  # the last iteration's per-step draft batches (tests)
        self.layer_times: list[float] = []  # the last draft-extend's per-step forward times
        self._simulate = torch.full((), -1, dtype=torch.int64, device=self.device)
        self._prefill_timers: list[Timer] = []  # draft-prefill spans not read yet

    @property
    def runners(self) -> list[ModelRunner]:
        return [self.target, *self.drafts]

    @property
    def simulate_accepted(self) -> int | None:
        """Benchmark-only: force every iteration to accept this many drafts (accept length n+1), so the
        speed of speculation can be measured before a draft that earns it exists. Output is then not
        the target's; every figure made with it is labelled "simulated". A device scalar, so captured
        iterations read the current value."""
        v = int(self._simulate)
        return None if v < 0 else v

    @simulate_accepted.setter
    def simulate_accepted(self, n: int | None) -> None:
        self._simulate.fill_(-1 if n is None else n)

    @property
    def prefix_margin(self) -> int:
        """Draft layer k's KV at position p was computed from token t_{p+k+1}, so the last S positions
        of a cached prefix read its owner's continuation, not a new request's: a hit recomputes them
        (S target tokens), and every runner's KV it reuses was computed from the prefix's own tokens."""
        return self.steps

    # --- prefill ------------------------------------------------------------------------------
    def prefill(self, reqs: list[Req], chunks: list[int]) -> list[StepResult]:
        self.admit(reqs)
        batch = self.prefill_batch(reqs, chunks)
        out = self.target.forward(batch)
        self.last_batch = batch
        off = 0
        for r, c in zip(reqs, chunks):
            if r.draft_state is None:  # the first chunk: it starts past any cached prefix
                r.draft_state = DraftState(start=r.kv_len)
            r.draft_state.hidden_stash.append(out.hidden[off : off + c])
            off += c
        results = self.finish_prefill(reqs, chunks, batch, out)
        done = [i for i, r in enumerate(reqs) if not r.prefilling]
        if done:
            timer = Timer(self.device)
            timer.mark()
            bonus = [results[i].tokens[0] if results[i].tokens else reqs[i].output_ids[-1] for i in done]
            self._draft_prefill([reqs[i] for i in done], bonus)
            timer.mark()
            # Read once a later iteration's sync has passed it (`on_finish`): reading now would wait for
            # the draft prefill and stall the overlapped schedule.
            self._prefill_timers.append(timer)
        return results

    def _draft_prefill(self, reqs: list[Req], bonus: list[int]) -> None:
        """Each draft runner over positions [start, kv_len) of each request (start = the cached prefix
        the draft pools already hold, else 0): layer k at position p reads t_{p+k+1}, so its ids are
        the sequence shifted by k+1 (bonus and fresh drafts at the end)."""
        starts = [r.draft_state.start for r in reqs]
        lens = [r.kv_len - st for r, st in zip(reqs, starts)]
        view = build_batch(ForwardMode.EXTEND, input_ids=[0] * sum(lens), req_pool_indices=[r.req_pool_idx for r in reqs],  # type: ignore[misc]
                           prefix_lens=starts, extend_lens=lens, req_to_token=self.r2t, device=self.device,
                           rids=tuple(r.rid for r in reqs))
        target_hidden = torch.cat([torch.cat(r.draft_state.hidden_stash) for r in reqs])
        if self.boundary_kv == "stale":
            for r in reqs:
                r.draft_state.hidden_stash = []
        else:  # "recompute" keeps every committed position's target hidden for the next full pass
            for r, n in zip(reqs, lens):
                r.draft_state.hidden_stash = [torch.cat(r.draft_state.hidden_stash)[:n]]
        # Token windows on the device: request i's positions start_i..kv_len_i-1 and its bonus form `seq`
        # (lens_i + 1 entries); layer k at position p reads t_{p+k+1}, from `seq` while that is at most
        # the bonus, else draft number (p+k+1 - kv_len) made by an earlier layer (`tail`).
        dev, n = self.device, len(reqs)
        seq = torch.tensor([t for r, st, b in zip(reqs, starts, bonus) for t in [*r.fill_ids[st : r.kv_len], b]],
                           dtype=torch.int64).to(dev)
        lens_t = torch.tensor(lens, dtype=torch.int64)
        offs = torch.cat([torch.zeros(1, dtype=torch.int64), (lens_t + 1).cumsum(0)[:-1]])  # each request's seq start
        row_req = torch.repeat_interleave(torch.arange(n), lens_t).to(dev)
        rel = torch.cat([torch.arange(x) for x in lens]).to(dev)  # p - start_i, per row
        offs, lens_d = offs.to(dev), lens_t.to(dev)
        rpi = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64).to(dev)
        flags = self.state.flags([r.req_pool_idx for r in reqs])  # type: ignore[misc]
        flags = self.constrain.begin(reqs, flags)  # constrain: the first drafts follow the grammar
        tail = torch.zeros(n, self.steps + 1, dtype=torch.int64, device=dev)
        h = target_hidden
        self.step_batches = []
        for k, runner in enumerate(self.drafts):
            j = rel + k + 1  # index of t_{p+k+1} in the request's window
            over = j - lens_d[row_req]  # > 0: past the bonus, a draft
            ids = torch.where(over <= 0, seq[(offs[row_req] + j.clamp(max=lens_d[row_req]))], tail[row_req, over.clamp(min=0)])
            b = dataclasses.replace(view, input_ids=ids, hidden_in=h, binding=runner.binding)
            self.step_batches.append(b)
            o = runner.forward(b)  # EXTEND: one logit row per request, at its last position
            logits = self.constrain.draft_logits(o.logits, k, runner.model.head.vocab_ids) if flags.constrained else o.logits
            tail[:, k + 1] = self._draft_tokens(rpi, logits, k, flags)
            if flags.constrained:  # constrain: the matchers take the draft tentatively
                self.constrain.draft_accept(tail[:, k + 1], k)
            h = o.hidden if self.chain else target_hidden

    def _draft_tokens(self, rpi: torch.Tensor, logits: torch.Tensor, k: int, flags: RowFlags,
                      rows: SamplingRows | None = None, live: torch.Tensor | None = None) -> torch.Tensor:
        """Draft k+1 per request: argmax for greedy requests, a draw from the processed draft
        distribution q otherwise (q kept in the slot state for rejection sampling). The logits are over
        the draft's vocabulary (its own, reduced one when it has one): `head` maps indices to target ids
        and q back to the target's vocabulary. Written to the slot state's drafts; returned for the next
        step's id window."""
        st = self.state
        head = self.drafts[k].model.head
        if flags.all_greedy:
            d = head.to_target_ids(logits.argmax(-1))
        else:
            if rows is None:
                rows = st.rows(rpi, 1, flags)
            rk = dataclasses.replace(rows, pos=rows.pos + k)
            q = probs_from_logits(logits.float(), rk)
            d = head.to_target_ids(torch.where(rk.greedy, logits.argmax(-1), draw(q, rk, rng.STREAM_DRAFT)))
            assert st.draft_q is not None
            st.draft_q[rpi, k] = head.scatter_probs(q)
        st.drafts[rpi, k] = d if live is None else torch.where(live, d, st.drafts[rpi, k])
        return d

    # --- decode iteration ----------------------------------------------------------------------
    def launch(self, reqs: list[Req]) -> Pending:
        w, bs = self.steps + 1, len(reqs)
        timer = Timer(self.device)
        timer.mark()
        rpi = self.rpi_of(reqs)
        flags = self.state.flags([r.req_pool_idx for r in reqs], reqs)  # type: ignore[misc]
        flags = self.constrain.begin(reqs, flags)  # constrain: constrained batches are never `plain`
        g = self.iter_graph
        hidden = None
        if (g is not None and flags.plain and flags.logprobs < 0 and self.boundary_kv == "stale"
                and g.bucket(bs) is not None):
            packed, pbs = g.run(rpi, bs)
            rids = tuple(r.rid for r in reqs)
            modes = [(r, ForwardMode.TARGET_VERIFY if r is self.target else ForwardMode.DRAFT_EXTEND) for r in self.runners]
            self.forwards = [FwdInfo(r.name, m.value, bs, rids, [w] * bs, bs * w, pbs, None,
                                     r.rule_meta(m, bs, w, pruned=m is ForwardMode.DRAFT_EXTEND)) for r, m in modes]
            timer.mark()  # one span: the whole iteration (its verify/draft split is not timed inside a graph)
        else:
            packed, _, hidden = self._iteration(rpi, None, flags, self.host_view(reqs), eager=False, timer=timer)
        p = self._send(reqs, w, flags, packed, timer)
        if self.boundary_kv == "recompute":
            assert hidden is not None
            p = self._recompute(p, hidden)
        return p

    def _iteration(self, rpi: torch.Tensor, live: torch.Tensor | None, flags: RowFlags, host: HostView, eager: bool,
                   timer: Timer | None = None) -> tuple[torch.Tensor, list[RowMeta], torch.Tensor]:
        """Verify, accept, commit and draft-extend on the device; returns (packed result, each forward's
        row metadata, the target's hidden states). `eager` runs every forward eagerly (inside a
        whole-iteration capture); `live` masks padded rows out of every state write."""
        st = self.state
        w, bs = self.steps + 1, int(rpi.shape[0])
        drafts = st.drafts[rpi]  # [bs, S]
        ids = torch.cat([st.last_tok[rpi].view(-1, 1), drafts], dim=1)
        view = self.view(ForwardMode.TARGET_VERIFY, rpi, ids, w, self._arange(bs * w), host)
        vb = self.target.bind(view)
        out = self.target.forward_eager(vb, observe=False) if eager else self.target.forward(vb)
        self.last_batch = vb
        self.forwards = [FwdInfo.of(self.target.name, vb, out.graph_bs, out.eager_reason)]
        metas = [self.target.row_meta(vb)]
        if flags.plain and flags.logprobs < 0:  # the common case: fused accept + commit + pack on CUDA
            emitted, n, packed, sel = greedy.accept(out.logits, w, drafts, rpi, live, st, self._simulate)
        else:
            emitted, n, packed = self._accept(out.logits, rpi, live, flags, drafts, w)
            sel = torch.arange(bs, device=self.device) * w + n
        if timer is not None:
            timer.mark()
        # Draft-extend over the same rows. Rows past a request's last accepted row carry the target's
        # guesses; their KV lands at positions >= the new kv_len, which the next iteration rewrites.
        if self.boundary_kv == "stale":
            dview = dataclasses.replace(view, mode=ForwardMode.DRAFT_EXTEND, logit_rows=sel, pruned=True)
            metas += self._draft_extend(rpi, dview, out.hidden, emitted, n, flags, timer, live, eager)
        return packed, metas, out.hidden

    def _accept(self, logits: torch.Tensor, rpi: torch.Tensor, live: torch.Tensor | None, flags: RowFlags,
                drafts: torch.Tensor, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Accept and commit for any sampling parameters (penalties, bans, sampled rows, logprobs):
        (emitted [bs, W], accepted drafts n [bs], packed result)."""
        st = self.state
        s, bs = w - 1, int(rpi.shape[0])
        if flags.plain:
            x, rows = logits, None
        else:
            rows = st.rows(rpi, w, flags)
            x = penalize(logits, rows, *st.context(rpi, flags, drafts))
        if flags.constrained:  # constrain: each verify row masked by the grammar after its own prefix
            x = self.constrain.mask(x)
        pred = x.argmax(-1).view(bs, w)
        ar = st._ar[:w].view(1, w)
        if flags.all_greedy:
            n = greedy.accepted(drafts, pred)
        else:
            assert rows is not None
            n, final = self._reject(x, rows, drafts, pred, rpi, bs, w)
        # Benchmark-only forced acceptance (a device scalar, so whole-iteration graphs honour it too).
        sim = self._simulate >= 0
        n = torch.where(sim, self._simulate.clamp(max=s), n)
        at_n = pred.gather(1, n.view(-1, 1)).view(-1)
        final = at_n if flags.all_greedy else torch.where(sim, at_n, final)
        # Accepted drafts (equal to the target's argmax where greedy), the final token at row n, and the
        # target's guesses after it.
        emitted = torch.where(ar < n.view(-1, 1), torch.cat([drafts, drafts[:, -1:]], 1), pred)
        emitted = emitted.scatter(1, n.view(-1, 1), final.view(-1, 1))
        n_emit = n + 1
        lp = logprobs(logits, emitted.reshape(-1), max(flags.logprobs, 0)) if flags.logprobs >= 0 else None
        st.commit(rpi, emitted, n_emit, flags, live=live)
        st.iters[rpi] += 1 if live is None else live.to(torch.int64)
        if flags.constrained:  # constrain: the matchers keep the accepted tokens (read to the host)
            self.constrain.commit(emitted, n_emit)
        return emitted, n, pack(emitted, n_emit, lp, w)

    def _reject(self, x: torch.Tensor, rows: SamplingRows, drafts: torch.Tensor, pred: torch.Tensor, rpi: torch.Tensor,
                bs: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rejection sampling over the batch: accepted drafts n [bs] and the token at row n [bs]."""
        s, v = w - 1, x.shape[1]
        st = self.state
        p = probs_from_logits(x, rows).view(bs, w, v)
        assert st.draft_q is not None
        q = st.draft_q[rpi]  # [bs, S, V]
        pd = p[:, :s].gather(2, drafts.unsqueeze(-1)).squeeze(-1)
        qd = q.gather(2, drafts.unsqueeze(-1)).squeeze(-1)
        u = self._accept_uniform(rows, bs, w)
        greedy = rows.greedy.view(bs, w)[:, 0]
        ok = torch.where(greedy.view(-1, 1), drafts == pred[:, :s], (qd > 0) & (u * qd < pd))
        n = ok.to(torch.int64).cumprod(1).sum(1)
        pn = p.gather(1, n.view(bs, 1, 1).expand(bs, 1, v)).squeeze(1)
        qn = q.gather(1, n.clamp(max=s - 1).view(bs, 1, 1).expand(bs, 1, v)).squeeze(1)
        res = torch.clamp(pn - torch.where((n < s).view(-1, 1), qn, 0.0), min=0)
        res = torch.where(res.sum(-1, keepdim=True) > 0, res, pn)
        stream = torch.where(n < s, rng.STREAM_RESIDUAL, rng.STREAM_TOKEN)
        pos_n = rows.pos.view(bs, w).gather(1, n.view(-1, 1)).view(-1)
        key = rng.keys(rows.seed.view(bs, w)[:, 0], pos_n, stream, rows.it.view(bs, w)[:, 0])
        samp = (res / rng.exponential(key, v)).argmax(-1)
        final = torch.where(greedy, pred.gather(1, n.view(-1, 1)).view(-1), samp)
        return n, final

    @staticmethod
    def _accept_uniform(rows: SamplingRows, bs: int, w: int) -> torch.Tensor:
        """The acceptance test's uniforms [bs, S]: row j's key is (seed, o + j, ACCEPT, iteration)."""
        s = w - 1

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t.view(bs, w)[:, :s].reshape(-1)

        return rng.uniform(rng.keys(cut(rows.seed), cut(rows.pos), rng.STREAM_ACCEPT, cut(rows.it)), 1).view(bs, s)

    def _draft_extend(self, rpi: torch.Tensor, view: ForwardBatch, target_hidden: torch.Tensor, emitted: torch.Tensor,
                      n: torch.Tensor, flags: RowFlags, timer: Timer | None, live: torch.Tensor | None = None,
                      eager: bool = False) -> list[RowMeta]:
        h = target_hidden
        ids = emitted  # layer 0 at row j reads t_{kv_len+j+1}: the emitted tokens, the target's guesses after
        rows = None if flags.all_greedy else self.state.rows(rpi, 1, flags)
        self.step_batches = []
        metas = []
        for k, runner in enumerate(self.drafts):
            b = dataclasses.replace(view, input_ids=ids.reshape(-1), hidden_in=h, binding=runner.binding)
            self.step_batches.append(b)
            o = runner.forward_eager(b, observe=False) if eager else runner.forward(b)
            self.forwards.append(FwdInfo.of(runner.name, b, o.graph_bs, o.eager_reason))
            metas.append(runner.row_meta(b))
            logits = o.logits
            if flags.constrained:  # constrain: draft k proposes only what the grammar allows
                logits = self.constrain.draft_logits(logits, k, runner.model.head.vocab_ids)
            if flags.all_greedy:  # argmax, vocabulary map, state write and window rotate (fused on CUDA)
                d, ids = greedy.draft_step(logits, runner.model.head.vocab_ids, self.state, rpi, k, live, ids, n)
            else:
                d = self._draft_tokens(rpi, logits, k, flags, rows, live)
                # Rotate: every window shifts left by one, and the new draft goes at the last accepted row.
                ids = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1).scatter(1, n.view(-1, 1), d.view(-1, 1))
            if flags.constrained:  # constrain: the matchers take the draft tentatively
                self.constrain.draft_accept(d, k)
            if timer is not None:
                timer.mark()
            h = o.hidden if self.chain else target_hidden
        return metas

    def _recompute(self, p: Pending, target_hidden: torch.Tensor) -> Pending:
        """Reference boundary-KV policy: read the accepted counts, then re-run every draft layer over the
        whole committed sequence of each request (O(sequence) per iteration)."""
        if p.done is not None:
            p.done.synchronize()
        w = p.width
        emitted = [[int(t) for t in row[: int(row[w])]] for row in p.packed.tolist()]
        for i, (r, toks) in enumerate(zip(p.reqs, emitted)):
            # The committed rows' target hidden (cloned: a graph's output buffer is rewritten next replay).
            r.draft_state.hidden_stash.append(target_hidden[i * w : i * w + len(toks)].clone())
            r.output_ids.extend(toks)  # temporarily: the windows read the committed tokens
            r.kv_len += len(toks)
        try:
            self._draft_prefill(p.reqs, [toks[-1] for toks in emitted])
        finally:
            for r, toks in zip(p.reqs, emitted):
                del r.output_ids[len(r.output_ids) - len(toks) :]
                r.kv_len -= len(toks)
        p.timer.mark()
        return p

    def on_finish(self, p: Pending, res: list[StepResult]) -> None:
        """Host accounting once the iteration's counts are back: per request and global statistics."""
        rows = p.packed.tolist()
        accepted = [int(row[p.width]) - 1 for row in rows]
        spans = p.timer.spans()
        for t in self._prefill_timers:  # recorded before this iteration's sync: complete now
            self.stats.draft_time_s += sum(t.spans())
        self._prefill_timers.clear()
        verify_s = spans[0] if spans else 0.0
        layer = spans[1:] if self.boundary_kv == "stale" else [sum(spans[1:]) / self.steps] * self.steps
        draft_s = sum(layer)
        self.layer_times = list(layer)
        self.last = IterationStats(len(p.reqs), accepted, verify_s, draft_s, list(layer))
        s = self.steps
        self.stats.num_verify += len(p.reqs)
        self.stats.verify_time_s += verify_s
        self.stats.draft_time_s += draft_s
        for r, n, out in zip(p.reqs, accepted, res):
            if not out.tokens:  # preempted or finished since the launch: not an iteration of it
                continue
            if r.spec is None:
                r.spec = SpecStats(accepted_per_depth=[0] * s)
            sp = r.spec
            sp.num_verify += 1
            sp.num_draft_tokens += s
            sp.num_accepted_tokens += n
            sp.verify_time_s += verify_s / len(p.reqs)
            sp.draft_time_s += draft_s / len(p.reqs)
            self.stats.num_draft_tokens += s
            self.stats.num_accepted_tokens += n
            for j in range(n):
                sp.accepted_per_depth[j] += 1
                self.stats.accepted_per_depth[j] += 1
            # Layer k at position p reads t_{p+k+1}: of the n+1 committed rows (0..n), rows n-k+1..n
            # read tokens not yet verified (new drafts), so min(k, n+1) positions per layer; count them.
            if self.boundary_kv == "stale":
                self.boundary_kv_stale_positions += sum(min(k, n + 1) for k in range(s))

    def kv_valid_len(self, req: Req) -> int:
        """Draft pools are filled when a request's prefill completes: until then only its cached prefix
        is valid in every runner. After that every committed position is (stale policy: as written)."""
        return req.cached_len if req.prefilling else req.kv_len


def build_spec_worker(engine: object) -> SpecWorker:
    """Build the draft stack named by `engine.cfg.engine.draft` and one runner per step, each with its
    own KV pool (a layer per block of the step), request-to-token map and backend, registered with the
    memory manager."""
    from mleagle.engine.contract.config import MAX_SPEC_STEPS
    from mleagle.engine.core.engine import EngineInputError, build_runner
    from mleagle.engine.spec.checkpoint import load_draft, load_layer, parse_spec, random_layer_weights
    from mleagle.engine.spec.draft_model import DraftStack

    e = engine  # an Engine; typed loosely to keep the import graph one-way
    ecfg = e.cfg.engine  # type: ignore[attr-defined]
    try:
        kind, s, seed, chain = parse_spec(ecfg.draft)
    except ValueError as err:
        raise EngineInputError(str(err)) from err
    arch = e.arch  # type: ignore[attr-defined]
    vocab_ids, blocks, aux_layers = None, 1, ()
    if kind == "random":
        layers = [random_layer_weights(arch, seed, k) for k in range(s or 0)]
        darch = arch
    else:
        try:
            ck = load_draft(ecfg.draft, arch)
            darch, chain, layers, vocab_ids = ck.arch, ck.chain, ck.layers, ck.vocab_ids
            blocks, aux_layers = ck.blocks, ck.aux_layers
        except (FileNotFoundError, ValueError) as err:
            raise EngineInputError(str(err)) from err
        if darch.hidden_size != arch.hidden_size or darch.vocab_size != arch.vocab_size:
            raise EngineInputError(f"draft {ecfg.draft}: hidden/vocab ({darch.hidden_size}/{darch.vocab_size}) do not "
                                   f"match the target ({arch.hidden_size}/{arch.vocab_size})")
    steps = ecfg.spec_steps or min(len(layers), MAX_SPEC_STEPS)
    if steps > len(layers):
        raise EngineInputError(f"--spec-steps {steps} exceeds the draft's {len(layers)} layers")
    model = e.model  # type: ignore[attr-defined]
    tp_size = model.tp.size
    replicate = tp_size > 1 and ecfg.draft_tp == "replicate"
    if tp_size > 1 and not replicate:
        from mleagle.engine.core.engine import tp_shape_errors

        errs = tp_shape_errors(darch, tp_size, "draft ")
        if errs:
            raise EngineInputError(f"draft {ecfg.draft} cannot be sharded over tp_size={tp_size}: {'; '.join(errs)}; "
                                   'set draft_tp = "replicate" (--draft-tp replicate) to run it whole on every rank')
    try:
        stack = DraftStack(darch, len(layers), chain, e.dtype, model.embed_tokens, model.lm_head, model.rope,  # type: ignore[attr-defined]
                           layout=model.layout, replicate=replicate, vocab_ids=vocab_ids, blocks=blocks,
                           aux_layers=aux_layers)
    except ValueError as err:
        raise EngineInputError(f"draft {ecfg.draft}: {err}") from err
    for m, w in zip(stack.layers, layers):
        load_layer(m, {k: v.to(e.dtype) for k, v in w.items()})  # type: ignore[attr-defined]
    stack.to(e.device).eval()  # type: ignore[attr-defined]
    model.aux_layers = stack.aux_layers  # the target now also returns the streams layer 0 reads
    target = e.target  # type: ignore[attr-defined]
    runners = []
    for k in range(steps):
        r = build_runner(f"draft{k}", stack.layers[k], target.binding.kv_pool.num_slots, darch, ecfg,
                         e.max_reqs, target.binding.req_to_token.max_context, e.dtype)  # type: ignore[attr-defined]
        e.mem.add_map(r.binding.req_to_token)  # type: ignore[attr-defined]
        runners.append(r)
    e.draft_stack = stack  # type: ignore[attr-defined]
    return SpecWorker(target, runners, chain, steps, e.device, frozenset(e.eos_ids),  # type: ignore[attr-defined]
                      boundary_kv=ecfg.boundary_kv, vocab=arch.vocab_size, max_reqs=e.max_reqs)  # type: ignore[attr-defined]
