"""Prometheus metrics for `/metrics`, named the way operators already know them (vLLM, SGLang).

Request counters and latency histograms are observed by the daemon as deltas arrive (TTFT from
request arrival, inter-token latency per emitted token, end-to-end at finish). Pool occupancy per
runner comes from the engine's pongs (with the prefix cache's cached and evictable slots). Prefix-cache
queries and hits count prompt tokens, as vLLM's `prefix_cache_queries`/`prefix_cache_hits` do, observed
when a request finishes. Speculative counters follow vLLM's names with position = draft
layer (`mleagle:spec_decode_num_accepted_tokens_per_pos{position}`) and are summed from the per-request
statistics the engine hands back with each finished request; the acceptance length and rate gauges
(SGLang style) and the per-layer draft overhead are derived from those sums. One registry per app, so
several servers in one process (tests) never collide.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

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
        self.gen_tokens = Counter(P + "generation_tokens", "Generated tokens", lab, registry=r)
        self.running = Gauge(P + "num_requests_running", "Requests running in the engine", lab, registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests admitted but not yet producing tokens", lab, registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", lab, buckets=LAT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Latency per output token after the first", lab, buckets=LAT_BUCKETS, registry=r)
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
        self._spec = SpecStats()
        self._layers = 0
        self.engine_restarts.inc(0)
        self.set_model(model_name)

    def set_model(self, name: str) -> None:
        """Create the per-model series at zero, so a scrape lists every metric before any traffic."""
        self.model = name
        for m in (self.prompt_tokens, self.gen_tokens, self.running, self.waiting, self.ttft, self.itl, self.e2e,
                  self.req_prompt, self.req_gen, self.spec_drafts, self.spec_draft_tokens, self.spec_accepted,
                  self.spec_accept_len, self.spec_accept_rate, self.spec_draft_time, self.spec_verify_time,
                  self.prefix_queries, self.prefix_hits):
            m.labels(name)

    def observe_finished(self, reason: str, prompt_tokens: int, gen_tokens: int, e2e: float, spec: SpecStats | None,
                         cached_tokens: int = 0) -> None:
        m = self.model
        self.requests.labels(m, reason).inc()
        self.prefix_queries.labels(m).inc(prompt_tokens)
        self.prefix_hits.labels(m).inc(cached_tokens)
        self.req_prompt.labels(m).observe(prompt_tokens)
        self.req_gen.labels(m).observe(gen_tokens)
        self.e2e.labels(m).observe(e2e)
        if spec is not None and spec.num_verify:
            self.add_spec(spec)

    def add_spec(self, s: SpecStats) -> None:
        m, t = self.model, self._spec
        self.spec_drafts.labels(m).inc(s.num_verify)
        self.spec_draft_tokens.labels(m).inc(s.num_draft_tokens)
        self.spec_accepted.labels(m).inc(s.num_accepted_tokens)
        self.spec_draft_time.labels(m).inc(s.draft_time_s)
        self.spec_verify_time.labels(m).inc(s.verify_time_s)
        for pos, n in enumerate(s.accepted_per_depth):
            self.spec_per_pos.labels(m, str(pos)).inc(n)
        t.num_verify += s.num_verify
        t.num_draft_tokens += s.num_draft_tokens
        t.num_accepted_tokens += s.num_accepted_tokens
        t.draft_time_s += s.draft_time_s
        t.verify_time_s += s.verify_time_s
        self._layers = max(self._layers, len(s.accepted_per_depth))
        self.spec_accept_len.labels(m).set(t.accept_len)
        if t.num_draft_tokens:
            self.spec_accept_rate.labels(m).set(t.num_accepted_tokens / t.num_draft_tokens)
        total = t.draft_time_s + t.verify_time_s
        if total > 0 and self._layers:
            # The engine reports draft time summed over layers; each layer's forward is the same shape.
            for k in range(self._layers):
                self.spec_draft_overhead.labels(m, str(k)).set(t.draft_time_s / self._layers / total)

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

    def render(self) -> bytes:
        return generate_latest(self.registry)
