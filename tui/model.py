"""The TUI's view model: folds state events into what the panels show, with no Textual in it.

`Dashboard.apply(event)` is the only way state changes; `apply_raw(text)` parses first and counts
malformed input instead of raising. Current state (pools, graphs, running requests, engine status) comes
from the engine's own `StateTracker`; history the panels need (recent batches and logprob metadata,
sparkline series, acceptance totals per depth and the accept-length histogram, the speculation
policy's recent decisions with their counts by depth and reason, requests with their tokens for the
drill-down) is kept here in bounded containers. `version` increases on every applied
event so the UI redraws only when something changed.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict, deque
from dataclasses import dataclass, field

from mleagle.engine.contract.event_bus import StateTracker
from mleagle.engine.contract.events import (
    AcceptanceEvent,
    BatchEvent,
    DropsEvent,
    EngineEvent,
    Event,
    EventError,
    GraphEvent,
    LogprobMetaEvent,
    PoolEvent,
    RequestEvent,
    SnapshotEvent,
    SpecPolicyEvent,
    TokenEvent,
    parse_event,
)


@dataclass
class RequestView:
    """Everything known about one request, including every token it emitted (for the drill-down)."""

    rid: str
    state: str = "queued"
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    accept_len: float | None = None
    error: str | None = None
    tokens: list[TokenEvent] = field(default_factory=list)
    ver: int = 0  # bumped on every update, so a table redraws only the rows that changed


class Dashboard:
    """Aggregated state and bounded history for the panels."""

    def __init__(self, history: int = 120, max_rows: int = 300, max_requests: int = 500, max_tokens: int = 4096) -> None:
        self.tracker = StateTracker()
        self.version = 0
        self.events = 0
        self.malformed = 0
        self.by_type: Counter[str] = Counter()
        self.last_error: str | None = None
        self.last_seq: int | None = None
        self.seq_gaps = 0  # events the engine numbered but we never saw (dropped upstream)
        self.engine: EngineEvent | None = None
        self.num_running = 0
        self.num_waiting = 0
        self.dropped: dict[str, int] = {}
        # batches: history rows, counted so a table can append only the new ones
        self.batches: deque[BatchEvent] = deque(maxlen=max_rows)
        self.batch_count = 0
        self.eager_reasons: Counter[tuple[str, str]] = Counter()  # (runner, reason)
        self.graph_hits: Counter[str] = Counter()  # runner -> replays seen in batch events
        # logprob metadata
        self.lpm: deque[LogprobMetaEvent] = deque(maxlen=max_rows)
        self.lpm_count = 0
        self.lpm_mismatch = 0
        self.lpm_by: Counter[tuple[str, str]] = Counter()  # (runner, mode) -> forwards
        self.lpm_bad_by: Counter[tuple[str, str]] = Counter()
        self.lpm_last: dict[tuple[str, str], LogprobMetaEvent] = {}  # (runner, mode) -> its latest forward
        # acceptance
        self.S = 0
        self.iterations = 0
        self.acc_per_depth: list[int] = []
        self.proposed_per_depth: list[int] = []
        self.accept_hist: Counter[int] = Counter()
        self.draft_time = 0.0
        self.verify_time = 0.0
        self.layer_time: list[float] = []
        self.last_acceptance: AcceptanceEvent | None = None
        # speculation policy: the latest decisions (oldest first) and, over every one seen, counts by depth
        # and reason and the sums behind the mean predicted and measured gain per depth (0.0 = none: skipped)
        self.policy: deque[SpecPolicyEvent] = deque(maxlen=history)
        self.policy_count = 0
        self.policy_by_depth: Counter[int] = Counter()
        self.policy_reasons: Counter[str] = Counter()
        self.policy_catch_up = 0  # requests caught up before an iteration
        self.gain_sum: defaultdict[tuple[str, int], float] = defaultdict(float)  # (kind, depth) -> sum
        self.gain_n: Counter[tuple[str, int]] = Counter()
        # sparklines
        self.spark_tps: deque[float] = deque(maxlen=history)
        self.spark_accept: deque[float] = deque(maxlen=history)
        self.spark_bs: deque[float] = deque(maxlen=history)
        self.spark_step_ms: deque[float] = deque(maxlen=history)
        # requests
        self.requests: OrderedDict[str, RequestView] = OrderedDict()
        self.max_requests = max_requests
        self.max_tokens = max_tokens

    # --- input -------------------------------------------------------------------------------------

    def apply_raw(self, text: str | bytes) -> Event | None:
        """Parse and apply one event; malformed input is counted (and its error kept), never raised."""
        try:
            e = parse_event(text)
        except EventError as err:
            self.malformed += 1
            self.last_error = str(err)
            self.version += 1
            return None
        self.apply(e)
        return e

    def apply(self, e: Event) -> None:
        self.events += 1
        self.version += 1
        self.by_type[e.type] += 1
        if e.seq:
            if self.last_seq is not None and e.seq > self.last_seq + 1:
                self.seq_gaps += e.seq - self.last_seq - 1
            self.last_seq = e.seq
        self.tracker.apply(e)
        getattr(self, f"_on_{e.type}")(e)

    # --- folding per type --------------------------------------------------------------------------

    def _on_batch(self, e: BatchEvent) -> None:
        self.batches.append(e)
        self.batch_count += 1
        if e.graph == "eager":
            self.eager_reasons[(e.runner, e.eager_reason or "?")] += 1
        else:
            self.graph_hits[e.runner] += 1
        if e.num_running is not None:
            self.num_running = e.num_running
        if e.num_waiting is not None:
            self.num_waiting = e.num_waiting
        if e.runner == "target" and e.mode != "IDLE":
            self.spark_bs.append(float(e.bs))
            self.spark_step_ms.append(e.duration_s * 1e3)

    def _on_pool(self, e: PoolEvent) -> None:
        pass  # current state lives in the tracker

    def _on_graph(self, e: GraphEvent) -> None:
        pass

    def _on_logprob_meta(self, e: LogprobMetaEvent) -> None:
        self.lpm.append(e)
        self.lpm_count += 1
        self.lpm_by[(e.runner, e.mode)] += 1
        self.lpm_last[(e.runner, e.mode)] = e
        if not e.agree:
            self.lpm_mismatch += 1
            self.lpm_bad_by[(e.runner, e.mode)] += 1

    def _on_acceptance(self, e: AcceptanceEvent) -> None:
        # a snapshot may have set S already (from its last acceptance) without sizing the per-depth lists
        if e.S != self.S or len(self.acc_per_depth) != e.S:
            self.S = e.S
            self.acc_per_depth = [0] * e.S
            self.proposed_per_depth = [0] * e.S
            self.layer_time = [0.0] * e.S
        self.iterations += 1
        for j, n in enumerate(e.accepted_per_depth[: self.S]):
            self.acc_per_depth[j] += n
        for j in range(self.S):
            self.proposed_per_depth[j] += e.bs
        for a in e.accept_lens:
            self.accept_hist[a] += 1
        self.draft_time += e.draft_time_s
        self.verify_time += e.verify_time_s
        for j, t in enumerate(e.draft_time_per_layer_s[: self.S]):
            self.layer_time[j] += t
        self.last_acceptance = e
        if e.accept_lens:
            self.spark_accept.append(sum(e.accept_lens) / len(e.accept_lens))
        elif e.bs:
            self.spark_accept.append(1 + sum(e.accepted_per_depth) / e.bs)

    def _on_spec_policy(self, e: SpecPolicyEvent) -> None:
        self.policy.append(e)
        self.policy_count += 1
        self.policy_by_depth[e.depth] += 1
        self.policy_reasons[e.reason] += 1
        self.policy_catch_up += e.catch_up
        for kind, g in (("predicted", e.predicted_gain), ("measured", e.measured_gain)):
            if g > 0:
                self.gain_sum[(kind, e.depth)] += g
                self.gain_n[(kind, e.depth)] += 1

    def _on_request(self, e: RequestEvent) -> None:
        r = self.requests.get(e.rid)
        if r is None:
            r = self.requests[e.rid] = RequestView(rid=e.rid)
            while len(self.requests) > self.max_requests:
                self.requests.popitem(last=False)
        r.ver += 1
        r.state = e.state
        r.prompt_tokens = e.prompt_tokens or r.prompt_tokens
        r.output_tokens = max(e.output_tokens, r.output_tokens)
        r.finish_reason = e.finish_reason or r.finish_reason
        r.accept_len = e.accept_len if e.accept_len is not None else r.accept_len
        r.error = e.error or r.error
        if e.tokens:
            r.tokens.extend(e.tokens)
            del r.tokens[: max(0, len(r.tokens) - self.max_tokens)]

    def _on_engine(self, e: EngineEvent) -> None:
        self.engine = e
        self.num_running, self.num_waiting = e.num_running, e.num_waiting
        self.spark_tps.append(e.gen_tokens_per_s)

    def _on_drops(self, e: DropsEvent) -> None:
        self.dropped = self._all_drops()

    def _on_snapshot(self, e: SnapshotEvent) -> None:
        if e.engine is not None:
            self.engine = e.engine
            self.num_running, self.num_waiting = e.engine.num_running, e.engine.num_waiting
        for r in e.requests:
            self._on_request(r)
        if e.last_acceptance is not None and e.last_acceptance.S:
            self.S = self.S or e.last_acceptance.S
        self.dropped = self._all_drops()

    def _all_drops(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for d in self.tracker.dropped.values():
            out.update(d)
        return dict(out)

    # --- derived -----------------------------------------------------------------------------------

    @property
    def mean_accept_len(self) -> float | None:
        n = sum(self.accept_hist.values())
        return sum(k * v for k, v in self.accept_hist.items()) / n if n else None

    def mean_gain(self, kind: str, depth: int) -> float | None:
        """Mean "predicted" or "measured" gain of the decisions seen at `depth` (None: none had one)."""
        n = self.gain_n[(kind, depth)]
        return self.gain_sum.get((kind, depth), 0.0) / n if n else None

    @property
    def spec_steps(self) -> int:
        return self.S or (self.engine.spec_steps if self.engine else 0)
