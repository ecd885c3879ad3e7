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
   (no penalties, bans or logprobs: the common case) takes `SlotState.verify_greedy`, one kernel after
   the argmax on CUDA, and greedy draft steps `SlotState.draft_greedy`.
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
past the prefix. The draft layers' last outputs are the first drafts. The draft prefill reads each
request's first token from the slot state on the device (the host reads it later, see the scheduler),
so it is launched right behind the target's prefill without waiting for it. A catch-up runs in groups
of requests that fit the draft runners' prefill graphs (`_fill_groups`).

Depth: the speculation policy (`mleagle.engine.spec.policy`) picks before each iteration how many
draft steps S' in 0..S it runs (`plan`): S' = 0 is the target-only decode step, a smaller S' verifies
the first S' drafts and runs the first S' layers. The layers that did not run fall behind: per request
`DraftState.valid` is where every layer's KV ends, `.depth` how many leading layers are current to
kv_len. Under `auto` and `cycle` every target forward writes its hidden states into a pool with one
row per KV slot (`hpool`), and an iteration deeper than a request's `depth` first **catches up**
(`catch_up`): a batched draft extend over [valid, kv_len) from the pool (in groups that fit the
prefill graphs), exactly what the draft
prefill does over a prompt, which also makes the first drafts. While the batch runs plain steps a
finished prefill skips its draft prefill (the catch-up does it later). The prefix cache then keeps all
of a request's target KV, and `draft_ok` (per slot, on the host) marks the cached slots whose draft KV
is complete, so a request that hits others catches those up from the pool too. A catch-up is
described by host lengths, so the scheduler launches it with no iteration in flight (`hold`).

Structured output: every draft step is masked by its request's grammar and the verify rows by the
masks the drafting kept (`engine/constrain/runtime.py`). A greedy iteration whose constraints are
grammars only runs at depth 0 or S on graphs: at S as the chain of `masked_chain.py` (the host fills
each draft step's masks while the next forward runs); any other constrained batch steps through its
draft layers with the host's masks in between.

Boundary-KV policy: **accept the staleness** (as SGLang does for MiMo-style stacks). After an
iteration accepting n drafts, layer k's KV at the last k committed positions was computed from
tokens that were drafts at the time; where the next verify rejects those drafts that KV stays
stale. It can lower acceptance, never change output (the target verifies every token).
`boundary_kv_stale_positions` counts such positions so the cost is observable. The reference policy
that recomputes them, and the forced acceptance benchmarks use, are subclasses in
`mleagle.engine.spec.reference`, not modes of this class.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from mleagle.engine.contract.outputs import SpecStats
from mleagle.engine.core.request import Req, ReqState, SpecCounts
from mleagle.engine.executor.extend_graph import ExtendGraphRunner
from mleagle.engine.executor.forward_batch import (
    ForwardBatch,
    ForwardMode,
    ForwardOutput,
    RowMeta,
    build_batch,
)
from mleagle.engine.executor.iteration_graph import IterationGraph
from mleagle.engine.executor.results import (
    FwdInfo,
    HostView,
    Pending,
    SplitLaunch,
    StepPlan,
    StepResult,
    Timer,
    pack,
)
from mleagle.engine.executor.runner import ModelRunner
from mleagle.engine.executor.slot_state import accepted, rotate
from mleagle.engine.executor.worker import GraphSettings, TargetWorker
from mleagle.engine.memory.manager import page_slots
from mleagle.engine.memory.zeros import lazy_zeros
from mleagle.engine.sampling import rng
from mleagle.engine.sampling.processor import RowFlags, SamplingRows, penalize, probs_from_logits
from mleagle.engine.sampling.sampler import draw, logprobs
from mleagle.engine.spec.draft_model import MTPLayer
from mleagle.engine.spec.fill_graph import FillGraph
from mleagle.engine.spec.masked_chain import MaskedChain
from mleagle.engine.spec.policy import SpecPolicy


@dataclass
class DraftState:
    hidden_stash: list[torch.Tensor] = field(default_factory=list)  # target hidden per prefill chunk
    start: int = 0  # first position the stash covers (a prefix-cache hit's length; 0 without one)
    # After the draft prefill: every draft layer's KV is computed below `valid`, and the first `depth`
    # layers' up to kv_len (iterations of fewer draft steps leave the others behind; see `catch_up`).
    valid: int = 0
    depth: int = 0


@dataclass
class IterationStats:
    """What the last decode iteration did (for events and benchmarks)."""

    bs: int = 0
    accepted: list[int] = field(default_factory=list)  # accepted drafts per request
    verify_s: float = 0.0
    draft_s: float = 0.0
    draft_layer_s: list[float] = field(default_factory=list)  # time of each draft step's forward


class SpecWorker(TargetWorker):
    # A verify row's accepted count is known only once its iteration finishes, so a mixed step keeps
    # the prefill beside the iteration (two forwards), never fused.
    fuse_mixed = False
    # The prefill stays behind the iteration in flight: its draft fill and catch-ups share the draft
    # runners' graphs, pools and the hidden-state pool with the iterations (not measured beside them yet).
    side_ok = False

    def __init__(self, target: ModelRunner, drafts: list[ModelRunner], chain: bool, steps: int,
                 device: torch.device | str = "cpu", eos_ids: frozenset[int] = frozenset(), vocab: int = 0,
                 max_reqs: int = 0, prefix_cache: bool = False, policy: str = "always", tp_size: int = 1,
                 depths: list[int] | None = None):
        # `prefix_cache` (whether the engine keeps one) is told to every worker class: this one serves
        # with or without it, a measuring subclass may refuse it.
        if not 1 <= steps <= len(drafts):
            raise ValueError(f"spec steps {steps} must be in 1..{len(drafts)} (the draft's layers)")
        super().__init__(target, device, eos_ids, vocab, max_reqs, steps)
        self.drafts = drafts[:steps]
        self.chain, self.steps = chain, steps
        self.lookahead = steps + 1
        self.depth = steps
        if depths is not None and not all(0 <= d <= steps for d in depths):
            raise ValueError(f"spec depths {depths}: each must be in 0..{steps} (the draft steps)")
        choices = sorted({0, steps, *depths}) if depths is not None else None
        self.policy = SpecPolicy(policy, steps, choices=choices, publish=tp_size > 1)
        self.drafting = policy != "off"  # off: the draft layers never run, not even at prefill
        # Depths below S leave draft layers behind (and a prefill may leave them out altogether); their
        # catch-up reads the target's hidden states of the positions it covers from this pool, one row
        # per KV slot (written by every target forward), so positions the prefix cache holds can catch
        # up too. `draft_ok` (host) says which cached slots' draft KV is complete (see `release`).
        self.hpool: torch.Tensor | None = None
        pool = target.binding.kv_pool
        self.draft_ok = np.zeros(0, dtype=bool)
        if policy in ("auto", "cycle"):
            layer0 = self._layer(0)
            self.hpool = lazy_zeros((pool.num_slots, layer0.hidden_in_size), self.hidden_dtype, self.device)
            self.draft_ok = np.zeros(pool.num_slots, dtype=bool)
        self.page_size = int(getattr(pool, "page_size", 1))
        self._held: StepPlan | None = None  # a plan the scheduler could not launch overlapped (see `hold`)
        self._last_done: float | None = None  # when the last iteration finished (the policy's clock)
        self.stats = SpecStats(accepted_per_depth=[0] * steps)
        self.last = IterationStats()
        self.boundary_kv_stale_positions = 0
        self.layer_times: list[float] = []  # the last draft-extend's per-step forward times
        # Prefill spans not read yet: (timer, whether its last span is a draft prefill).
        self._prefill_timers: list[tuple[Timer, bool]] = []
        # Prompts whose draft prefill an EXTEND step left for after its first tokens went out (`prefill`'s
        # `defer_fill`): it runs first thing at the worker's next call.
        self._fill_later: list[Req] = []
        self.fill_graph: FillGraph | None = None  # every draft layer's fill in one replay (`_capture_prefill`)
        self._mhidden: torch.Tensor | None = None  # a masked iteration's verify hidden states (`_masked_forward`)
        self.masked_chain: MaskedChain | None = None  # a masked drafting iteration's graphs (`_masked_pieces`)

    @property
    def runners(self) -> list[ModelRunner]:
        return [self.target, *self.drafts]

    @property
    def active_runners(self) -> list[ModelRunner]:
        return [self.target, *self.drafts[: self.depth]]

    @property
    def full_depth(self) -> int:
        return self.steps

    def graph_depths(self) -> list[int]:
        """Every depth the policy may choose: its choices under `auto` (0 and S), 0..S under `cycle`,
        else its one depth."""
        if self.policy.mode == "cycle":
            return list(range(self.steps + 1))
        if self.policy.mode == "auto":
            return list(self.policy.choices)
        return [self.steps if self.drafting else 0]

    @property
    def width(self) -> int:
        """Token rows per request in the iteration being built (S'+1; 1 at depth 0, a plain decode)."""
        return self.depth + 1

    @property
    def prefix_margin(self) -> int:
        """Draft layer k's KV at position p was computed from token t_{p+k+1}, so the last S positions
        of a cached prefix read its owner's continuation, not a new request's: a hit recomputes them
        (S target tokens), and every runner's KV it reuses was computed from the prefix's own tokens."""
        return self.steps

    def graph_mode(self, r: ModelRunner) -> tuple[ForwardMode, int, bool]:
        if self.depth == 0:
            return ForwardMode.DECODE, 1, False
        if r is self.target:
            return ForwardMode.TARGET_VERIFY, self.width, False
        return ForwardMode.DRAFT_EXTEND, self.width, True

    def _capture_prefill(self, s: GraphSettings, pool: object | None, cuda: bool) -> list[str]:
        """Each runner's prefill graphs, then the draft fill of all S layers as one graph per token
        bucket (`FillGraph`), where every draft layer has prefill graphs to follow."""
        lines = super()._capture_prefill(s, pool, cuda)
        like = self.drafts[0].extend_graphs
        if not self.drafting or not isinstance(like, ExtendGraphRunner) or any(
                r.extend_graphs is None for r in self.drafts):
            return lines
        heads = [self._layer(k).head.vocab_ids for k in range(self.steps)]
        g = FillGraph(self.drafts, heads, like, self.state, self.r2t,
                      chain=self.chain, hpool=self.hpool, hidden_size=self._layer(0).hidden_in_size,
                      dtype=self.hidden_dtype, emulate=not cuda, pool=pool)
        why = self._try_capture("the draft fill", g.capture, s)
        if why is not None:
            lines.append(f"draft fill: per layer ({why})")
            return lines
        self.fill_graph = g
        lines.append(f"draft fill ({self.steps} layers in one graph): tokens {g.buckets[0]}..{g.buckets[-1]}, "
                     f"{g.stats.capture_mb:.0f} MiB, {g.stats.capture_s:.2f} s")
        return lines

    @property
    def iteration_name(self) -> str:
        if self.depth == 0:
            return "decode + sample (depth 0)"
        return f"verify + accept + {self.depth} draft steps"

    @property
    def hidden_dtype(self) -> torch.dtype:
        """The dtype of the target hidden states the first draft layer reads."""
        return next(self._layer(0).parameters()).dtype

    def _layer(self, k: int) -> MTPLayer:
        """Draft step k's layer (its runner's model)."""
        return cast(MTPLayer, self.drafts[k].model)

    def _forced(self) -> torch.Tensor | None:
        """A forced accepted count for every request (a device scalar), or None: serving never forces.
        Only the measuring subclass of `mleagle.engine.spec.reference` overrides it."""
        return None

    # --- prefill ------------------------------------------------------------------------------
    def prefill(self, reqs: list[Req], chunks: list[int], defer_fill: bool = False) -> list[StepResult]:
        """The target's prefill (or chunks), then the draft layers' over the prompts it completed. With
        `defer_fill` (a step that prefills only: nothing decodes behind it) and the hidden-state pool
        (`auto`, `cycle`), the draft layers' pass waits until the worker's next call (`_flush_fill`), so
        the step's first tokens go out without it (on the 2-core dev VM, c1's TTFT p50 with the 5-step
        draft went from 291 / 124 / 129 to 219 / 87 / 94 ms: results/cpu_ttft)."""
        self._flush_fill()
        # The prefill's spans (the target's, then the draft layers'): the policy takes them out of the
        # interval between the iteration ends around it, which they would otherwise inflate.
        timer = Timer(self.device)
        timer.mark()
        batch = self.prefill_input(reqs, chunks)
        out = self.target.forward(batch)
        self.forwards = [FwdInfo.of(self.target.name, batch, out.graph_bs, out.eager_reason)]
        off = 0
        pooled = self.hpool is not None
        if pooled:
            self._keep_hidden(batch, out)
        for r, c in zip(reqs, chunks):
            if r.draft_state is None:  # the first chunk: it starts past any cached prefix
                r.draft_state = DraftState(start=r.kv_len, valid=self._cached_draft_valid(r) if pooled else r.kv_len)
            if not pooled:  # kept past this step: a graph's output is rewritten by its next replay
                h = out.hidden[off : off + c]
                r.draft_state.hidden_stash.append(h.clone() if out.graph_bs else h)
            off += c
        results = self.finish_prefill(reqs, chunks, batch, out)
        timer.mark()
        done = [i for i, r in enumerate(reqs) if not r.prefilling]
        if not self.drafting:  # policy off: the draft layers never run
            for i in done:
                reqs[i].draft_state.hidden_stash = []
            self._prefill_timers.append((timer, False))
            return results
        if done:
            # Each request's next input token (its first, just sampled, or a resumed request's last output)
            # from the slot state on the device: the first tokens are still on their way to the host.
            bonus = self.state.last_tok[self.rpi_of([reqs[i] for i in done])]
            self.policy.note_fill()
            if not pooled:
                self._draft_prefill([reqs[i] for i in done], bonus, last_tok=True)
            elif defer_fill and not self.policy.plain_now():  # after the first tokens are out
                self._fill_later += [reqs[i] for i in done]
            elif not self.policy.plain_now():  # the draft layers fill the positions now, from the pool
                t0 = time.perf_counter()
                self.catch_up([reqs[i] for i in done], bonus, measure=False, fresh=True)
                self.policy.observe_fill(time.perf_counter() - t0)
            else:
                # The batch decodes without drafts now: the draft prefill waits for the first deeper
                # iteration, whose catch-up covers it (`DraftState.valid` stays where the cache left it).
                for i in done:
                    reqs[i].draft_state.depth = 0
            timer.mark()
        # Read once its last mark has passed (`on_finish`): reading now would wait for the draft prefill.
        self._prefill_timers.append((timer, bool(done)))
        return results

    def _flush_fill(self) -> None:
        """The draft prefill `prefill(defer_fill=True)` left, for the prompts still running (one that
        finished or was preempted meanwhile has nothing to fill; its `valid` says so at release). No
        iteration has run since, so each slot's last token is still its first output. If the batch now
        decodes without drafts, the fill is put off as a prefill's would be (a later catch-up does it)."""
        if not self._fill_later:
            return
        reqs = [r for r in self._fill_later if r.state is ReqState.RUNNING and r.req_pool_idx is not None
                and r.draft_state is not None]
        self._fill_later = []
        if not reqs:
            return
        if self.policy.plain_now():
            for r in reqs:
                r.draft_state.depth = 0
            return
        t0 = time.perf_counter()
        self.catch_up(reqs, self.state.last_tok[self.rpi_of(reqs)], measure=False, fresh=True)
        self.policy.observe_fill(time.perf_counter() - t0)

    def _draft_prefill(self, reqs: list[Req], bonus: list[int] | torch.Tensor, last_tok: bool = False) -> None:
        """Each draft runner over positions [start, kv_len) of each request (start = the cached prefix
        the draft pools already hold, else 0): layer k at position p reads t_{p+k+1}, so its ids are
        the sequence shifted by k+1 (bonus and fresh drafts at the end)."""
        starts = [r.draft_state.start for r in reqs]
        lens = [r.kv_len - st for r, st in zip(reqs, starts)]
        target_hidden = torch.cat([torch.cat(r.draft_state.hidden_stash) for r in reqs])
        self._after_draft_prefill(reqs, lens)
        self._draft_fill(reqs, starts, lens, bonus, target_hidden, last_tok)

    def _draft_fill(self, reqs: list[Req], starts: list[int], lens: list[int], bonus: list[int] | torch.Tensor,
                    target_hidden: torch.Tensor | None, last_tok: bool = False) -> None:
        """Every draft layer over positions [start, start+len) of each request, from the target's hidden
        states there (`target_hidden`, the requests' rows in order; None: the rows' slots in the
        hidden-state pool), then the first drafts: a prefill's or a catch-up's; `bonus` is each
        request's token at start+len (host values, or on the device when the host does not have them
        yet), `last_tok` says it is the slot state's last token (the fill graph reads it there).
        Afterwards every layer's KV is current to start+len."""
        for r, st, n in zip(reqs, starts, lens):
            r.draft_state.valid, r.draft_state.depth = st + n, self.steps
        flags = self.state.flags([r.req_pool_idx for r in reqs])  # type: ignore[misc]
        g = self.fill_graph
        # (The graph reads a catch-up's hidden states from the pool itself, and a prefill's from its stash.)
        if (g is not None and last_tok and (target_hidden is None) == (self.hpool is not None) and flags.all_greedy
                and not any(r.constraint is not None for r in reqs) and g.fits(lens) is not None):
            g.run([cast(int, r.req_pool_idx) for r in reqs], starts, lens,
                  [r.fill_ids[st : st + n] for r, st, n in zip(reqs, starts, lens)], target_hidden)
            return
        if target_hidden is None:
            assert self.hpool is not None
            rows = torch.repeat_interleave(torch.tensor([r.req_pool_idx for r in reqs]), torch.tensor(lens))  # type: ignore[misc]
            pos = torch.cat([torch.arange(v, v + n) for v, n in zip(starts, lens)])
            target_hidden = self.hpool[self.r2t[rows.to(self.device, non_blocking=True), pos.to(self.device, non_blocking=True)]]
        view = build_batch(ForwardMode.EXTEND, input_ids=[0] * sum(lens), req_pool_indices=[r.req_pool_idx for r in reqs],  # type: ignore[misc]
                           prefix_lens=starts, extend_lens=lens, req_to_token=self.r2t, device=self.device,
                           rids=tuple(r.rid for r in reqs))
        # Token windows on the device: request i's positions start_i..kv_len_i-1 and its bonus form `seq`
        # (lens_i + 1 entries); layer k at position p reads t_{p+k+1}, from `seq` while that is at most
        # the bonus, else draft number (p+k+1 - kv_len) made by an earlier layer (`tail`).
        dev, n = self.device, len(reqs)
        host_bonus = not isinstance(bonus, torch.Tensor)
        seq = torch.tensor([t for i, (r, st, m) in enumerate(zip(reqs, starts, lens))
                            for t in [*r.fill_ids[st : st + m], bonus[i] if host_bonus else 0]],
                           dtype=torch.int64).to(dev, non_blocking=True)
        lens_t = torch.tensor(lens, dtype=torch.int64)
        offs = torch.cat([torch.zeros(1, dtype=torch.int64), (lens_t + 1).cumsum(0)[:-1]])  # each request's seq start
        if not host_bonus:  # each window's last entry, from the device
            seq[(offs + lens_t).to(dev, non_blocking=True)] = cast(torch.Tensor, bonus).to(torch.int64)
        row_req = torch.repeat_interleave(torch.arange(n), lens_t).to(dev, non_blocking=True)
        rel = torch.cat([torch.arange(x) for x in lens]).to(dev, non_blocking=True)  # p - start_i, per row
        offs, lens_d = offs.to(dev, non_blocking=True), lens_t.to(dev, non_blocking=True)
        rpi = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64).to(dev, non_blocking=True)
        flags = self.constrain.begin(reqs, flags)  # constrain: the first drafts follow the grammar
        tail = torch.zeros(n, self.steps + 1, dtype=torch.int64, device=dev)
        h = target_hidden
        for k, runner in enumerate(self.drafts):
            j = rel + k + 1  # index of t_{p+k+1} in the request's window
            over = j - lens_d[row_req]  # > 0: past the bonus, a draft
            ids = torch.where(over <= 0, seq[(offs[row_req] + j.clamp(max=lens_d[row_req]))], tail[row_req, over.clamp(min=0)])
            b = dataclasses.replace(view, input_ids=ids, hidden_in=h, binding=runner.binding)
            o = runner.forward(b)  # EXTEND: one logit row per request, at its last position
            logits = self.constrain.draft_logits(o.logits, k, self._layer(k).head.vocab_ids) if flags.constrained else o.logits
            tail[:, k + 1] = self._draft_tokens(rpi, logits, k, flags)
            if flags.constrained:  # constrain: the matchers take the draft tentatively
                self.constrain.draft_accept(tail[:, k + 1], k)
            h = o.hidden if self.chain else target_hidden

    def _after_draft_prefill(self, reqs: list[Req], lens: list[int]) -> None:
        """The prefill hidden states have been read: drop them (the reference subclass keeps them)."""
        for r in reqs:
            r.draft_state.hidden_stash = []

    def _draft_tokens(self, rpi: torch.Tensor, logits: torch.Tensor, k: int, flags: RowFlags,
                      rows: SamplingRows | None = None, live: torch.Tensor | None = None) -> torch.Tensor:
        """Draft k+1 per request: argmax for greedy requests, a draw from the processed draft
        distribution q otherwise (q kept in the slot state for rejection sampling). The logits are over
        the draft's vocabulary (its own, reduced one when it has one): `head` maps indices to target ids
        and q back to the target's vocabulary. Written to the slot state's drafts; returned for the next
        step's id window."""
        st = self.state
        head = self._layer(k).head
        if flags.all_greedy:
            d = head.to_target_ids(logits.argmax(-1))
        else:
            if rows is None:
                rows = st.rows(rpi, 1, flags)
            rk = dataclasses.replace(rows, pos=rows.pos + k)
            q = probs_from_logits(logits.float(), rk)
            d = head.to_target_ids(torch.where(rk.greedy, logits.argmax(-1), draw(q, rk, rng.STREAM_DRAFT)))
            qt = head.scatter_probs(q)  # over the target's vocabulary
            if rk.coupled is not None:  # a seeded request proposes the draw of its own tape (see `_couple`)
                e = rng.exponential(rng.keys(rk.seed, rk.pos, rng.STREAM_TOKEN, 0), qt.shape[1])
                d = torch.where(rk.coupled, (qt / e).argmax(-1), d)
            st.set_draft_q(rpi, k, qt)
        st.set_drafts(rpi, k, d, live)
        return d

    # --- the depth of each iteration (the speculation policy) and the draft layers' catch-up ---------
    def plan(self, reqs: list[Req]) -> StepPlan:
        """The policy's depth for an iteration over `reqs`, and who must catch up before it: a request
        whose first S' layers are not current, or whose positions since its draft KV was last complete
        would overflow the hidden-state ring before the next launch. A draft fill a prefill-only step
        left runs first: who is behind depends on it."""
        self._flush_fill()
        if self._held is not None:
            return self._held
        d = self.policy.choose(len(reqs), any(r.constraint is not None for r in reqs))
        return StepPlan(d.depth, d.reason, d.predicted_gain, self._behind(reqs, d.depth))

    def hold(self, plan: StepPlan) -> None:
        """Keep a plan the scheduler did not launch (it needs a catch-up, so no iteration in flight): the
        next launch runs it, so the policy is asked once per iteration."""
        self._held = plan

    def _behind(self, reqs: list[Req], depth: int) -> list[Req]:
        """The requests whose first `depth` draft layers are not current (they catch up first)."""
        if not self.drafting:
            return []
        return [r for r in reqs if r.draft_state is not None and r.draft_state.depth < depth]

    def launch(self, reqs: list[Req], plan: StepPlan | None = None) -> Pending:
        self._flush_fill()
        plan = plan if plan is not None else self.plan(reqs)
        self._held = None
        catch = self._behind(reqs, plan.depth)
        if catch:
            self.catch_up(catch)
        self.depth = plan.depth
        for r in reqs:
            if r.draft_state is not None:
                r.draft_state.depth = min(r.draft_state.depth, plan.depth)
        p = super().launch(reqs, plan)
        p.plan = dataclasses.replace(plan, catch_up=catch)
        return p

    def launch_split(self, reqs: list[Req], plan: StepPlan | None = None) -> SplitLaunch | None:
        """A grammar-masked iteration in two halves, at the policy's depth (none when its draft layers
        must catch up first: that reads host lengths)."""
        self._flush_fill()
        plan = plan if plan is not None else self.plan(reqs)
        s = super().launch_split(reqs, plan)
        if s is not None:
            self._held = None
            for r in reqs:
                if r.draft_state is not None:
                    r.draft_state.depth = min(r.draft_state.depth, plan.depth)
        return s

    def catch_up(self, reqs: list[Req], bonus: list[int] | torch.Tensor | None = None, measure: bool = True,
                 fresh: bool = False) -> None:
        """Bring every draft layer of `reqs` current: a batched draft extend (in groups that fit the
        draft runners' prefill graphs, `_fill_groups`) over the positions whose
        draft KV is missing ([valid, kv_len): decoded by shallower iterations, or a prompt whose draft
        prefill was put off, or cached positions another request left without it), from the target
        hidden states in the pool, exactly as a draft prefill fills the draft pools (and, like one,
        making the first drafts). `bonus` is each request's next input token (default: its last
        output). Host-described: no iteration may be in flight, unless the requests are `fresh` (their
        prefill just completed: no iteration in flight holds them, and the host's lengths are exact)."""
        if self.inflight and not fresh:
            raise RuntimeError("a draft catch-up needs the host's KV lengths: finish the iteration in flight first")
        assert self.hpool is not None
        # The default bonus, each request's last output, is the slot state's last token (with no
        # iteration in flight, or for a fresh request's first token).
        last_tok = bonus is None or isinstance(bonus, torch.Tensor)
        nxt = bonus if bonus is not None else [r.fill_ids[r.kv_len] for r in reqs]
        todo = [i for i, r in enumerate(reqs) if r.kv_len > r.draft_state.valid]
        for r in reqs:
            r.draft_state.depth = self.steps  # current once this returns (nothing to do for some)
        if not todo:
            return
        t0 = time.perf_counter()
        total = 0
        for group in self._fill_groups([reqs[i].kv_len - reqs[i].draft_state.valid for i in todo]):
            idx = [todo[g] for g in group]
            rs = [reqs[i] for i in idx]
            b: list[int] | torch.Tensor
            if isinstance(nxt, torch.Tensor):
                b = nxt if len(idx) == len(reqs) else nxt[torch.tensor(idx).to(nxt.device, non_blocking=True)]
            else:
                b = [nxt[i] for i in idx]
            starts = [r.draft_state.valid for r in rs]
            lens = [r.kv_len - v for r, v in zip(rs, starts)]
            self._draft_fill(rs, starts, lens, b, None, last_tok)
            total += sum(lens)
        if not measure:  # a put-off draft prefill, not a switch's cost
            return
        st = self.policy.stats
        st.catch_ups += 1
        st.catch_up_positions += total
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a measurement, and the catch-up is a sync point anyway
        dt = time.perf_counter() - t0
        st.catch_up_s += dt
        self.policy.observe_catch_up(dt)
        self._last_done = None  # the next iteration's interval holds this catch-up

    def _fill_groups(self, lens: list[int]) -> list[list[int]]:
        """Requests (by index) in groups whose draft fill each fits the draft runners' prefill graphs
        (their largest token bucket and request slots), in order: a catch-up after a long stretch of
        plain steps covers every running request's positions since, which one forward would run
        eagerly. A request longer than the largest bucket goes alone (eagerly)."""
        g = self.drafts[0].extend_graphs
        if not isinstance(g, ExtendGraphRunner) or not g.buckets:
            return [list(range(len(lens)))]
        out: list[list[int]] = []
        cur: list[int] = []
        t = 0
        for i, n in enumerate(lens):
            if cur and g.bucket(t + n, len(cur) + 1) is None:  # the group with it would not replay
                out.append(cur)
                cur, t = [], 0
            cur.append(i)
            t += n
        return [*out, cur] if cur else out

    def _keep_hidden(self, batch: ForwardBatch, out: ForwardOutput) -> None:
        """Every target forward's hidden states into the pool at its KV slots (a prefill's, a decode
        step's, every verify row), for a later catch-up; padded rows write the pad slot."""
        if self.hpool is None:
            return
        loc = batch.out_cache_loc
        self.hpool[loc] = out.hidden[: loc.shape[0]].to(self.hpool.dtype)

    def _cached_draft_valid(self, r: Req) -> int:
        """How much of a request's cached prefix every draft layer holds: the cache keeps all of a
        request's target KV, and `draft_ok` marks the slots whose draft KV its owner completed."""
        n = r.cached_len
        if n == 0:
            return 0
        ok = self.draft_ok[page_slots(r.pages, self.page_size, n)]
        return n if ok.all() else int(np.argmin(ok))

    def forget_pages(self, pages: list[int]) -> None:
        """Pages (re)allocated to a request: nothing in their draft KV is valid yet."""
        if self.hpool is not None and pages:
            self.draft_ok[page_slots(pages, self.page_size)] = False

    def release(self, req: Req) -> None:
        """Mark the slots whose draft KV the request completed (below its `valid`), so a request that
        hits them in the prefix cache knows it need not catch them up; then drop its state (and a draft
        prefill it left for later: a request that ended at its first token never needs one)."""
        if self._fill_later:
            self._fill_later = [r for r in self._fill_later if r is not req]
        ds = req.draft_state
        if self.hpool is not None and ds is not None and req.pages and ds.valid > 0:
            n = min(ds.valid, len(req.pages) * self.page_size)
            self.draft_ok[page_slots(req.pages, self.page_size, n)] = True
        super().release(req)

    # --- decode iteration ----------------------------------------------------------------------
    def _body(self, rpi: torch.Tensor, live: torch.Tensor | None, flags: RowFlags, host: HostView, eager: bool,
              timer: Timer | None) -> tuple[torch.Tensor, list[RowMeta]]:
        """Verify, accept, commit and draft-extend on the device, at the iteration's depth S' (`depth`;
        0 is the target-only decode step); returns (packed result, each forward's row metadata).
        `eager` runs every forward eagerly (inside a whole-iteration capture); `live` masks padded rows
        out of every state write."""
        if self.depth == 0:
            return super()._body(rpi, live, flags, host, eager, timer)  # keeps the hidden states too
        view, drafts = self._verify_view(rpi, host)
        vb = self.target.bind(view)
        self.forwards = []
        out = self._forward(self.target, vb, eager)
        self._keep_hidden(vb, out)
        metas = [self.target.row_meta(vb)]
        st = self.state
        w, bs = self.width, int(rpi.shape[0])
        if flags.plain and flags.logprobs < 0:  # the common case: fused accept + commit + pack on CUDA
            emitted, n, packed, sel = st.verify_greedy(out.logits, w, rpi, live, self._forced())
        else:
            emitted, n, packed = self._accept(out.logits, rpi, live, flags, drafts, w)
            sel = torch.arange(bs, device=self.device) * w + n
        if timer is not None:
            timer.mark()
        # Draft-extend over the same rows. Rows past a request's last accepted row carry the target's
        # guesses; their KV lands at positions >= the new kv_len, which the next iteration rewrites.
        dview = dataclasses.replace(view, mode=ForwardMode.DRAFT_EXTEND, logit_rows=sel, pruned=True)
        metas += self._draft_extend(rpi, dview, out.hidden, emitted, n, flags, timer, live, eager)
        return packed, metas

    def _verify_view(self, rpi: torch.Tensor, host: HostView) -> tuple[ForwardBatch, torch.Tensor]:
        """The iteration's verify view over [bonus, d1..dS'] per request, from the slot state, and the drafts."""
        st = self.state
        w, bs = self.width, int(rpi.shape[0])
        drafts = st.drafts[rpi][:, : self.depth]  # [bs, S']
        ids = torch.cat([st.last_tok[rpi].view(-1, 1), drafts], dim=1)
        return self.view(ForwardMode.TARGET_VERIFY, rpi, ids, w, self._arange(bs * w), host), drafts

    # --- a grammar-masked drafting iteration under graphs (`masked_chain`) -------------------------
    def _masked_pieces(self, fwd: IterationGraph, pool: object | None, cuda: bool) -> list[IterationGraph] | None:
        """After the verify forward: accept, then each draft step's forward and its masked select, as
        a chain of graphs (`MaskedChain`). A constrained batch runs depth 0 or S, so none in between."""
        if self.depth == 0:
            return super()._masked_pieces(fwd, pool, cuda)
        if self.depth != self.steps:
            return None
        self._mhidden = torch.zeros(fwd.buckets[-1] * self.width, self._layer(0).hidden_in_size,
                                    dtype=self.hidden_dtype, device=self.device)
        self.masked_chain = MaskedChain(self, fwd, pool, emulate=not cuda)
        return self.masked_chain.pieces

    def _masked_forward(self, rpi: torch.Tensor) -> tuple[torch.Tensor, list[RowMeta]]:
        """The verify forward: its logits into `_mlogits`, its hidden states into `_mhidden`."""
        if self.depth == 0:
            return super()._masked_forward(rpi)
        assert self._mlogits is not None and self._mhidden is not None
        view, _ = self._verify_view(rpi, self.capture_view(int(rpi.shape[0])))
        vb = self.target.bind(view)
        self.forwards = []
        out = self._forward(self.target, vb, True)
        self._keep_hidden(vb, out)
        n = vb.num_tokens
        self._mlogits[:n].copy_(out.logits)
        self._mhidden[:n].copy_(out.hidden)
        return self._mlogits[:n].view(vb.bs, self.width, -1), [self.target.row_meta(vb)]  # a row per request

    def _complete_masked(self, s: SplitLaunch) -> Pending:
        if self.depth == 0:
            return super()._complete_masked(s)
        assert self.masked_chain is not None
        return self.masked_chain.run(s)

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
        ar = st.arange(w).view(1, w)
        if flags.all_greedy:
            n = accepted(drafts, pred)
            final = pred.gather(1, n.view(-1, 1)).view(-1)
        else:
            assert rows is not None
            n, final = self._reject(x, rows, drafts, pred, rpi, bs, w)
        forced = self._forced()
        if forced is not None:  # measurement only: every request accepts the forced count
            n = forced.clamp(max=s).expand(bs)
            final = pred.gather(1, n.reshape(-1, 1)).view(-1)
        # Accepted drafts (equal to the target's argmax where greedy), the final token at row n, and the
        # target's guesses after it.
        emitted = torch.where(ar < n.view(-1, 1), torch.cat([drafts, drafts[:, -1:]], 1), pred)
        emitted = emitted.scatter(1, n.view(-1, 1), final.view(-1, 1))
        n_emit = n + 1
        lp = logprobs(logits, emitted.reshape(-1), max(flags.logprobs, 0)) if flags.logprobs >= 0 else None
        st.commit(rpi, emitted, n_emit, flags, live=live, iteration=True)
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
        q = st.draft_q[rpi][:, :s]  # [bs, S', V]
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
        if rows.coupled is not None:
            n, final = self._couple(p, rows, drafts, n, final, bs, w)
        return n, final

    @staticmethod
    def _couple(p: torch.Tensor, rows: SamplingRows, drafts: torch.Tensor, n: torch.Tensor, final: torch.Tensor,
                bs: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Seeded sampled requests: the token at output position o is the target-only draw of the
        request's tape, argmax p_o / E(seed, o) (the exponential race of `sampler.draw`, iteration 0);
        a draft is accepted while it equals that draw. Each token is then an exact sample of the target
        given its prefix, and the output is the one target-only sampling makes with the same seed,
        whatever the drafts were (so whatever the prefix cache handed the draft layers and whatever
        the batch held). It costs acceptance against rejection sampling, which the others keep."""
        s, v = w - 1, p.shape[2]
        e = rng.exponential(rng.keys(rows.seed, rows.pos, rng.STREAM_TOKEN, 0), v).view(bs, w, v)
        tape = (p / e).argmax(-1)  # [bs, W]: the target-only draw at each verify row's position
        nc = (drafts == tape[:, :s]).to(torch.int64).cumprod(1).sum(1)
        fc = tape.gather(1, nc.view(-1, 1)).view(-1)
        assert rows.coupled is not None
        c = rows.coupled.view(bs, w)[:, 0]
        return torch.where(c, nc, n), torch.where(c, fc, final)

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
        metas = []
        for k, runner in enumerate(self.drafts[: self.depth]):
            b = dataclasses.replace(view, input_ids=ids.reshape(-1), hidden_in=h, binding=runner.binding)
            o = self._forward(runner, b, eager)
            metas.append(runner.row_meta(b))
            logits = o.logits
            if flags.constrained:  # constrain: draft k proposes only what the grammar allows
                logits = self.constrain.draft_logits(logits, k, self._layer(k).head.vocab_ids)
            if flags.all_greedy:  # argmax, vocabulary map, state write and window rotate (fused on CUDA)
                d, ids = self.state.draft_greedy(logits, self._layer(k).head.vocab_ids, rpi, k, live, ids, n)
            else:
                d = self._draft_tokens(rpi, logits, k, flags, rows, live)
                ids = rotate(ids, n, d)  # every window shifts left, the new draft at the last accepted row
            if flags.constrained:  # constrain: the matchers take the draft tentatively
                self.constrain.draft_accept(d, k)
            if timer is not None:
                timer.mark()
            h = o.hidden if self.chain else target_hidden
        return metas

    def _layer_spans(self, spans: list[float]) -> list[float]:
        """Each draft step's time from an iteration's timer spans (verify first, then one per step)."""
        return spans[1:]

    def stale_positions(self, n: int, depth: int | None = None) -> int:
        """Boundary KV left stale by an iteration that accepted n drafts: layer k at position p reads
        t_{p+k+1}, so of the n+1 committed rows (0..n), rows n-k+1..n read tokens not yet verified (new
        drafts): min(k, n+1) positions per layer that ran (the first `depth`, all S by default)."""
        return sum(min(k, n + 1) for k in range(self.steps if depth is None else depth))

    def on_finish(self, p: Pending, res: list[StepResult]) -> None:
        """Host accounting once the iteration's counts are back: per request and global statistics."""
        rows = p.packed.tolist()
        acc = [int(row[p.width]) - 1 for row in rows]
        depth = p.width - 1
        now = time.perf_counter()
        # The policy's clock: the wall time between two iterations' ends (in overlap the device time of
        # this one, else its launch, forwards and the host's bookkeeping), less the prefills that ran in
        # between (a mixed step's ran on the stream behind the iteration before this one).
        pre, left = 0.0, []
        for t, drafted in self._prefill_timers:
            if not t.ready():
                left.append((t, drafted))
                continue
            marks = t.spans()
            pre += sum(marks)
            if drafted:
                self.stats.draft_time_s += marks[-1]
        self._prefill_timers = left
        dt = now - self._last_done - pre if self._last_done is not None else None
        self._last_done = now
        if dt is not None and dt <= 0:
            dt = None
        self.policy.observe(len(p.reqs), depth, [a for a, out in zip(acc, res) if out.tokens], dt, p.flags.constrained)
        if depth == self.steps:  # every draft layer ran over the committed positions
            for r, out in zip(p.reqs, res):
                if out.tokens and r.draft_state is not None:
                    r.draft_state.valid = r.kv_len
        if depth == 0:  # a plain decode step: nothing drafted, nothing to count as speculation
            return
        spans = p.timer.spans()
        verify_s = spans[0] if spans else 0.0
        layer = self._layer_spans(spans)
        draft_s = sum(layer)
        self.layer_times = list(layer)
        self.last = IterationStats(len(p.reqs), acc, verify_s, draft_s, list(layer))
        s, st = self.steps, self.stats
        st.num_verify += len(p.reqs)
        st.verify_time_s += verify_s
        st.draft_time_s += draft_s
        v, d = verify_s / len(p.reqs), draft_s / len(p.reqs)
        stale: dict[int, int] = {}  # stale boundary positions by accepted count
        n_drafted = n_accepted = n_stale = 0
        per_depth = [0] * s
        for r, n, out in zip(p.reqs, acc, res):
            if not out.tokens:  # preempted or finished since the launch: not an iteration of it
                continue
            sp = r.spec
            if sp is None:
                sp = r.spec = SpecCounts(s)
            sp.num_verify += 1
            sp.num_draft_tokens += depth
            sp.num_accepted_tokens += n
            sp.verify_time_s += v
            sp.draft_time_s += d
            n_drafted += depth
            n_accepted += n
            for j in range(n):
                sp.accepted_per_depth[j] += 1
                per_depth[j] += 1
            k = stale.get(n)
            if k is None:
                k = stale[n] = self.stale_positions(n, depth)
            n_stale += k
        # The engine's totals once per iteration: a pydantic model's attribute sets are not free.
        st.num_draft_tokens += n_drafted
        st.num_accepted_tokens += n_accepted
        for j, c in enumerate(per_depth):
            st.accepted_per_depth[j] += c
        self.boundary_kv_stale_positions += n_stale

    def reset_counters(self, keep_policy_costs: bool = False) -> None:
        super().reset_counters()
        if self.fill_graph is not None:
            self.fill_graph.stats.replays.clear()
        self.stats = SpecStats(accepted_per_depth=[0] * self.steps)
        self.boundary_kv_stale_positions = 0
        self.policy.reset(keep_policy_costs)
        self._last_done = None
        self._prefill_timers = []

    def kv_valid_len(self, req: Req) -> int:
        """Draft pools are filled when a request's prefill completes: until then only its cached prefix
        is valid in every runner. After that every position below the draft layers' `valid` is (stale
        policy: as written); positions decoded by shallower iterations since are not, until a catch-up.
        With the policy off the draft pools are never read: the target's KV is all there is."""
        if req.prefilling:
            return req.cached_len
        if not self.drafting or req.draft_state is None or self.hpool is not None:
            return req.kv_len  # with the hidden-state pool, `draft_ok` says how much draft KV is valid
        return min(req.kv_len, req.draft_state.valid)
