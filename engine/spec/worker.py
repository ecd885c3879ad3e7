"""The speculative worker: verify → accept → draft-extend, with one runner per draft step.

Each draft runner k owns layer k's weights, its own KV pool, request-to-token map and attention
backend (see `ModelRunner`); the worker composes them. One iteration for a batch of bs requests,
W = S+1 rows each:

1. verify: TARGET_VERIFY over [bonus, d1..dS] at positions kv_len..kv_len+S (bs·W logit rows).
2. accept: greedy match against the target's (penalised) argmax, or Leviathan/Chen rejection
   sampling with the draft's distributions; row j's penalties see the output plus d1..dj, so
   penalties stay exact. Logprobs of emitted tokens come from these target logits.
3. draft-extend: for k = 0..S-1 one DRAFT_EXTEND over the same W rows per request, derived from one
   immutable view with `dataclasses.replace` (only input ids, input hidden and binding change),
   logits pruned to each request's last accepted row; the ids window is rotated left by one and the
   new draft written at that row before the next step.

Prefill runs the target (possibly in chunks, stashing its hidden states), and when a request's
prefill completes, each draft runner k runs over the whole sequence, filling its own pool.

Boundary-KV policy: **accept the staleness** (as SGLang does for MiMo-style stacks). After an
iteration accepting n drafts, layer k's KV at the last k committed positions was computed from
tokens that were drafts at the time; where the next verify rejects those drafts that KV stays
stale. It can lower acceptance, never change output (the target verifies every token).
`boundary_kv_stale_positions` counts such positions so the cost is observable.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from mleagle.engine.contract.outputs import SpecStats
from mleagle.engine.core.request import Req
from mleagle.engine.executor.forward_batch import ForwardBatch, ForwardMode, build_batch
from mleagle.engine.executor.runner import ModelRunner
from mleagle.engine.executor.worker import StepResult, TargetWorker, row_info
from mleagle.engine.sampling import rng
from mleagle.engine.sampling.processor import probs_from_logits
from mleagle.engine.sampling.sampler import logprobs_of, processed_logits


@dataclass
class DraftState:
    drafts: list[int] = field(default_factory=list)  # d1..dS following the bonus (output_ids[-1])
    q: torch.Tensor | None = None  # [S, V] draft distributions, for sampled requests
    hidden_stash: list[torch.Tensor] = field(default_factory=list)  # target hidden per prefill chunk
    iters: int = 0  # verify iterations so far: part of the random key, so re-drafted positions get fresh noise


@dataclass
class IterationStats:
    """What the last decode iteration did (for events and benchmarks)."""

    bs: int = 0
    accepted: list[int] = field(default_factory=list)  # accepted drafts per request
    verify_s: float = 0.0
    draft_s: float = 0.0
    draft_layer_s: list[float] = field(default_factory=list)  # wall time of each draft step's forward


class SpecWorker(TargetWorker):
    def __init__(self, target: ModelRunner, drafts: list[ModelRunner], chain: bool, steps: int,
                 device: torch.device | str = "cpu", eos_ids: frozenset[int] = frozenset(),
                 boundary_kv: str = "stale"):
        super().__init__(target, device, eos_ids)
        if boundary_kv not in ("stale", "recompute"):
            raise ValueError(f"boundary_kv must be 'stale' or 'recompute', not {boundary_kv!r}")
        self.boundary_kv = boundary_kv
        if not 1 <= steps <= len(drafts):
            raise ValueError(f"spec steps {steps} must be in 1..{len(drafts)} (the draft's layers)")
        self.drafts = drafts[:steps]
        self.chain, self.steps = chain, steps
        self.lookahead = steps + 1
        self.stats = SpecStats(accepted_per_depth=[0] * steps)
        self.last = IterationStats()
        self.boundary_kv_stale_positions = 0
        self.step_batches: list[ForwardBatch] = []  # the last iteration's per-step draft batches (tests)
        self.layer_times: list[float] = []  # the last draft-extend's per-step forward times

    @property
    def runners(self) -> list[ModelRunner]:
        return [self.target, *self.drafts]

    # --- prefill ------------------------------------------------------------------------------
    def prefill(self, reqs: list[Req], chunks: list[int]) -> list[StepResult]:
        batch = self.prefill_batch(reqs, chunks)
        out = self.target.forward(batch)
        self.last_batch = batch
        off = 0
        for r, c in zip(reqs, chunks):
            if r.draft_state is None:
                r.draft_state = DraftState()
            r.draft_state.hidden_stash.append(out.hidden[off : off + c])
            off += c
        results = self.finish_prefill(reqs, chunks, batch, out)
        done = [i for i, r in enumerate(reqs) if not r.prefilling]
        if done:
            t0 = time.perf_counter()
            bonus = [results[i].tokens[0] if results[i].tokens else reqs[i].output_ids[-1] for i in done]
            self._draft_prefill([reqs[i] for i in done], bonus)
            self.stats.draft_time_s += time.perf_counter() - t0
        return results

    def _draft_prefill(self, reqs: list[Req], bonus: list[int]) -> None:
        """Each draft runner over the whole sequence of each request: layer k at position p reads
        t_{p+k+1}, so its ids are the sequence shifted by k+1 (bonus and fresh drafts at the end)."""
        lens = [r.kv_len for r in reqs]
        toks = [r.fill_ids[: r.kv_len] + [b] for r, b in zip(reqs, bonus)]
        view = build_batch(ForwardMode.EXTEND, input_ids=[0] * sum(lens), req_pool_indices=[r.req_pool_idx for r in reqs],  # type: ignore[misc]
                           prefix_lens=[0] * len(reqs), extend_lens=lens,
                           req_to_token=self.target.binding.req_to_token.req_to_token, device=self.device,
                           rids=tuple(r.rid for r in reqs))
        target_hidden = torch.cat([torch.cat(r.draft_state.hidden_stash) for r in reqs])
        if self.boundary_kv == "stale":
            for r in reqs:
                r.draft_state.hidden_stash = []
        else:  # "recompute" keeps every committed position's target hidden for the next full pass
            for r, n in zip(reqs, lens):
                r.draft_state.hidden_stash = [torch.cat(r.draft_state.hidden_stash)[:n]]
        h = target_hidden
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        self.step_batches = []
        for k, runner in enumerate(self.drafts):
            ids = torch.tensor([t for tk, n in zip(toks, lens) for t in tk[k + 1 : k + 1 + n]], dtype=torch.int64)
            b = dataclasses.replace(view, input_ids=ids.to(self.device), hidden_in=h, binding=runner.binding)
            self.step_batches.append(b)
            o = runner.forward(b)
            d, q = self._draft_tokens(reqs, o.logits, k)
            for i, tk in enumerate(toks):
                tk.append(d[i])
                if q is not None and q[i] is not None:
                    qs[i].append(q[i])
            h = o.hidden if self.chain else target_hidden
        for i, r in enumerate(reqs):
            r.draft_state.drafts = toks[i][lens[i] + 1 :]
            r.draft_state.q = torch.stack(qs[i]) if qs[i] else None

    def _draft_tokens(self, reqs: list[Req], logits: torch.Tensor, k: int) -> tuple[list[int], list[torch.Tensor | None] | None]:
        """Draft k+1 per request from the draft's logits: argmax for greedy requests, a sample from
        the processed draft distribution q (kept for rejection sampling) otherwise. The logits are
        over the draft vocabulary; `head` maps indices to target ids and q back to the target's."""
        head = self.drafts[k].model.head
        if all(r.params.greedy for r in reqs):
            return head.to_target_ids(logits.argmax(-1)).tolist(), None
        probs = probs_from_logits(logits, [r.params for r in reqs])
        toks: list[int] = []
        qs: list[torch.Tensor | None] = []
        for i, r in enumerate(reqs):
            if r.params.greedy:
                toks.append(int(head.to_target_ids(logits[i].argmax())))
                qs.append(None)
                continue
            st: DraftState = r.draft_state
            pos = r.kv_len - len(r.prompt_ids) + 1 + k  # output index this draft proposes (the bonus sits at kv_len)
            e = rng.exponential(r.seed, pos, probs.shape[1], rng.STREAM_DRAFT, st.iters).to(logits.device)
            toks.append(int(head.to_target_ids((probs[i] / e).argmax())))
            qs.append(head.scatter_probs(probs[i]))
        return toks, qs

    # --- decode iteration ----------------------------------------------------------------------
    def decode(self, reqs: list[Req]) -> list[StepResult]:
        w, bs = self.steps + 1, len(reqs)
        t0 = time.perf_counter()
        prefix = [r.kv_len for r in reqs]
        ids = [t for r in reqs for t in [r.output_ids[-1], *r.draft_state.drafts]]
        view = build_batch(ForwardMode.TARGET_VERIFY, input_ids=ids, req_pool_indices=[r.req_pool_idx for r in reqs],  # type: ignore[misc]
                           prefix_lens=prefix, extend_lens=[w] * bs, width=w,
                           req_to_token=self.target.binding.req_to_token.req_to_token, device=self.device,
                           rids=tuple(r.rid for r in reqs))
        vb = self.target.bind(view)
        out = self.target.forward(vb)
        self.last_batch = vb
        results: list[StepResult] = []
        predict = out.logits.argmax(-1).view(bs, w).tolist()
        accepted: list[int] = []
        for i, r in enumerate(reqs):
            emitted = self._accept(r, out.logits[i * w : (i + 1) * w])
            n = len(emitted) - 1
            accepted.append(n)
            predict[i][: n + 1] = emitted
            lps = logprobs_of(out.logits[i * w : i * w + n + 1], emitted, [r.params.logprobs] * (n + 1))
            results.append(StepResult(emitted, lps if r.params.logprobs is not None else None))  # type: ignore[arg-type]
        t1 = time.perf_counter()
        # Draft-extend over the same rows. Rows past a request's last accepted row carry the target's
        # guesses; their KV lands at positions >= the new kv_len, which the next iteration rewrites.
        sel = [i * w + n for i, n in enumerate(accepted)]
        flat = torch.tensor([t for row in predict for t in row], dtype=torch.int64)
        dview = build_batch(ForwardMode.DRAFT_EXTEND, input_ids=flat, req_pool_indices=[r.req_pool_idx for r in reqs],  # type: ignore[misc]
                            prefix_lens=prefix, extend_lens=[w] * bs, width=w, pruned_rows=sel,
                            req_to_token=self.target.binding.req_to_token.req_to_token, device=self.device,
                            rids=tuple(r.rid for r in reqs))
        for r, n, res in zip(reqs, accepted, results):
            r.kv_len += n + 1
            # Temporarily extend output so draft positions/penalty contexts count the emitted tokens.
            r.output_ids.extend(res.tokens)
        try:
            if self.boundary_kv == "stale":
                self._draft_extend(reqs, dview, out.hidden, flat, sel)
            else:
                # Reference policy: every draft layer re-runs over the whole committed sequence, so
                # no layer keeps KV computed from drafts. O(sequence) per iteration: for measuring
                # what the stale policy costs in acceptance, not for serving.
                for i, (r, n) in enumerate(zip(reqs, accepted)):
                    r.draft_state.hidden_stash.append(out.hidden[i * w : i * w + n + 1])
                    r.draft_state.iters += 1
                t_d = time.perf_counter()
                self._draft_prefill(reqs, [res.tokens[-1] for res in results])
                self.layer_times = [(time.perf_counter() - t_d) / self.steps] * self.steps
        finally:
            for r, res in zip(reqs, results):
                del r.output_ids[len(r.output_ids) - len(res.tokens) :]
        t2 = time.perf_counter()
        self._account(reqs, accepted, t1 - t0, t2 - t1)
        return results

    def _draft_extend(self, reqs: list[Req], view: ForwardBatch, target_hidden: torch.Tensor,
                      ids: torch.Tensor, sel: list[int]) -> None:
        h = target_hidden
        sel_t = torch.tensor(sel, dtype=torch.int64, device=ids.device)
        new: list[list[int]] = [[] for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        self.step_batches = []
        for r in reqs:
            r.draft_state.iters += 1
        self.layer_times = []
        for k, runner in enumerate(self.drafts):
            t0 = time.perf_counter()
            b = dataclasses.replace(view, input_ids=ids.to(self.device), hidden_in=h, binding=runner.binding)
            self.step_batches.append(b)
            o = runner.forward(b)
            d, q = self._draft_tokens(reqs, o.logits, k)
            self.layer_times.append(time.perf_counter() - t0)
            for i in range(len(reqs)):
                new[i].append(d[i])
                if q is not None and q[i] is not None:
                    qs[i].append(q[i])
            # Rotate: every window shifts left by one, and the new draft goes at the last accepted row.
            ids = torch.cat([ids[1:], ids[-1:]])
            ids[sel_t] = torch.tensor(d, dtype=torch.int64)
            h = o.hidden if self.chain else target_hidden
        for i, r in enumerate(reqs):
            r.draft_state.drafts = new[i]
            r.draft_state.q = torch.stack(qs[i]) if qs[i] else None

    def _accept(self, r: Req, logits: torch.Tensor) -> list[int]:
        """Tokens emitted for one request from its W verify rows: accepted drafts, then one more."""
        st: DraftState = r.draft_state
        drafts = st.drafts
        s = len(drafts)
        infos = [row_info(r, drafts[:j], self.eos_ids) for j in range(s + 1)]
        x = processed_logits(logits, infos)
        if r.params.greedy:
            pred = x.argmax(-1).tolist()
            n = 0
            while n < s and drafts[n] == pred[n]:
                n += 1
            return drafts[:n] + [pred[n]]
        p = probs_from_logits(x, [r.params] * (s + 1))
        o = len(r.output_ids)  # row j decides output index o + j
        for j in range(s):
            d = drafts[j]
            qd = float(st.q[j, d]) if st.q is not None else 1.0
            pd = float(p[j, d])
            u = rng.uniform(r.seed, o + j, rng.STREAM_ACCEPT, st.iters)
            if qd > 0 and u * qd < pd:  # accept with probability min(1, p/q)
                continue
            res = torch.clamp(p[j] - (st.q[j] if st.q is not None else 0), min=0)
            if float(res.sum()) <= 0:
                res = p[j]
            e = rng.exponential(r.seed, o + j, res.shape[0], rng.STREAM_RESIDUAL, st.iters).to(logits.device)
            return drafts[:j] + [int((res / e).argmax())]
        e = rng.exponential(r.seed, o + s, p.shape[1], rng.STREAM_TOKEN, st.iters).to(logits.device)
        return drafts + [int((p[s] / e).argmax())]

    def _account(self, reqs: list[Req], accepted: list[int], verify_s: float, draft_s: float) -> None:
        s = self.steps
        self.last = IterationStats(len(reqs), accepted, verify_s, draft_s, list(self.layer_times))
        self.stats.num_verify += len(reqs)
        self.stats.verify_time_s += verify_s
        self.stats.draft_time_s += draft_s
        for r, n in zip(reqs, accepted):
            if r.spec is None:
                r.spec = SpecStats(accepted_per_depth=[0] * s)
            sp = r.spec
            sp.num_verify += 1
            sp.num_draft_tokens += s
            sp.num_accepted_tokens += n
            sp.verify_time_s += verify_s / len(reqs)
            sp.draft_time_s += draft_s / len(reqs)
            self.stats.num_draft_tokens += s
            self.stats.num_accepted_tokens += n
            for j in range(n):
                sp.accepted_per_depth[j] += 1
                self.stats.accepted_per_depth[j] += 1
            # Layer k at position p reads t_{p+k+1}: of the n+1 committed rows (0..n), rows n-k+1..n
            # read tokens not yet verified (new drafts), so min(k, n+1) positions per layer; count them.
            if self.boundary_kv == "stale":
                self.boundary_kv_stale_positions += sum(min(k, n + 1) for k in range(s))

    def release(self, req: Req) -> None:
        req.draft_state = None


def build_spec_worker(engine: object) -> SpecWorker:
    """Build the draft stack named by `engine.cfg.engine.draft` and one runner per step, each with its
    own one-layer KV pool, request-to-token map and backend, registered with the memory manager."""
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
    vocab_ids = None
    if kind == "random":
        layers = [random_layer_weights(arch, seed, k) for k in range(s or 0)]
        darch = arch
    else:
        try:
            ck = load_draft(ecfg.draft, arch)
            darch, chain, layers, vocab_ids = ck.arch, ck.chain, ck.layers, ck.vocab_ids
        except (FileNotFoundError, ValueError) as err:
            raise EngineInputError(str(err)) from err
        if darch.hidden_size != arch.hidden_size or darch.vocab_size != arch.vocab_size:
            raise EngineInputError(f"draft {ecfg.draft}: hidden/vocab ({darch.hidden_size}/{darch.vocab_size}) do not "
                                   f"match the target ({arch.hidden_size}/{arch.vocab_size})")
    steps = ecfg.spec_steps or min(len(layers), MAX_SPEC_STEPS)
    if steps > len(layers):
        raise EngineInputError(f"--spec-steps {steps} exceeds the draft's {len(layers)} layers")
    model = e.model  # type: ignore[attr-defined]
    try:
        stack = DraftStack(darch, len(layers), chain, e.dtype, model.embed_tokens, model.lm_head, model.rope,  # type: ignore[attr-defined]
                           vocab_ids=vocab_ids)
    except ValueError as err:
        raise EngineInputError(f"draft {ecfg.draft}: {err}") from err
    for m, w in zip(stack.layers, layers):
        load_layer(m, {k: v.to(e.dtype) for k, v in w.items()})  # type: ignore[attr-defined]
    stack.to(e.device).eval()  # type: ignore[attr-defined]
    target = e.target  # type: ignore[attr-defined]
    runners = []
    for k in range(steps):
        r = build_runner(f"draft{k}", stack.layers[k], 1, target.binding.kv_pool.num_slots, darch, ecfg,
                         e.max_reqs, target.binding.req_to_token.max_context, e.dtype)  # type: ignore[attr-defined]
        e.mem.add_map(r.binding.req_to_token)  # type: ignore[attr-defined]
        runners.append(r)
    e.draft_stack = stack  # type: ignore[attr-defined]
    return SpecWorker(target, runners, chain, steps, e.device, frozenset(e.eos_ids),  # type: ignore[attr-defined]
                      boundary_kv=ecfg.boundary_kv)
