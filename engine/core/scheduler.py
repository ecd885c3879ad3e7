"""Continuous batching: the waiting queue, the running set, chunked prefill, admission and preemption.

Each `step` without an iteration in flight picks one forward: an EXTEND over prefill chunks when any
request needs prefill and the token budget and KV pool allow (prefill first, as in nano-vllm),
otherwise a decode step for every running request (with one in flight, see the mixed step below). A request is admitted only when its chunk fits in the pool with one decode step of
headroom left for the running set; when decode finds the pool short, unused cached prefixes are
evicted first, and only then are the most recently admitted requests preempted (their KV handed to
the prefix cache, their generated tokens kept) and resumed later by a prefill over prompt + output.
With the prefix cache, admission starts a request at the longest cached prefix of its tokens (locked
while it runs), and every ending inserts the KV that is valid in every runner into the cache before
unlocking. Nothing is lost: every request ends with a finish reason, and `release` gives back every
page and request slot whatever the ending. Stop conditions (EOS, stop ids, stop strings,
max new tokens, context limit) are applied to each step's new tokens, cutting exactly where the
first one holds, so several tokens arriving at once (speculation) end in the same place as one by one.

Overlap scheduling (on the GPU): a decode step is launched (`worker.launch`) and finished later
(`worker.finish`, which waits for its one result copy). While decoding is steady — no request to admit,
no abort, memory for every running request — the scheduler launches step N+1 before it finishes step N,
so the host's bookkeeping of N (stop checks, deltas, events) runs while the GPU computes N+1. A request
that N finishes is then also in N+1: its results there are dropped (its epoch changed) and it is
released at once (the device runs N+1 before anything queued later can reuse its slots). A step that
finds prefill work while N is in flight is a **mixed step**: the prefill (arrivals, or the next chunk of
a long prompt, on its prefill graph where it fits) runs behind N on the stream, then N+1 launches over
every decoding request, the ones whose prefill just completed included (their first tokens are on the
device already), and N is finished; only then does the host read the prefill's first tokens
(`settle_prefill`). Nothing in the step waits for the device before N+1 is queued, so an arrival costs
the decoding requests the prefill's own time, and the whole-iteration graph keeps running. With
`fuse_mixed_steps` (target-only, on by default), where the batch fits a prefill graph the mixed step is
one forward instead (`TargetWorker.launch_mixed`): N+1 is an EXTEND over the decoding requests' next
tokens (one-token extends, their ids taken on the device from N's commit, their KV lengths the host's
plus N's one token) and the arrivals' prompts, committed as an iteration and first tokens are (where
every row is plain greedy, all of it inside the prefill graph); the arrivals decode from N+2. It saves
the arrival's second forward; its first token comes out of N+1 rather than before it. Without fused
steps a target-only CUDA engine runs the prefill on a stream of its own instead
(`TargetWorker.prefill_stream`, `prefill_side_stream`): the prefill's scheduling (its KV pages' map
writes) and forward go there, beside N, and N+1 waits for them on the main stream. Since N may still
write the row and the KV slot after the last token of a request
it finishes, what such a request gives back is held until N has ended (`MemoryManager.hold_frees`:
`settle` after each finish, everything once nothing is in flight).
With a constrained request running, a grammar-masked iteration N+1 launches its forward half before
N is finished and the rest after (its masks need N's tokens in the matchers); other constrained
batches do not overlap. Anything else — preemption, an abort, an iteration whose draft layers must
first catch up (its host description needs the lengths step N sets) — first drains the step in flight.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mleagle.engine.constrain.runtime import settle
from mleagle.engine.contract.outputs import RequestOutput, StepOutput, TokenOutput
from mleagle.engine.core.request import Req, ReqState
from mleagle.engine.executor.results import FwdInfo, Pending, StepResult
from mleagle.engine.executor.worker import TargetWorker
from mleagle.engine.memory.manager import MemoryManager

StopCutFn = Callable[[Req, int], "tuple[int, str] | None"]


@dataclass
class StepReport:
    """What one step did, in host values, for whoever observes the engine (telemetry, benchmarks):
    the mode, its forwards (the prefill's, or those of the decode iteration whose results this step
    applied), that iteration (its counts and why it did not replay the whole-iteration graph), the
    prompt tokens prefilled, the requests added since the last step, and the step's host time. The
    iteration's plan (`finished.plan`: its draft depth, the speculation policy's reason and predicted
    gain, the requests that caught up first) rides on `finished`."""

    step: int = 0
    mode: str = "IDLE"  # EXTEND | DECODE | MIXED (a prefill and a decode iteration) | IDLE
    forwards: list[FwdInfo] = field(default_factory=list)
    finished: Pending | None = None
    prefill_tokens: int = 0
    added: list[tuple[str, int]] = field(default_factory=list)  # (rid, prompt tokens), set by the engine
    duration_s: float = 0.0
# A decoding request's KV grows in blocks of this many positions (while the pool has free pages), so
# most decode steps allocate nothing and write no slot map.
DECODE_GROW = 32


class Scheduler:
    def __init__(self, worker: TargetWorker, mem: MemoryManager, *, max_running: int, max_context: int,
                 chunk_size: int, max_prefill_tokens: int, eos_ids: set[int],
                 stop_cut: StopCutFn | None = None, overlap: bool = False, prefill_wait: int = 0):
        self.worker, self.mem = worker, mem
        self.max_running, self.max_context = max_running, max_context
        self.chunk_size, self.max_prefill_tokens = chunk_size, max_prefill_tokens
        self.eos_ids = eos_ids
        self.stop_cut = stop_cut
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_mixed = 0  # steps that prefilled beside an iteration in flight
        self.num_fused = 0  # ... of them, those whose prefill and decode rows ran as one forward
        # The decoding rows the iterations launched carried (a fused step's arrivals not counted; the
        # iterations themselves are `mem.launches`): rows per iteration is the batch the device ran, what
        # a served engine loses to requests on their way between the engine and the clients.
        self.iteration_rows = 0
        self.report = StepReport()  # the last step's
        self.pending: list[StepOutput] = []  # deltas produced outside the step's forward (errors)
        self.overlap = overlap
        self.prefill_wait = prefill_wait  # steps an arrival may wait to share its prefill (`_hold_arrivals`)
        self.num_held = 0  # steps that held arrivals back so (counted for the engine's stats)
        self.moves = 0  # changes of the running set (admitted, ended, preempted): observers skip unchanged steps
        self.inflight: Pending | None = None  # a decode step launched and not yet finished
        # Prefix cache, vLLM's counters: prompt tokens looked up and found, at first admission.
        self.prefix_queries = self.prefix_hits = 0

    # --- requests in and out ---------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.reqs[req.rid] = req
        req.queued_step = self.num_steps
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is not None and not req.finished:
            req.abort_requested = True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.inflight)

    def _finish(self, req: Req, reason: str, matched: int | str | None = None) -> None:
        req.state = ReqState.FINISHED
        req.finish_reason = reason  # type: ignore[assignment]
        req.matched_stop = matched
        self._release(req)
        if req in self.running:
            self.running.remove(req)
            self.moves += 1

    # --- one step ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        outputs: list[StepOutput] = []
        aborts = [r for r in list(self.waiting) + self.running if r.abort_requested]
        results: list[tuple[Req, StepResult]] = []
        rep = StepReport(step=self.num_steps)
        if self.inflight is not None:
            # Steady decoding: launch the next step first, then finish the one in flight.
            nxt = None
            split = None
            if self.overlap and not aborts and self._constrained():
                # A constrained request's next mask needs this step's tokens: a grammar-masked step
                # launches its forward half now and its masked half after the finish below.
                ready = self._decode_ready(self.worker.lookahead * 2) if not self._want_prefill() else None
                if ready:
                    plan = self.worker.plan(ready)
                    split = self.worker.launch_split(ready, plan)
                    if split is None:
                        self.worker.hold(plan)
                    else:  # its forward half is on the device: a launch (`complete` makes it a Pending)
                        self.mem.launches += 1
                        self.iteration_rows += len(ready)
            elif self.overlap and not aborts:
                # A mixed step: arrivals (or the next chunk of a long prompt) prefill first, behind the
                # iteration in flight, and the next iteration launches over every decoding request (the
                # new ones too), so an arrival costs the running requests its prefill, not a drain.
                # With a prefill stream (`TargetWorker.side`) the prefill, its KV pages' map writes
                # included, runs beside the iteration in flight, and the next one waits for it.
                with self.worker.prefill_stream():
                    batch = self._schedule_prefill() if self._want_prefill() else None
                    fused = False
                    if batch is not None:
                        reqs, chunks = batch
                        # With `fuse_mixed_steps`, the arrivals' prompts and the decoding rows' next tokens
                        # as one forward (the arrivals, still prefilling, are not in `ready` yet): they
                        # decode from the next. (Never with a prefill stream.)
                        ready = self._decode_ready(self.worker.lookahead * 2) if self.worker.fuse_mixed else None
                        fused = ready is not None and bool(ready) and self.worker.can_fuse(ready, reqs, chunks)
                        if fused:
                            assert ready is not None
                            nxt = self._launched(self.worker.launch_mixed(ready, self.inflight, reqs, chunks))
                            self.num_fused += 1
                        else:
                            results = list(zip(reqs, self.worker.prefill(reqs, chunks)))
                        rep.mode, rep.prefill_tokens = "MIXED", sum(chunks)
                        self.num_mixed += 1
                        rep.forwards = list(self.worker.forwards)
                ready = None if fused else self._decode_ready(self.worker.lookahead * 2)
                if ready:
                    plan = self.worker.plan(ready)
                    if plan.catch_up:  # the draft layers' catch-up reads host lengths: after this finish
                        self.worker.hold(plan)
                    else:
                        nxt = self._launched(self.worker.launch(ready, plan))
            done, self.inflight = self.inflight, nxt
            results += list(zip(done.reqs, self.worker.finish(done)))
            self.mem.settle(done.seq)  # it has ended: what was freed while only it could touch it is free
            if split is not None:  # the matchers have this step's tokens: the masks, then the rest
                self.inflight = self.worker.complete(split)
                self.inflight.seq = self.mem.launches
            rep.finished = done
            if rep.mode == "MIXED":  # the iteration's forwards first: its target forward is the step's main one
                rep.forwards = done.forwards + rep.forwards
            else:
                rep.mode, rep.forwards = "DECODE", done.forwards
        else:
            outputs += self._abort(aborts)
            aborts = []
            with self.worker.prefill_stream():
                batch = None if self._hold_arrivals() else self._schedule_prefill()
                if batch:
                    reqs, chunks = batch
                    # Nothing decodes behind this step: the draft layers' pass over the prompts waits for
                    # the next one, so their first tokens go out without it.
                    results = list(zip(reqs, self.worker.prefill(reqs, chunks, defer_fill=True)))
                    rep.mode, rep.forwards, rep.prefill_tokens = "EXTEND", list(self.worker.forwards), sum(chunks)
            if not batch:
                reqs = self._schedule_decode()
                if reqs:
                    p = self._launched(self.worker.launch(reqs))
                    rep.mode = "DECODE"
                    # A masked step's matchers take its tokens at its finish: it may stay in flight too.
                    if self.overlap and (not self._constrained() or p.masked):
                        self.inflight = p  # finished by the next step, after it launches its successor
                    else:
                        results = list(zip(p.reqs, self.worker.finish(p)))
                        rep.finished, rep.forwards = p, p.forwards
        # The prefill's first tokens, read only now: in a mixed step the next iteration is already queued.
        self.worker.settle_prefill()
        outputs += self.pending
        self.pending = []
        for req, res in results:
            if req.finished:
                continue
            self._apply(req, res)
            if res.tokens or req.finished or res.prompt_logprobs:
                outputs.append(self._delta(req, res))
        outputs += self._abort(aborts)
        if self.inflight is None:  # nothing is in flight: every held free is free
            self.mem.settle()
        # A request finished above was removed from the map; forget it.
        for out in outputs:
            if out.finished:
                self.reqs.pop(out.rid, None)
        self.num_steps += 1
        rep.duration_s = time.perf_counter() - t0
        self.report = rep
        return outputs

    def _launched(self, p: Pending) -> Pending:
        """Count an iteration just launched (`MemoryManager.settle`'s clock, and its decoding rows)."""
        self.mem.launches += 1
        p.seq = self.mem.launches
        self.iteration_rows += len(p.reqs) if p.kv_add is None else sum(1 for a in p.kv_add if a)
        return p

    @property
    def last_mode(self) -> str:
        """The last step's mode (EXTEND, DECODE or IDLE)."""
        return self.report.mode

    def _abort(self, reqs: list[Req]) -> list[StepOutput]:
        outs = []
        for req in reqs:
            if req.finished:
                continue
            if req in self.waiting:
                self.waiting.remove(req)
            self._finish(req, "abort")
            outs.append(self._delta(req))
        return outs

    def _constrained(self) -> bool:
        return any(r.constraint is not None for r in self.running)

    def _hold_arrivals(self) -> bool:
        """Should the waiting requests wait a little for others to share their prefill? A prefill step
        costs the decoding requests mostly a fixed amount (the graph launch, the first tokens, the
        draft layers' fill), whatever it carries, so under a steady arrival rate fewer, larger prefills
        stall them less. The head of the queue waits at most `prefill_wait` steps; nobody waits when
        nothing decodes, while a prompt is mid-prefill (its chunks go on), or once the waiting would fill
        every free request slot. Steps, not time: every tensor-parallel rank decides alike."""
        if self.prefill_wait <= 0 or not self.waiting:
            return False
        if not self.running or any(r.prefilling for r in self.running):  # nothing decodes, or chunks go on
            return False
        if len(self.waiting) >= self.max_running - len(self.running):
            return False
        if self.num_steps - self.waiting[0].queued_step >= self.prefill_wait:
            return False
        self.num_held += 1
        return True

    def _want_prefill(self) -> bool:
        """Would the normal path schedule a prefill now (prefill goes first)?"""
        if any(r.prefilling for r in self.running):
            return True
        if not self.waiting or len(self.running) >= self.max_running or self._hold_arrivals():
            return False
        head = self.waiting[0]
        first = min(head.prefill_len - head.kv_len, self.chunk_size if self.chunk_size > 0 else self.max_prefill_tokens)
        return self.mem.can_ensure(head, head.kv_len + first)

    def _decode_ready(self, la: int) -> list[Req] | None:
        """Every running request, with KV for `la` more positions, or None (without preempting anyone)."""
        ready = [r for r in self.running if not r.prefilling]
        mem = self.mem
        for r in ready:
            if not (mem.covers(r, r.kv_len + la) or mem.ensure(r, min(r.kv_len + la, mem.max_context), DECODE_GROW)):
                return None
        return ready

    def _schedule_prefill(self) -> tuple[list[Req], list[int]] | None:
        budget = self.chunk_size if self.chunk_size > 0 else self.max_prefill_tokens
        reqs: list[Req] = []
        chunks: list[int] = []
        n_running = len(self.running)
        # Requests already running but mid-prefill (chunked) go first, then the waiting queue in order.
        cands = [r for r in self.running if r.prefilling] + list(self.waiting)
        for req in cands:
            if budget <= 0:
                break
            new = req.state is ReqState.WAITING
            if new and n_running >= self.max_running:
                break
            if new:
                self._match(req)
            remaining = req.prefill_len - req.kv_len
            chunk = min(remaining, budget) if self.chunk_size > 0 else remaining
            # Without chunking a prompt goes whole (alone if it is long). Headroom: after this chunk,
            # every running request must still be able to take a decode step.
            reserve = -(-(n_running + 1) * self.worker.lookahead // self.mem.page_size)
            fits = not (self.chunk_size <= 0 and reqs and remaining > budget) and self.mem.can_ensure(
                req, req.kv_len + chunk, reserve_pages=reserve if self.running else 0)
            if not (fits and self.mem.ensure(req, req.kv_len + chunk)):
                if new:  # not admitted: a waiting request holds nothing, not even a locked prefix
                    self.mem.unmatch(req)
                    req.kv_len = 0
                break
            if new:
                if req.num_preemptions == 0:
                    req.scheduled_time = time.monotonic()
                    req.num_cached_tokens = req.kv_len
                    self.prefix_queries += len(req.prompt_ids)
                    self.prefix_hits += req.kv_len
                self.waiting.remove(req)
                req.state = ReqState.RUNNING
                self.running.append(req)
                self.moves += 1
                n_running += 1
            reqs.append(req)
            chunks.append(chunk)
            budget -= chunk
        return (reqs, chunks) if reqs else None

    def _schedule_decode(self) -> list[Req]:
        la = self.worker.lookahead
        while True:
            ready = [r for r in self.running if not r.prefilling]
            if not ready:
                return []
            mem = self.mem
            short = [r for r in ready if not (mem.covers(r, r.kv_len + la)
                                              or mem.ensure(r, min(r.kv_len + la, mem.max_context), DECODE_GROW))]
            if not short:
                return ready
            # Preempt the newest request (LIFO) and try again; the oldest always gets to finish.
            victim = max(self.running, key=lambda r: r.arrival)
            if len(self.running) == 1:
                # Admission refuses requests that cannot fit alone, so this is a bookkeeping failure:
                # end this one request with an error rather than the engine.
                victim.error = "KV pool exhausted for a single request"
                self._finish(victim, "error")
                self.pending.append(self._delta(victim))
                continue
            self._preempt(victim)

    def _match(self, req: Req) -> None:
        """Start a request that holds nothing at its longest cached prefix. At least one token is left
        to compute (its logits sample the first token, or feed the drafts), and a request that wants
        prompt logprobs computes its whole prompt."""
        if req.params.prompt_logprobs is not None and req.prompt_logprobs is None:
            req.kv_len = 0
            return
        req.kv_len = self.mem.match(req, req.fill_ids[: req.prefill_len - 1], self.worker.prefix_margin)

    def _release(self, req: Req) -> None:
        """Hand the KV valid in every runner to the prefix cache and free the rest."""
        keep = req.fill_ids[: self.worker.kv_valid_len(req)] if self.mem.cache is not None else None
        self.worker.release(req)
        self.mem.release(req, keep)

    def _preempt(self, req: Req) -> None:
        self._release(req)  # its KV goes to the cache, so its resume is a cache hit unless evicted
        req.kv_len = 0
        req.state = ReqState.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.moves += 1
        req.queued_step = -self.prefill_wait  # a resume does not wait for company
        self.waiting.appendleft(req)

    # --- after a forward -----------------------------------------------------------------------
    def _apply(self, req: Req, res: StepResult) -> None:
        end = settle(req, res)  # drops tokens a grammar refused; says why a constrained request ends
        self._apply_tokens(req, res)
        if end is not None and not req.finished:
            self._finish(req, end)

    def _apply_tokens(self, req: Req, res: StepResult) -> None:
        if res.prompt_logprobs is not None:
            req.prompt_logprobs = (req.prompt_logprobs or []) + res.prompt_logprobs
        if not res.tokens:
            return
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        sp = req.params
        for j, tok in enumerate(res.tokens):
            req.output_ids.append(tok)
            if res.logprobs is not None:
                req.logprobs.append(res.logprobs[j])
            n = len(req.output_ids)
            reason: str | None = None
            matched: int | str | None = None
            if n >= sp.min_new_tokens:
                if tok in self.eos_ids and not sp.ignore_eos:
                    reason, matched = "stop", tok
                elif tok in sp.stop_token_ids:
                    reason, matched = "stop", tok
                elif sp.stop and self.stop_cut is not None:
                    hit = self.stop_cut(req, n)
                    if hit is not None:
                        keep, s = hit
                        del req.output_ids[keep:]
                        del req.logprobs[keep:]
                        reason, matched = "stop", s
            if reason is None and (n >= sp.max_new_tokens or len(req.prompt_ids) + n >= self.max_context):  # fill_len
                reason = "length"
            if reason is not None:
                # Tokens after the cut (later accepted drafts) are dropped: they were never emitted.
                self._finish(req, reason, matched)
                return

    def _delta(self, req: Req, res: StepResult | None = None) -> StepOutput:
        new = req.output_ids[req.emitted :]
        lps = req.logprobs[req.emitted :] if req.params.logprobs is not None else None
        plps = res.prompt_logprobs if res is not None else None
        # The first delta with tokens says when they came (the daemon splits its TTFT into phases).
        timing = [req.added_time, req.scheduled_time or req.added_time, req.first_token_time] \
            if new and req.emitted == 0 and req.first_token_time is not None else None
        req.emitted = len(req.output_ids)
        if lps is None and plps is None and timing is None and not req.finished and req.error is None:
            # New tokens only, as most steps of most requests: no pydantic model for them.
            return TokenOutput(req.rid, new, len(req.prompt_ids), req.emitted, req.num_cached_tokens)
        # The validating constructor, not `model_construct`: pydantic's validator is compiled, its
        # `model_construct` is Python (2.1 against 3.8 us, pydantic 2.14 on the dev VM).
        spec = req.spec.stats() if req.finished and req.spec is not None else None
        return RequestOutput(
            rid=req.rid, token_ids=new, logprobs=lps, prompt_logprobs=plps,
            finished=req.finished, finish_reason=req.finish_reason, matched_stop=req.matched_stop,
            error=req.error, num_prompt_tokens=len(req.prompt_ids), num_output_tokens=len(req.output_ids),
            num_cached_tokens=req.num_cached_tokens, spec=spec, timing=timing,
        )
