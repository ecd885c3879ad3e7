"""Prometheus metrics for `/metrics`, named the way operators already know them (vLLM, SGLang).

Request counters and latency histograms are observed by the daemon as deltas arrive (TTFT from
request arrival, inter-token latency per emitted token, end-to-end at finish). Pool occupancy per
runner comes from the engine's pongs (with the prefix cache's cached and evictable slots). Prefix-cache
queries and hits count prompt tokens, as vLLM's `prefix_cache_queries`/`prefix_cache_hits` do, observed
when a request finishes. Speculative counters follow vLLM's names with position = draft
layer (`mleagle:spec_decode_num_accepted_tokens_per_pos{position}`) and are summed from the per-request
statistics the engine hands back with each finished request; the acceptance length and rate gauges
(SGLang style) and the per-layer draft overhead are derived from those sums. The speculation policy's
series (`mleagle:spec_policy_*`: iterations per draft depth S', drafts accepted, depth switches,
explored iterations, draft catch-ups with their positions and time, and gauges of the latest depth,
its predicted and measured gain, and the served discount on drafting per batch-size bucket) come from the policy's snapshot in the engine's pongs; its totals are
cumulative in the engine, so the counters advance by what grew since the previous pong, and a
speculative engine alone creates them. One registry per app, so several servers in one process (tests)
never collide.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator
from itertools import pairwise
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from mleagle.engine.contract.outputs import SpecStats

disable_created_metrics()  # the *_created series only double the scrape size
P = "mleagle:"
LAT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
TOK_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        r = self.registry = CollectorRegistry()
        lab = ["model_name"]
        self.model = model_name
        self.requests = Counter(P + "request_success", "Finished requests by finish reason", [*lab, "finished_reason"], registry=r)
        self.http = Counter(P + "http_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.rejected = Counter(P + "request_rejected", "Requests refused before the engine", ["reason"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prefill tokens processed", lab, registry=r)
        self.running = Gauge(P + "num_requests_running", "Requests running in the engine", lab, registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests admitted but not yet producing tokens", lab, registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", lab, buckets=LAT_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "End-to-end request latency", lab, buckets=E2E_BUCKETS, registry=r)
        self.req_prompt = Histogram(P + "request_prompt_tokens", "Prompt length per request", lab, buckets=TOK_BUCKETS, registry=r)
        self.req_gen = Histogram(P + "request_generation_tokens", "Generated tokens per request", lab, buckets=TOK_BUCKETS, registry=r)
        self.prefix_queries = Counter(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", lab, registry=r)
        self.prefix_hits = Counter(P + "prefix_cache_hits", "Prompt tokens found in the prefix cache", lab, registry=r)
        self.kv_used = Gauge(P + "kv_pool_used_tokens", "KV slots held by requests per runner", ["runner"], registry=r)
        self.kv_cached = Gauge(P + "kv_pool_cached_tokens", "KV slots the prefix cache holds per runner", ["runner"], registry=r)
        self.kv_evictable = Gauge(P + "kv_pool_evictable_tokens", "Cached KV slots no request uses per runner", ["runner"], registry=r)
        self.kv_total = Gauge(P + "kv_pool_total_tokens", "KV slots per runner", ["runner"], registry=r)
        self.kv_usage = Gauge(P + "kv_cache_usage_perc", "KV pool usage per runner (0-1)", ["runner"], registry=r)
        self.req_used = Gauge(P + "req_pool_used", "Request slots in use per runner", ["runner"], registry=r)
        self.req_total = Gauge(P + "req_pool_total", "Request slots per runner", ["runner"], registry=r)
        self.engine_up = Gauge(P + "engine_up", "1 while the engine process is ready", registry=r)
        self.engine_restarts = Counter(P + "engine_restarts", "Engine process restarts", registry=r)
        self.spec_drafts = Counter(P + "spec_decode_num_drafts", "Verify steps (draft chains proposed)", lab, registry=r)
        self.spec_draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Draft tokens proposed", lab, registry=r)
        self.spec_accepted = Counter(P + "spec_decode_num_accepted_tokens", "Draft tokens accepted", lab, registry=r)
        self.spec_per_pos = Counter(
            P + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position (= draft layer)", [*lab, "position"], registry=r
        )
        self.spec_accept_len = Gauge(P + "spec_accept_length", "Mean tokens per verify step (accepted + 1)", lab, registry=r)
        self.spec_accept_rate = Gauge(P + "spec_accept_rate", "Accepted / proposed draft tokens", lab, registry=r)
        self.spec_draft_time = Counter(P + "spec_decode_draft_time_seconds", "Time in draft forwards", lab, registry=r)
        self.spec_verify_time = Counter(P + "spec_decode_verify_time_seconds", "Time in verify forwards", lab, registry=r)
        self.spec_draft_overhead = Gauge(
            P + "spec_decode_draft_overhead", "Draft time per layer / (draft + verify time)", [*lab, "layer"], registry=r
        )
        # The speculation policy: created when a speculative engine first reports one.
        self.pol_iters = Counter(P + "spec_policy_iterations", "Decode iterations by the draft depth S' the policy chose",
                                 [*lab, "depth"], registry=r)
        self.pol_counters = {  # PolicyStats field -> its counter
            "tokens_gained": Counter(P + "spec_policy_tokens_gained",
                                     "Drafts accepted: tokens beyond one per request and iteration", lab, registry=r),
            "switches": Counter(P + "spec_policy_switches", "Changes of draft depth between iterations", lab, registry=r),
            "explore_iterations": Counter(P + "spec_policy_explore_iterations",
                                          "Iterations the policy ran to measure a depth", lab, registry=r),
            "catch_ups": Counter(P + "spec_policy_catch_ups", "Draft-layer catch-ups (one batched draft extend each)",
                                 lab, registry=r),
            "catch_up_positions": Counter(P + "spec_policy_catch_up_positions", "Positions the draft catch-ups filled",
                                          lab, registry=r),
            "catch_up_s": Counter(P + "spec_policy_catch_up_seconds", "Time in draft catch-ups", lab, registry=r),
        }
        self.pol_depth = Gauge(P + "spec_policy_depth", "Draft depth S' of the policy's latest decision", lab, registry=r)
        self.pol_predicted = Gauge(P + "spec_policy_predicted_gain",
                                   "Expected tokens/s at the chosen depth over depth 0's (0: no prediction)", lab,
                                   registry=r)
        self.pol_measured = Gauge(P + "spec_policy_measured_gain",
                                  "Latest measured tokens/s over depth 0's in its batch-size bucket (0: not yet)", lab,
                                  registry=r)
        self.pol_discount = Gauge(P + "spec_policy_served_discount",
                                  "Where drafting cost more served than at warm-up: the discount served rates put on "
                                  "drafting, per batch-size bucket (1: none)", [*lab, "bucket"], registry=r)
        self._pol_seen: dict[str, float] = {}  # the engine's totals at the last pong
        self._pol_epoch = 0
        self._spec = SpecStats()
        self._layers = 0
        self.engine_restarts.inc(0)
        self.tokens = TokenSeries(model_name)  # the series observed per streamed token
        r.register(self.tokens)
        self.phases = TtftPhases(model_name)  # where each request's time to first token went
        r.register(self.phases)
        # The per-model series exist at zero from here, so a scrape lists every metric before any traffic.
        # Those a request touches are bound once: `labels()` costs a locked dict lookup, and a request's
        # end touched up to a dozen of them (6-12 us of the daemon's loop on the dev VM).
        self.running.labels(model_name)
        self.waiting.labels(model_name)
        self.ttft_m = self.ttft.labels(model_name)
        self.prompt_tokens_m = self.prompt_tokens.labels(model_name)
        self._queries, self._hits = self.prefix_queries.labels(model_name), self.prefix_hits.labels(model_name)
        self._prompt, self._gen = self.req_prompt.labels(model_name), self.req_gen.labels(model_name)
        self._e2e = self.e2e.labels(model_name)
        self._drafts, self._draft_tokens = self.spec_drafts.labels(model_name), self.spec_draft_tokens.labels(model_name)
        self._accepted = self.spec_accepted.labels(model_name)
        self._draft_time, self._verify_time = self.spec_draft_time.labels(model_name), self.spec_verify_time.labels(model_name)
        self._accept_len, self._accept_rate = self.spec_accept_len.labels(model_name), self.spec_accept_rate.labels(model_name)
        self._by_reason: dict[str, Any] = {}
        self._per_pos: list[Any] = []  # spec_per_pos's and spec_draft_overhead's series by position, bound as met
        self._overhead: list[Any] = []

    def observe_finished(self, reason: str, prompt_tokens: int, gen_tokens: int, e2e: float, spec: SpecStats | None,
                         cached_tokens: int = 0) -> None:
        if (r := self._by_reason.get(reason)) is None:
            r = self._by_reason[reason] = self.requests.labels(self.model, reason)
        r.inc()
        self._queries.inc(prompt_tokens)
        self._hits.inc(cached_tokens)
        self._prompt.observe(prompt_tokens)
        self._gen.observe(gen_tokens)
        self._e2e.observe(e2e)
        if spec is not None and spec.num_verify:
            self.add_spec(spec)

    def add_spec(self, s: SpecStats) -> None:
        t = self._spec
        self._drafts.inc(s.num_verify)
        self._draft_tokens.inc(s.num_draft_tokens)
        self._accepted.inc(s.num_accepted_tokens)
        self._draft_time.inc(s.draft_time_s)
        self._verify_time.inc(s.verify_time_s)
        for c, n in zip(self._by_position(self._per_pos, self.spec_per_pos, len(s.accepted_per_depth)),
                        s.accepted_per_depth):
            c.inc(n)
        t.num_verify += s.num_verify
        t.num_draft_tokens += s.num_draft_tokens
        t.num_accepted_tokens += s.num_accepted_tokens
        t.draft_time_s += s.draft_time_s
        t.verify_time_s += s.verify_time_s
        self._layers = max(self._layers, len(s.accepted_per_depth))
        self._accept_len.set(t.accept_len)
        if t.num_draft_tokens:
            self._accept_rate.set(t.num_accepted_tokens / t.num_draft_tokens)
        total = t.draft_time_s + t.verify_time_s
        if total > 0 and self._layers:
            # The engine reports draft time summed over layers; each layer's forward is the same shape.
            share = t.draft_time_s / self._layers / total
            for c in self._by_position(self._overhead, self.spec_draft_overhead, self._layers):
                c.set(share)

    def _by_position(self, bound: list[Any], metric: Any, n: int) -> list[Any]:
        """`metric`'s series of positions 0..n-1 (label `str(position)`), bound on first use into `bound`."""
        while len(bound) < n:
            bound.append(metric.labels(self.model, str(len(bound))))
        return bound[:n]

    def set_pools(self, usage: list[dict[str, Any]]) -> None:
        for u in usage:
            r = str(u.get("runner", "?"))
            used, total = float(u.get("kv_used", 0)), float(u.get("kv_total", 0))
            self.kv_used.labels(r).set(used)
            self.kv_total.labels(r).set(total)
            self.kv_usage.labels(r).set(used / total if total else 0.0)
            self.kv_cached.labels(r).set(float(u.get("kv_cached", 0)))
            self.kv_evictable.labels(r).set(float(u.get("kv_evictable", 0)))
            self.req_used.labels(r).set(float(u.get("req_used", 0)))
            self.req_total.labels(r).set(float(u.get("req_total", 0)))

    def set_policy(self, snap: Any, epoch: int = 0) -> None:
        """The speculation policy's snapshot from a pong (`Engine.stats()["spec_policy"]`; None for a
        target-only engine). Its totals are cumulative in the engine: each counter advances by what grew
        since the previous pong. A new `epoch` (the daemon's engine restarts) or a total that fell (the
        engine forgot its counts) starts again from zero, so no count is taken twice."""
        if not isinstance(snap, dict):
            return
        m = self.model
        totals = {k: _num(snap.get(k)) for k in self.pol_counters}
        totals.update({f"depth{d}": _num(n) for d, n in enumerate(snap.get("iterations_by_depth") or [])})
        if epoch != self._pol_epoch or any(v < self._pol_seen.get(k, 0.0) for k, v in totals.items()):
            self._pol_seen, self._pol_epoch = {}, epoch
        for k, total in totals.items():
            c = self.pol_iters.labels(m, k[5:]) if k.startswith("depth") else self.pol_counters[k].labels(m)
            c.inc(max(total - self._pol_seen.get(k, 0.0), 0.0))  # inc(0) lists the series from the first report
        self._pol_seen = totals
        self.pol_depth.labels(m).set(_num(snap.get("depth")))
        self.pol_predicted.labels(m).set(_num(snap.get("predicted_gain")))
        self.pol_measured.labels(m).set(_num(snap.get("measured_gain")))
        for b, f in (snap.get("served_discount") or {}).items():
            self.pol_discount.labels(m, str(b)).set(_num(f))

    def render(self) -> bytes:
        return generate_latest(self.registry)


# A request's time to first token, from its arrival at the daemon to its first tokens in the daemon's
# hands, in the order it passes: the daemon reads and tokenizes it (`daemon_in`), the request reaches
# the engine loop (`to_engine`: the IPC and a busy loop's step), waits for admission (`queue`), is
# prefilled until its first tokens are applied (`prefill`: its prefill steps, chunks or a mixed step,
# and reading their tokens), the rest of that step until its outputs are sent (`engine_out`), the
# message reaches the daemon's reader (`to_daemon`), the daemon takes the delta (`daemon_out`), and a
# stream's first frame is written, its response headers with it (`write`; 0 for a response that is
# not streamed, which writes only at the end).
TTFT_PHASES = ("daemon_in", "to_engine", "queue", "prefill", "engine_out", "to_daemon", "daemon_out", "write")
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class TtftPhases:
    """`time_to_first_token_phase_seconds{phase}`: each request's TTFT split at the marks the daemon
    and the engine stamp with `time.monotonic()` (one clock for every process of a host; the engine
    always runs on the daemon's host), and the last `keep` requests' splits, numbered, for
    `/debug/engine?phases_since=N` (`bench serve` reads the ones of its run: percentiles and which
    phases the slowest requests spent their time in)."""

    def __init__(self, model: str, keep: int = 4096) -> None:
        self.model = model
        self.seq = 0
        # [seq, *phase seconds, response id, t_in, written]: the last three let a client on this host
        # put its own marks beside the daemon's (`bench serve`'s time before the route and after the write)
        self.recent: deque[list[Any]] = deque(maxlen=keep)
        self.counts = [[0] * (len(PHASE_BUCKETS) + 1) for _ in TTFT_PHASES]
        self.sums = [0.0] * len(TTFT_PHASES)

    def observe(self, t_in: float, t_submit: float, timing: list[float], took: float, written: float,
                rid: str = "") -> None:
        """One first delta of response `rid`: the daemon's marks around the engine's `timing` (added,
        scheduled, first tokens, sent, received), then when the daemon took it and wrote it. A mark
        missing (0) drops the request: its split would be wrong."""
        marks = (t_in, t_submit, *timing, took, written)
        if len(marks) != len(TTFT_PHASES) + 1 or not all(marks):
            return
        ph = [max(0.0, b - a) for a, b in pairwise(marks)]
        for i, x in enumerate(ph):
            self.counts[i][bisect_left(PHASE_BUCKETS, x)] += 1
            self.sums[i] += x
        self.seq += 1
        self.recent.append([self.seq, *ph, rid, t_in, written])

    def since(self, seq: int) -> dict[str, Any]:
        return {"names": list(TTFT_PHASES), "seq": self.seq, "recent": [r for r in self.recent if r[0] > seq]}

    def collect(self) -> Iterator[Metric]:
        h = HistogramMetricFamily(P + "time_to_first_token_phase_seconds",
                                  "Time to first token by phase (daemon_in, to_engine, queue, prefill, engine_out, "
                                  "to_daemon, daemon_out, write)", labels=["model_name", "phase"])
        for name, counts, total in zip(TTFT_PHASES, self.counts, self.sums):
            cum, n = [], 0
            for le, k in zip([*map(floatToGoString, PHASE_BUCKETS), "+Inf"], counts):
                n += k
                cum.append((le, n))
            h.add_metric([self.model, name], cum, total)
        yield h


class ReadCounter:
    """A counter kept elsewhere as a plain number, read at each scrape (`read`): nothing per event."""

    def __init__(self, name: str, doc: str, read: Callable[[], float]) -> None:
        self.name, self.doc, self.read = name, doc, read

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily(self.name, self.doc)
        c.add_metric([], self.read())
        yield c


class TokenSeries:
    """The two series observed per streamed token, `inter_token_latency_seconds` (a histogram) and
    `generation_tokens` (a counter), kept as plain numbers and listed at a scrape as prometheus_client
    lists a Histogram and a Counter (a test compares the two): an observation is a bisect and a few
    adds (0.3 us) where Histogram.observe and Counter.inc take three locks (1.8 us), and the daemon's
    loop pays it per token of every stream. Only the event loop touches it, observing and scraping."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.counts = [0] * (len(LAT_BUCKETS) + 1)  # per bucket (`le` the bound, the last +Inf), not cumulative
        self.sum = 0.0
        self.generated = 0

    def observe(self, n: int, itl: float | None) -> None:
        """`n` tokens generated; each waited `itl` seconds after the one before (None: the first ones)."""
        self.generated += n
        if itl is not None:
            self.counts[bisect_left(LAT_BUCKETS, itl)] += n
            self.sum += itl * n

    def collect(self) -> Iterator[Metric]:
        h = HistogramMetricFamily(P + "inter_token_latency_seconds", "Latency per output token after the first",
                                  labels=["model_name"])
        cum, total = [], 0
        for le, k in zip([*map(floatToGoString, LAT_BUCKETS), "+Inf"], self.counts):
            total += k
            cum.append((le, total))
        h.add_metric([self.model], cum, self.sum)
        yield h
        c = CounterMetricFamily(P + "generation_tokens", "Generated tokens", labels=["model_name"])
        c.add_metric([self.model], self.generated)
        yield c


def _num(x: Any) -> float:
    """A number from an engine's JSON (anything else counts as 0: a bad figure must not break a scrape)."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else 0.0
