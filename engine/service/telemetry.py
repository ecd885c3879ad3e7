"""Turns what the engine already knows on the host into state events, without adding device syncs.

The engine process attaches it (`Telemetry.attach(engine, bus)`): it observes every runner forward
and every step, and emits into `bus` (an `EventBus`); an engine without it (the offline API) pays
nothing. Hooks: `on_forward` (every runner forward → logprob metadata: mode, bs, width, logit rows
against the one row-count rule, and the per-rank token and logprob counts of the tensor-parallel
layout; the forwards inside a whole-iteration graph replay, which no runner observes, get theirs in
`on_step` from the step report's descriptors), `on_step` (from the engine's `StepReport`: requests
queued since the last step, the step's batch and any draft-extend batches, per-runner pool occupancy,
acceptance, the speculation policy's decision for the iteration applied (its depth, reason and gains;
speculative engines only), request lifecycle and per-token logprobs), `idle` and `status` (rates,
graphs, the policy's totals). With `full` off (the engine process starts so, and the daemon turns it on
while a `/v1/events` subscriber watches) the per-step events (logprob metadata, batches, acceptance,
the policy's decision, pools) describe one step every `sample_every_s` and no other: building and
publishing them every step cost a speculative server 13-27 % of its throughput at concurrency 8-32 on
an H200 (`results/gpu/round10/serve_matrix_ev.md`), for a snapshot nobody read. Request lifecycle
events and the status events go out as always. Everything read here is a Python int, a list length or a tensor shape. Request events carry
counts and lifecycle only: token ids, token text and logprobs (another user's output, readable by
every subscriber) go into them only when the operator sets `server.events_include_text`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from mleagle.engine.contract import events as ev

if TYPE_CHECKING:
    from mleagle.engine.contract.event_bus import EventBus
    from mleagle.engine.contract.outputs import StepOutput
    from mleagle.engine.core.engine import Engine
    from mleagle.engine.core.scheduler import StepReport
    from mleagle.engine.executor.forward_batch import ForwardBatch, ForwardOutput, RowMeta
    from mleagle.engine.executor.runner import ModelRunner
    from mleagle.engine.spec.policy import SpecPolicy


class Telemetry:
    def __init__(self, engine: Engine, bus: EventBus | None = None, full: bool = True, sample_every_s: float = 0.1):
        self.e = engine
        self.bus: Any = bus
        self.full = full
        self.sample_every_s = sample_every_s  # without `full`: the per-step events of one step this often
        self.last_sample = 0.0
        self.sampled_out = 0  # steps whose per-step events were left out (not `full`)
        self.pending: StepReport | None = None  # the last step, when it was left out: reported at idle
        self.start = time.time()
        self.running: set[str] = set()
        self.moves = -1  # the scheduler's `moves` when `running` was read
        self.prompt_total = self.gen_total = self.finished_total = 0
        self.forwards: dict[str, int] = {}
        self.last_status = 0.0
        self._window: list[tuple[float, int, int]] = []  # (time, generated, prompt tokens) per step
        self.prompt_window = 0
        self.spent_s = 0.0  # host seconds in these hooks (the engine process reports it with its loop's)

    @classmethod
    def attach(cls, engine: Engine, bus: EventBus, full: bool = True, sample_every_s: float = 0.1) -> Telemetry:
        """Observe `engine`'s forwards and steps, emitting into `bus`."""
        t = cls(engine, bus, full, sample_every_s)
        for r in engine.runners:
            r.observer = t.on_forward
        engine.observers.append(t.on_step)
        return t

    def on_forward(self, runner: ModelRunner, batch: ForwardBatch, out: ForwardOutput) -> None:
        self.forwards[runner.name] = self.forwards.get(runner.name, 0) + 1
        if self.bus is None or not self.full:  # sampled steps report their replayed forwards in on_step
            return
        t0 = time.perf_counter()
        # The per-rank counts this forward's gathers used: its own (eager), or by the same rule from the
        # live batch (a graph replay ran a padded copy); the rule is the same on every rank.
        self._logprob_meta(runner.name, runner.row_meta(batch), int(out.logits.shape[0]), batch.expected_logit_rows,
                           self.e.scheduler.num_steps)
        self.spent_s += time.perf_counter() - t0

    def _logprob_meta(self, runner: str, m: RowMeta, rows: int, expected: int, step: int) -> None:
        self.bus.emit(ev.LogprobMetaEvent(
            runner=runner, mode=m.mode.value, bs=m.bs, width=m.width, logit_rows=rows,
            expected_rows=expected, global_num_tokens=list(m.global_num_tokens),
            global_num_tokens_for_logprob=list(m.global_num_tokens_for_logprob), tp_size=m.tp_size,
            layout=m.layout, agree=m.agree and rows == m.logit_rows == expected, step=step))

    def on_step(self, outputs: list[StepOutput], report: StepReport) -> None:
        t0 = time.perf_counter()
        try:
            self._on_step(outputs, report)
        finally:
            self.spent_s += time.perf_counter() - t0

    def _on_step(self, outputs: list[StepOutput], report: StepReport) -> None:
        new_tokens = sum(len(o.token_ids) for o in outputs)
        self.gen_total += new_tokens
        now = time.time()
        for rid, n in report.added:
            self.prompt_total += n
            if self.bus is not None:
                self.bus.emit(ev.RequestEvent(rid=rid, state="queued", prompt_tokens=n))
        if self.bus is None:
            return
        self.prompt_window += report.prefill_tokens
        if self.full or now - self.last_sample >= self.sample_every_s:
            self.last_sample, self.pending = now, None
            self._step_events(report)
        else:
            self.sampled_out += 1
            self.pending = report
        self._requests(outputs, report)
        self._window.append((now, new_tokens, self.prompt_window))
        self.prompt_window = 0
        if now - self.last_status >= 1.0:
            self.status(now)

    def _verify(self, report: StepReport) -> tuple[Any, Any]:
        """The step's main forward, and the worker's last verify when that forward was one."""
        main = report.forwards[0] if report.forwards else None
        last = getattr(self.e.worker, "last", None) if main is not None and main.mode == "TARGET_VERIFY" else None
        return main, last

    def _step_events(self, report: StepReport) -> None:
        """What one step ran: its forwards' logprob metadata and batches, acceptance, the policy's
        decision, and every runner's pool."""
        s = self.e.scheduler
        bus, step = self.bus, s.num_steps
        duration = report.duration_s
        w = self.e.worker
        forwards = list(report.forwards)
        main, last = self._verify(report)
        times = last.draft_layer_s if last is not None else []
        for f in forwards:  # forwards inside a whole-iteration replay: no observer saw them
            if f.meta is not None:
                self._logprob_meta(f.runner, f.meta, f.meta.logit_rows, f.meta.logit_rows, step)
        # Draft steps first, the target's batch last, so a subscriber's "last batch" is the step's main forward.
        for k, f in enumerate(forwards[1:] + forwards[:1]):
            bus.emit(ev.BatchEvent(step=step, mode=f.mode, runner=f.runner, rids=list(f.rids),  # type: ignore[arg-type]
                                   num_tokens_per_req=list(f.tokens_per_req), num_tokens=f.num_tokens, bs=f.bs,
                                   padded_bs=f.graph_bs or f.bs, graph="replay" if f.graph_bs else "eager",
                                   eager_reason=None if f.graph_bs else f.eager_reason,
                                   duration_s=duration if f is main else times[k] if k < len(times) else 0.0,
                                   num_running=len(s.running), num_waiting=len(s.waiting)))
        if last is not None and last.bs:
            steps = int(getattr(w, "steps", 0))
            depth = [sum(1 for n in last.accepted if n > j) for j in range(steps)]
            bus.emit(ev.AcceptanceEvent(step=step, S=steps, bs=last.bs, accepted_per_depth=depth,
                                        accept_lens=[n + 1 for n in last.accepted],
                                        rids=list(main.rids) if main is not None else [],
                                        draft_time_s=last.draft_s, verify_time_s=last.verify_s,
                                        draft_time_per_layer_s=list(last.draft_layer_s)))
        policy: SpecPolicy | None = getattr(w, "policy", None)  # a target-only worker has none
        done = report.finished
        if policy is not None and done is not None:  # a decode iteration's results: the plan it ran
            plan = done.plan
            bus.emit(ev.SpecPolicyEvent(step=step, bs=len(done.reqs), depth=plan.depth, S=policy.steps,
                                        mode=policy.mode, reason=plan.reason, predicted_gain=plan.predicted_gain,
                                        measured_gain=policy.measured_gain, catch_up=len(plan.catch_up)))
        for u in self.e.pool_usage():
            bus.emit(ev.PoolEvent(runner=u["runner"], kv_used=u["kv_used"], kv_total=u["kv_total"],
                                  kv_cached=u["kv_cached"], kv_evictable=u["kv_evictable"],
                                  req_used=u["req_used"], req_total=u["req_total"],
                                  page_size=self.e.allocator.page_size, step=step))

    def _requests(self, outputs: list[StepOutput], report: StepReport) -> None:
        """Request lifecycle: running, preempted, finished (with their tokens when the operator asked)."""
        s, bus = self.e.scheduler, self.bus
        main, last = self._verify(report)
        if s.moves != self.moves:  # the running set changed: who started, who was preempted
            self.moves = s.moves
            running = {r.rid for r in s.running}
            for rid in running - self.running:
                bus.emit(ev.RequestEvent(rid=rid, state="running"))
            waiting = {r.rid for r in s.waiting}
            for rid in (self.running - running) & waiting:
                bus.emit(ev.RequestEvent(rid=rid, state="preempted"))
            self.running = running
        tok = self.e.tokenizer
        with_tokens = self.e.cfg.server.events_include_text
        # In a verify step a request's tokens are its accepted drafts (depth 1..n) then the target's
        # own token (depth 0); elsewhere every token is the target's.
        accepted = dict(zip(main.rids, last.accepted)) if last is not None and main is not None else {}
        for o in outputs:
            toks = None
            if with_tokens and o.logprobs:
                acc = accepted.get(o.rid)
                depths = [*range(1, acc + 1), 0] if acc is not None else [0] * len(o.logprobs)
                toks = [ev.TokenEvent(token_id=lp.token_id, text=tok.decode([lp.token_id]) if tok else None,
                                      logprob=lp.logprob, depth=depths[j] if j < len(depths) else None,
                                      top=[ev.TopToken(token_id=t, text=tok.decode([t]) if tok else None, logprob=v)
                                           for t, v in lp.top])
                        for j, lp in enumerate(o.logprobs)]
            if o.finished:
                self.finished_total += 1
                state = "aborted" if o.finish_reason == "abort" else "finished"
                bus.emit(ev.RequestEvent(rid=o.rid, state=state, finish_reason=o.finish_reason,
                                         prompt_tokens=o.num_prompt_tokens, output_tokens=o.num_output_tokens,
                                         tokens=toks, accept_len=o.spec.accept_len if o.spec else None, error=o.error))
            elif toks:
                bus.emit(ev.RequestEvent(rid=o.rid, state="running", prompt_tokens=o.num_prompt_tokens,
                                         output_tokens=o.num_output_tokens, tokens=toks))

    def idle(self) -> None:
        """Called by the engine process while it waits: keeps status (rates, uptime) current, and
        reports the last step if it was left out, so the state an idle engine leaves (its pools free)
        is what the daemon's snapshot shows."""
        if self.pending is not None and self.bus is not None:
            t0 = time.perf_counter()
            self._step_events(self.pending)
            self.pending = None
            self.spent_s += time.perf_counter() - t0
        now = time.time()
        if self.bus is not None and now - self.last_status >= 1.0:
            self.status(now)

    def status(self, now: float | None = None) -> None:
        if self.bus is None:
            return
        now = now or time.time()
        self._window = [x for x in self._window if now - x[0] <= 5.0]
        # Rates over the last 5 s, and never over less than 1 s (one sample would spike them).
        span = max(now - self._window[0][0], 1.0) if self._window else 1.0
        s, w = self.e.scheduler, self.e.worker
        stats = getattr(w, "stats", None)
        self.bus.emit(ev.EngineEvent(
            model=self.e.model_name, draft=self.e.cfg.engine.draft, spec_steps=getattr(w, "steps", 0),
            device=self.e.device.type, dtype=self.e.cfg.engine.dtype, uptime_s=now - self.start,
            num_running=len(s.running), num_waiting=len(s.waiting), prompt_tokens_total=self.prompt_total,
            gen_tokens_total=self.gen_total, requests_finished_total=self.finished_total,
            gen_tokens_per_s=sum(x[1] for x in self._window) / span,
            prompt_tokens_per_s=sum(x[2] for x in self._window) / span,
            mean_accept_len=stats.accept_len if stats is not None and stats.num_verify else None,
            steps_total=s.num_steps,
            prefix_cache_queries_total=s.prefix_queries if self.e.mem.cache is not None else None,
            prefix_cache_hits_total=s.prefix_hits if self.e.mem.cache is not None else None,
            spec_policy=policy_totals(getattr(w, "policy", None))))
        it = getattr(self.e.worker, "iter_graph", None)
        if it is not None:  # the whole-iteration graphs (plain greedy batches), as one more graph runner
            self.bus.emit(ev.GraphEvent(runner="iteration", enabled=True, mode=self.e.runners[0].graphs.mode.value,  # type: ignore[union-attr]
                                        buckets=list(it.buckets), replays=dict(it.stats.replays),
                                        capture_time_s=it.stats.capture_s))
        for r in self.e.runners:
            g = r.graphs
            self.bus.emit(ev.GraphEvent(
                runner=r.name, enabled=g is not None, mode=g.mode.value if g is not None else None,
                buckets=list(g.buckets) if g is not None else [], replays=dict(g.stats.replays) if g is not None else {},
                eager=dict(r.eager), capture_time_s=g.stats.capture_s if g is not None else None))
            x = r.extend_graphs
            if x is not None:  # its prefill graphs: buckets are token counts (eager prefills are in `eager` above)
                self.bus.emit(ev.GraphEvent(runner=f"{r.name}:prefill", enabled=True, mode="EXTEND",
                                            buckets=list(x.buckets), replays=dict(x.stats.replays),
                                            capture_time_s=x.stats.capture_s))
        self.last_status = now


def policy_totals(p: SpecPolicy | None) -> ev.SpecPolicyTotals | None:
    """The speculation policy's totals for the engine status (None: a target-only engine)."""
    if p is None:
        return None
    st = p.stats
    return ev.SpecPolicyTotals(
        mode=p.mode, iterations_by_depth=list(st.iterations_by_depth), tokens_gained=st.tokens_gained,
        explore_iterations=st.explore_iterations, switches=st.switches, catch_ups=st.catch_ups,
        catch_up_positions=st.catch_up_positions, catch_up_s=st.catch_up_s, choose_calls=st.choose_calls,
        choose_mean_s=st.choose_s / st.choose_calls if st.choose_calls else 0.0,
        served_discount=p.served_discounts())
