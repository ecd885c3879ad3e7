"""State events: the typed, versioned schema the engine publishes and `mleagle-tui` displays.

This module is the one place every event and field is documented. It is torch-free (pydantic v2 only)
so the daemon and the TUI import it on machines without torch. Each event is a pydantic model with a
literal `type` tag; `Event` is the discriminated union of all of them, `parse_event` validates one
JSON object (dict, str or bytes) into the right model and raises `EventError` with a readable message,
and `dump_event` writes one JSON line. Events carry only what the host already knows (batch sizes,
tensor shapes, host-side counters and timers), so emitting never needs a device sync. A recording is a
JSON-Lines file whose first line is a `RecordingHeader` (format name and schema version) followed by
one event per line; `write_recording`, `RecordingWriter` and `read_recording` handle it. Unknown extra
fields are ignored (a newer engine may add fields without breaking an older TUI); a different
`SCHEMA_VERSION`, an unknown `type`, a missing field or a wrong type are errors.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Annotated, Final, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

# Bump on any change that an older reader would misread (renamed/removed field, changed meaning).
# Adding an optional field does not need a bump: readers ignore fields they do not know. Nor does a new
# event type: an older reader rejects it as unknown (counted as malformed) and reads every other event
# as before, where a bump would make it refuse them all.
SCHEMA_VERSION = 1
RECORDING_FORMAT: Final = "mleagle-events"  # Final: typed as the Literal that RecordingHeader.format is

# Forward modes as the engine's ForwardBatch names them. IDLE is a scheduler step with nothing to run.
Mode: TypeAlias = Literal["EXTEND", "DECODE", "TARGET_VERIFY", "DRAFT_EXTEND", "MIXED", "IDLE"]
# "replay": the forward replayed a captured graph; "eager": it ran eagerly (see `eager_reason`).
GraphUse: TypeAlias = Literal["replay", "eager"]
RequestState: TypeAlias = Literal["queued", "running", "finished", "aborted", "preempted"]


class EventError(ValueError):
    """A malformed event or recording line: not JSON, unknown type, wrong schema version, bad fields."""


class _Base(BaseModel):
    """Fields every event has. `ts` is wall-clock seconds (time.time()) at emit; `seq` is assigned by
    the EventBus (monotonic per engine process, so a consumer can see gaps from dropped events)."""

    model_config = ConfigDict(extra="ignore")
    v: int = SCHEMA_VERSION
    ts: float = Field(default_factory=time.time)
    seq: int = 0


class BatchEvent(_Base):
    """One scheduler step: what ran, on which requests, graph or eager, and how long it took.

    `num_tokens_per_req[i]` is the tokens request `rids[i]` contributed (extend length for EXTEND,
    1 for DECODE, W = S+1 for TARGET_VERIFY / DRAFT_EXTEND). `num_tokens` is their sum. `bs` is the raw
    batch size, `padded_bs` the graph bucket it was padded to (== bs when eager; for an EXTEND on a
    prefill graph, the token bucket). A MIXED step (a prefill beside the decode iteration in flight)
    reports each forward with its own mode. `eager_reason` says
    why it did not replay a graph: "cpu", "disabled", "bs>max_bucket", "extend", "tp-layout", ...
    `runner` is "target" for the target forward of the step; draft-extend forwards of layer k use
    "draft{k}" when the engine reports them separately. `num_running`/`num_waiting` are the scheduler's
    queue lengths after this step (so the TUI's overview follows the step rate, not the status rate).
    """

    type: Literal["batch"] = "batch"
    step: int
    mode: Mode
    runner: str = "target"
    rids: list[str] = Field(default_factory=list)
    num_tokens_per_req: list[int] = Field(default_factory=list)
    num_tokens: int = 0
    bs: int = 0
    padded_bs: int = 0
    graph: GraphUse = "eager"
    eager_reason: str | None = None
    duration_s: float = 0.0
    num_running: int | None = None
    num_waiting: int | None = None


class PoolEvent(_Base):
    """Occupancy of one runner's pools: "target", or "draft0".."draft{S-1}" (each draft layer has its own).

    `kv_used`/`kv_total` count KV token slots (pages × page_size); `req_used`/`req_total` count rows of
    the request-to-token map. After every request ends, used must return to 0 for every runner.
    `kv_used` counts slots held by requests (their own and the cached prefixes they use); `kv_cached`
    counts slots the prefix cache holds, `kv_evictable` those of them no request uses (reusable at
    once, so not in `kv_used`). The target and every draft runner hold a token's KV at the same slot,
    so the cache's figures are the same for every runner (0 with the cache off).
    """

    type: Literal["pool"] = "pool"
    runner: str
    kv_used: int
    kv_total: int
    kv_cached: int = 0
    kv_evictable: int = 0
    req_used: int
    req_total: int
    page_size: int = 1
    step: int | None = None


class GraphEvent(_Base):
    """State of one graph runner (cumulative since start): its captured batch-size buckets, replays per
    bucket and eager fallbacks by reason. On CPU `enabled` is False, `buckets` is empty and every
    forward is counted in `eager` (reason "cpu"). A runner's prefill graphs come as one more event,
    runner "<name>:prefill", mode EXTEND, whose buckets are token counts (its eager prefills are
    counted in the runner's own `eager`)."""

    type: Literal["graph"] = "graph"
    runner: str
    enabled: bool = False
    mode: Mode | None = None
    buckets: list[int] = Field(default_factory=list)
    replays: dict[int, int] = Field(default_factory=dict)
    eager: dict[str, int] = Field(default_factory=dict)
    capture_time_s: float | None = None


class LogprobMetaEvent(_Base):
    """Row-count metadata of one forward: the invariant "one rule for row counts" made visible.

    `width` is W (1 for DECODE/EXTEND rows, S+1 for TARGET_VERIFY/DRAFT_EXTEND), `logit_rows` the rows
    the forward's logits actually have (a host-known shape), `expected_rows` the row-count rule's value.
    `global_num_tokens[r]` and `global_num_tokens_for_logprob[r]` are the per-rank token and logprob token
    counts that drive tensor-parallel gathers (one entry when tp_size is 1). In the "all_reduce" `layout`
    every rank holds every token and logit row; in "scattered" tokens and rows are padded to a multiple
    of tp_size and split evenly. `agree` is the engine's check that these are consistent with the logit
    rows under the layout's rule; `LogprobMetaEvent.build` computes it by the one-rank default rule.
    """

    type: Literal["logprob_meta"] = "logprob_meta"
    runner: str
    mode: Mode
    step: int | None = None
    bs: int
    width: int = 1
    logit_rows: int
    expected_rows: int | None = None
    global_num_tokens: list[int] = Field(default_factory=list)
    global_num_tokens_for_logprob: list[int] = Field(default_factory=list)
    tp_size: int = 1
    layout: Literal["all_reduce", "scattered"] | None = None  # None: an engine that predates the field
    agree: bool

    @classmethod
    def build(
        cls,
        *,
        runner: str,
        mode: Mode,
        bs: int,
        width: int,
        logit_rows: int,
        global_num_tokens: list[int],
        global_num_tokens_for_logprob: list[int],
        expected_rows: int | None = None,
        tp_size: int = 1,
        step: int | None = None,
    ) -> LogprobMetaEvent:
        """Default agreement rule: the logprob counts over ranks sum to the logit rows, and the logit
        rows equal `expected_rows` when given. Layouts with another rule pass `agree` to the constructor."""
        ok = sum(global_num_tokens_for_logprob) == logit_rows
        if expected_rows is not None:
            ok = ok and logit_rows == expected_rows
        return cls(
            runner=runner, mode=mode, step=step, bs=bs, width=width, logit_rows=logit_rows,
            expected_rows=expected_rows, global_num_tokens=list(global_num_tokens),
            global_num_tokens_for_logprob=list(global_num_tokens_for_logprob), tp_size=tp_size, agree=ok,
        )


class AcceptanceEvent(_Base):
    """One speculative iteration (verify + S draft-extend steps) over a batch of `bs` requests.

    `accepted_per_depth[j]` is how many of the bs requests accepted the draft at depth j (j = 0..S-1;
    non-increasing in chain mode). `accept_lens[i]` is request i's accepted drafts + 1 (1..S+1), in the
    order of `rids` when given. `draft_time_s` is the draft-extend time of the iteration, split per draft
    layer in `draft_time_per_layer_s` when known; `verify_time_s` the target verify forward. Times are
    host timers around the forwards (on GPU they include the launch and the sync the step already does).
    """

    type: Literal["acceptance"] = "acceptance"
    step: int
    S: int
    bs: int
    accepted_per_depth: list[int]
    accept_lens: list[int] = Field(default_factory=list)
    rids: list[str] = Field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    draft_time_per_layer_s: list[float] = Field(default_factory=list)


class SpecPolicyEvent(_Base):
    """One decode iteration's draft depth as the speculation policy chose it (speculative engines only).

    `depth` is S' in 0..`S` (0: a plain decode step, no draft ran; S: every draft layer), `mode` the
    policy's mode (auto, always, off, cycle) and `reason` why it chose this depth: "best", "switch",
    "explore: not measured yet", "explore: runner-up", "constrained", or the fixed mode's name.
    `predicted_gain` is the expected tokens/s at this depth over depth 0's (1.0: equal; 0.0: no
    prediction, as in a fixed mode or while measuring); `measured_gain` the policy's latest measured
    one, an iteration's tokens/s over depth 0's measured rate in its batch-size bucket (0.0: depth 0 not
    measured there yet; an iteration after a prefill or a catch-up is not timed and keeps the previous
    figure). `catch_up` counts the requests whose draft layers were caught up before the iteration ran.
    `step` is the scheduler step that applied the iteration's results (that of its batch and acceptance
    events), `bs` its batch size.
    """

    type: Literal["spec_policy"] = "spec_policy"
    step: int
    bs: int
    depth: int
    S: int
    mode: str = ""
    reason: str = ""
    predicted_gain: float = 0.0
    measured_gain: float = 0.0
    catch_up: int = 0


class SpecPolicyTotals(BaseModel):
    """What the speculation policy did since the engine started serving (its warm-up is forgotten), in
    the engine status: iterations per depth (index = S'), drafts accepted (the tokens speculation gained
    beyond one per request and iteration), iterations spent exploring, depth switches, draft catch-ups
    with the positions they filled and their time, the policy's choices with their mean host time, and
    where served timings discount drafting."""

    model_config = ConfigDict(extra="ignore")
    mode: str = ""
    iterations_by_depth: list[int] = Field(default_factory=list)
    tokens_gained: int = 0
    explore_iterations: int = 0
    switches: int = 0
    catch_ups: int = 0
    catch_up_positions: int = 0
    catch_up_s: float = 0.0
    choose_calls: int = 0
    choose_mean_s: float = 0.0
    # Batch-size buckets ("64": sizes up to 64) where drafting cost more under traffic than the warm-up
    # timed, with the discount served rates put on drafting there (1.0: none; see engine/spec/policy.py).
    served_discount: dict[str, float] = Field(default_factory=dict)


class TopToken(BaseModel):
    """One alternative at a position: token id, its text piece (when detokenized) and logprob."""

    model_config = ConfigDict(extra="ignore")
    token_id: int
    text: str | None = None
    logprob: float


class TokenEvent(BaseModel):
    """One emitted token for the drill-down: id, text piece, logprob, top alternatives (best first),
    and the speculative depth that produced it (0 = bonus/target token, j ≥ 1 = accepted draft j)."""

    model_config = ConfigDict(extra="ignore")
    token_id: int
    text: str | None = None
    logprob: float | None = None
    top: list[TopToken] = Field(default_factory=list)
    depth: int | None = None


class RequestEvent(_Base):
    """Request lifecycle: sent on every state change, and optionally per step with the new tokens.

    `tokens` holds only the tokens new since the previous event for this rid (a delta), so a consumer
    appends them. `finish_reason` is set when state is finished/aborted ("stop", "length", "abort",
    "error", or a stop string/id description). `accept_len` is this request's mean accept length so far.
    """

    type: Literal["request"] = "request"
    rid: str
    state: RequestState
    finish_reason: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    tokens: list[TokenEvent] | None = None
    accept_len: float | None = None
    error: str | None = None


class EngineEvent(_Base):
    """Engine status, sent periodically (about once a second) and on start.

    Throughput counters are cumulative since start (`*_total`); `gen_tokens_per_s` and
    `prompt_tokens_per_s` are rates over the last status interval. `mean_accept_len` is over the same
    interval (accepted drafts + 1 per verify); None without speculation."""

    type: Literal["engine"] = "engine"
    model: str = ""
    draft: str | None = None
    spec_steps: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    tp_size: int = 1
    uptime_s: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    prompt_tokens_total: int = 0
    gen_tokens_total: int = 0
    requests_finished_total: int = 0
    gen_tokens_per_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    mean_accept_len: float | None = None
    steps_total: int = 0
    # Prefix cache (None when it is off): prompt tokens looked up and found at admission, cumulative.
    prefix_cache_queries_total: int | None = None
    prefix_cache_hits_total: int | None = None
    # The speculation policy's totals (None without speculation, or from an engine that predates it).
    spec_policy: SpecPolicyTotals | None = None


class DropsEvent(_Base):
    """Events a stage dropped (bounded queues), by event type, cumulative. `stage` names the queue:
    "engine" (EventBus), "publisher" (ZMQ HWM), "relay" (the daemon's per-subscriber queue)."""

    type: Literal["drops"] = "drops"
    stage: str
    dropped: dict[str, int] = Field(default_factory=dict)


class SnapshotEvent(_Base):
    """Current state, sent first to a new subscriber: engine status, the latest pool and graph state per
    runner, the requests not yet finished, and the last batch, acceptance and speculation-policy events."""

    type: Literal["snapshot"] = "snapshot"
    engine: EngineEvent | None = None
    pools: list[PoolEvent] = Field(default_factory=list)
    graphs: list[GraphEvent] = Field(default_factory=list)
    requests: list[RequestEvent] = Field(default_factory=list)
    last_batch: BatchEvent | None = None
    last_acceptance: AcceptanceEvent | None = None
    last_spec_policy: SpecPolicyEvent | None = None
    dropped: dict[str, int] = Field(default_factory=dict)


Event = Annotated[
    BatchEvent | PoolEvent | GraphEvent | LogprobMetaEvent | AcceptanceEvent | SpecPolicyEvent | RequestEvent
    | EngineEvent | DropsEvent | SnapshotEvent,
    Field(discriminator="type"),
]
EVENT_TYPES: dict[str, type[BaseModel]] = {
    "batch": BatchEvent, "pool": PoolEvent, "graph": GraphEvent, "logprob_meta": LogprobMetaEvent,
    "acceptance": AcceptanceEvent, "spec_policy": SpecPolicyEvent, "request": RequestEvent, "engine": EngineEvent,
    "drops": DropsEvent, "snapshot": SnapshotEvent,
}
_adapter: TypeAdapter[Event] = TypeAdapter(Event)


def parse_event(obj: dict | str | bytes) -> Event:
    """Validate one event from a dict or a JSON text; raises EventError saying what is wrong."""
    if isinstance(obj, (str, bytes, bytearray)):
        try:
            obj = json.loads(obj)
        except (ValueError, UnicodeDecodeError) as e:
            raise EventError(f"event is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise EventError(f"event must be a JSON object, got {type(obj).__name__}")
    t = obj.get("type")
    if t not in EVENT_TYPES:
        raise EventError(f"unknown event type {t!r} (known: {', '.join(EVENT_TYPES)})")
    v = obj.get("v", SCHEMA_VERSION)
    if v != SCHEMA_VERSION:
        raise EventError(f"event schema version {v!r}, this reader understands {SCHEMA_VERSION}")
    try:
        return _adapter.validate_python(obj)
    except ValidationError as e:
        errs = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()[:5])
        raise EventError(f"malformed {t!r} event: {errs}") from None


def dump_event(e: BaseModel) -> str:
    """One event as one JSON line (no trailing newline)."""
    return e.model_dump_json()


# --- recordings ------------------------------------------------------------------------------------


class RecordingHeader(BaseModel):
    """First line of a recording: format tag, schema version, when and from where it was recorded."""

    model_config = ConfigDict(extra="ignore")
    format: Literal["mleagle-events"] = RECORDING_FORMAT
    schema_version: int = SCHEMA_VERSION
    created: float = Field(default_factory=time.time)
    source: str = ""
    meta: dict[str, object] = Field(default_factory=dict)


class Recording(BaseModel):
    """A loaded recording: its header, the valid events in order, and how many lines were malformed."""

    header: RecordingHeader
    events: list[Event]
    bad_lines: int = 0


class RecordingWriter:
    """Appends events to a JSON-Lines recording as they arrive (used by `mleagle-tui --record`)."""

    def __init__(
        self, path: str | Path, source: str = "", meta: dict[str, object] | None = None, created: float | None = None
    ) -> None:
        self.path = Path(path)
        self.f: IO[str] = self.path.open("w", encoding="utf-8")
        head = RecordingHeader(source=source, meta=meta or {}, created=time.time() if created is None else created)
        self.f.write(head.model_dump_json() + "\n")
        self.count = 0

    def write(self, e: BaseModel) -> None:
        self.f.write(dump_event(e) + "\n")
        self.count += 1

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_recording(
    path: str | Path, events: Iterable[BaseModel], source: str = "", meta: dict[str, object] | None = None,
    created: float | None = None,
) -> int:
    """Write a whole recording; returns the number of events written."""
    with RecordingWriter(path, source=source, meta=meta, created=created) as w:
        for e in events:
            w.write(e)
        return w.count


def read_recording(path: str | Path, strict: bool = False) -> Recording:
    """Load a recording. The header must be valid and of this schema version; malformed event lines
    are skipped and counted in `bad_lines` (or raise EventError when `strict`)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    if not lines:
        raise EventError(f"{path}: empty recording (no header line)")
    try:
        obj = json.loads(lines[0])
        if not isinstance(obj, dict) or obj.get("format") != RECORDING_FORMAT:
            raise ValueError(f"no format={RECORDING_FORMAT!r}")
        head = RecordingHeader.model_validate(obj)
    except (ValueError, ValidationError) as e:
        raise EventError(f"{path}: first line is not a {RECORDING_FORMAT} header ({e})") from None
    if head.schema_version != SCHEMA_VERSION:
        raise EventError(f"{path}: recorded with schema {head.schema_version}, this reader understands {SCHEMA_VERSION}")
    events: list[Event] = []
    bad = 0
    for i, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            events.append(parse_event(line))
        except EventError as e:
            if strict:
                raise EventError(f"{path}:{i}: {e}") from None
            bad += 1
    return Recording(header=head, events=events, bad_lines=bad)
