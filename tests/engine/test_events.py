"""Event schema, recordings, the bounded event bus, the state tracker and the ZMQ transport.

Every event type must survive dump → parse unchanged; malformed input must be rejected with a clear
error; the bus and the publisher must stay bounded and count what they drop when nobody reads. A real
tiny speculative engine under the `cycle` policy, with telemetry attached, reports every depth it ran
(and a target-only engine reports no policy at all).
"""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from pathlib import Path

import pytest
import zmq

from mleagle.engine.contract.event_bus import (
    EventBus,
    StateTracker,
    ZmqEventPublisher,
    runner_order,
    split_events,
)
from mleagle.engine.contract.events import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    AcceptanceEvent,
    BatchEvent,
    DropsEvent,
    EngineEvent,
    EventError,
    GraphEvent,
    LogprobMetaEvent,
    PoolEvent,
    RecordingWriter,
    RequestEvent,
    SnapshotEvent,
    SpecPolicyEvent,
    SpecPolicyTotals,
    TokenEvent,
    TopToken,
    dump_event,
    parse_event,
    read_recording,
    write_recording,
)
from mleagle.engine.service.telemetry import Telemetry
from tests.spec_helpers import greedy, tiny_engine

SAMPLE = Path(__file__).parents[1] / "data" / "events_sample.jsonl"


def one_of_each() -> list:
    tok = TokenEvent(token_id=42, text=" hi", logprob=-0.25, top=[TopToken(token_id=42, text=" hi", logprob=-0.25),
                                                                  TopToken(token_id=7, text=" yo", logprob=-1.5)], depth=1)
    pool = PoolEvent(runner="draft1", kv_used=12, kv_total=4096, req_used=2, req_total=64, page_size=1, step=3)
    graph = GraphEvent(runner="target", enabled=True, mode="DECODE", buckets=[1, 2, 4, 8], replays={1: 5, 4: 2},
                       eager={"bs>max_bucket": 1}, capture_time_s=0.5)
    batch = BatchEvent(step=3, mode="TARGET_VERIFY", rids=["a", "b"], num_tokens_per_req=[3, 3], num_tokens=6,
                       bs=2, padded_bs=2, graph="eager", eager_reason="cpu", duration_s=0.01, num_running=2,
                       num_waiting=1)
    acc = AcceptanceEvent(step=3, S=2, bs=2, accepted_per_depth=[2, 1], accept_lens=[3, 2], rids=["a", "b"],
                          draft_time_s=0.002, verify_time_s=0.004, draft_time_per_layer_s=[0.001, 0.001])
    req = RequestEvent(rid="a", state="running", prompt_tokens=5, output_tokens=3, tokens=[tok], accept_len=2.5)
    pol = SpecPolicyEvent(step=3, bs=2, depth=1, S=2, mode="auto", reason="switch", predicted_gain=1.25,
                          measured_gain=1.1, catch_up=2)
    tot = SpecPolicyTotals(mode="auto", iterations_by_depth=[4, 7, 2], tokens_gained=9, explore_iterations=6,
                           switches=3, catch_ups=2, catch_up_positions=6, catch_up_s=0.003, choose_calls=13,
                           choose_mean_s=6e-6)
    eng = EngineEvent(model="smollm2-135m", draft="oracle", spec_steps=2, device="cpu", dtype="float32",
                      uptime_s=12.5, num_running=2, num_waiting=1, gen_tokens_total=100, gen_tokens_per_s=33.3,
                      mean_accept_len=2.5, spec_policy=tot)
    lpm = LogprobMetaEvent.build(runner="target", mode="TARGET_VERIFY", bs=2, width=3, logit_rows=6,
                                 global_num_tokens=[6], global_num_tokens_for_logprob=[6], expected_rows=6, step=3)
    drops = DropsEvent(stage="engine", dropped={"batch": 3})
    snap = SnapshotEvent(engine=eng, pools=[pool], graphs=[graph], requests=[req], last_batch=batch,
                         last_acceptance=acc, last_spec_policy=pol, dropped={"batch": 3})
    return [pool, graph, batch, acc, pol, req, eng, lpm, drops, snap]


def test_every_type_round_trips() -> None:
    evs = one_of_each()
    assert {e.type for e in evs} == set(EVENT_TYPES)
    for e in evs:
        line = dump_event(e)
        assert "\n" not in line
        back = parse_event(line)
        assert type(back) is type(e)
        assert back == e
        assert parse_event(line.encode()) == e
        assert parse_event(json.loads(line)) == e
        assert back.v == SCHEMA_VERSION


def test_graph_replay_keys_survive_json() -> None:
    # JSON object keys are strings; the bucket keys must come back as ints.
    g = parse_event(dump_event(GraphEvent(runner="draft0", buckets=[1, 8], replays={8: 3})))
    assert g.replays == {8: 3}


def test_logprob_meta_agree_rule() -> None:
    ok = LogprobMetaEvent.build(runner="target", mode="DECODE", bs=4, width=1, logit_rows=4,
                                global_num_tokens=[2, 2], global_num_tokens_for_logprob=[2, 2], tp_size=2)
    assert ok.agree
    # the bug class: a branch hand-writes [bs] where verify makes bs·W rows
    bad = LogprobMetaEvent.build(runner="target", mode="TARGET_VERIFY", bs=4, width=3, logit_rows=12,
                                 global_num_tokens=[12], global_num_tokens_for_logprob=[4])
    assert not bad.agree
    off = LogprobMetaEvent.build(runner="draft0", mode="DRAFT_EXTEND", bs=4, width=3, logit_rows=12,
                                 global_num_tokens=[12], global_num_tokens_for_logprob=[12], expected_rows=4)
    assert not off.agree


@pytest.mark.parametrize(
    "raw, needle",
    [
        ("not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"type": "nope"}', "unknown event type"),
        ('{"step": 1}', "unknown event type"),
        ('{"type": "batch", "mode": "DECODE"}', "step"),
        ('{"type": "batch", "step": 1, "mode": "WARP"}', "mode"),
        ('{"type": "pool", "runner": "target", "kv_used": "many", "kv_total": 1, "req_used": 0, "req_total": 1}',
         "kv_used"),
        ('{"type": "logprob_meta", "runner": "t", "mode": "DECODE", "bs": 1, "logit_rows": 1}', "agree"),
        ('{"type": "engine", "v": 999}', "schema version"),
        ('{"type": "spec_policy", "step": 1, "bs": 1, "S": 2}', "depth"),
        ('{"type": "engine", "spec_policy": {"iterations_by_depth": "lots"}}', "iterations_by_depth"),
    ],
)
def test_malformed_rejected(raw: str | bytes, needle: str) -> None:
    with pytest.raises(EventError, match=needle):
        parse_event(raw)


def test_unknown_fields_ignored_for_forward_compat() -> None:
    e = parse_event({"type": "pool", "runner": "target", "kv_used": 1, "kv_total": 2, "req_used": 0,
                     "req_total": 1, "new_field_from_a_newer_engine": [1, 2]})
    assert isinstance(e, PoolEvent) and e.kv_total == 2
    # a status from an engine that predates the policy's totals (or one without speculation)
    old = parse_event({"type": "engine", "model": "m", "spec_steps": 2})
    assert isinstance(old, EngineEvent) and old.spec_policy is None


def test_recording_round_trip_and_bad_lines(tmp_path: Path) -> None:
    evs = one_of_each()
    p = tmp_path / "rec.jsonl"
    assert write_recording(p, evs, source="test") == len(evs)
    rec = read_recording(p)
    assert rec.header.schema_version == SCHEMA_VERSION and rec.header.source == "test"
    assert rec.events == evs and rec.bad_lines == 0
    with p.open("a") as f:
        f.write("garbage\n\n" + '{"type":"batch"}\n' + dump_event(evs[0]) + "\n")
    rec = read_recording(p)
    assert rec.bad_lines == 2 and len(rec.events) == len(evs) + 1
    with pytest.raises(EventError, match=f":{len(evs) + 2}:"):  # the header, the events, then the garbage
        read_recording(p, strict=True)
    q = tmp_path / "noheader.jsonl"
    q.write_text(dump_event(evs[0]) + "\n")
    with pytest.raises(EventError, match="header"):
        read_recording(q)
    with RecordingWriter(tmp_path / "w.jsonl") as w:
        w.write(evs[2])
    assert read_recording(tmp_path / "w.jsonl").events == [evs[2]]


def test_sample_recording_is_valid() -> None:
    rec = read_recording(SAMPLE, strict=True)
    types = {e.type for e in rec.events}
    assert {"batch", "pool", "graph", "logprob_meta", "acceptance", "request", "engine"} <= types
    assert rec.events[0].type == "snapshot"
    ts = [e.ts for e in rec.events]
    assert ts == sorted(ts)


def test_bus_bounded_drops_oldest_and_counts() -> None:
    bus = EventBus(maxlen=10)
    for i in range(25):
        bus.emit(BatchEvent(step=i, mode="DECODE") if i % 2 else PoolEvent(runner="target", kv_used=i, kv_total=9,
                                                                             req_used=0, req_total=1))
    assert len(bus) == 10
    assert sum(bus.dropped.values()) == 15
    assert bus.dropped == {"pool": 8, "batch": 7}  # drops 0..14: eight even (pool), seven odd (batch)
    out = bus.drain()
    assert [e.seq for e in out] == list(range(16, 26))  # newest kept, seq numbers show the gap
    assert bus.drain() == [] and len(bus) == 0
    assert bus.drops_event().dropped == {"pool": 8, "batch": 7}


def test_bus_never_raises_and_can_be_disabled() -> None:
    bus = EventBus(maxlen=4)
    bus.emit(object())  # not an event: cannot take a seq; counted, not raised
    assert bus.dropped["error"] == 1 and len(bus) == 0
    bus.enabled = False
    bus.emit(BatchEvent(step=0, mode="IDLE"))
    assert len(bus) == 0
    bus.enabled = True
    bus.emit(BatchEvent(step=0, mode="IDLE"))
    assert bus.drain(limit=5)[0].step == 0


def test_bus_emit_is_cheap() -> None:
    bus = EventBus(maxlen=1000)
    e = BatchEvent(step=0, mode="DECODE")
    t = time.perf_counter()
    for _ in range(20000):
        bus.emit(e)
    per = (time.perf_counter() - t) / 20000
    assert len(bus) == 1000 and bus.dropped["batch"] == 19000
    assert per < 50e-6  # generous: a plain append is ~1 µs; this guards against O(n) or blocking


def test_state_tracker_snapshot() -> None:
    st = StateTracker()
    for e in one_of_each()[:-1]:
        st.apply(e)
    st.apply(PoolEvent(runner="draft0", kv_used=1, kv_total=10, req_used=1, req_total=4))
    st.apply(PoolEvent(runner="target", kv_used=5, kv_total=10, req_used=1, req_total=4))
    st.apply(PoolEvent(runner="target", kv_used=7, kv_total=10, req_used=1, req_total=4))
    st.apply(RequestEvent(rid="b", state="queued", prompt_tokens=3))
    snap = st.snapshot()
    assert [p.runner for p in snap.pools] == ["target", "draft0", "draft1"]
    assert snap.pools[0].kv_used == 7
    assert {r.rid for r in snap.requests} == {"a", "b"}
    assert all(r.tokens is None for r in snap.requests)  # token history is not state
    st.apply(RequestEvent(rid="a", state="finished", finish_reason="stop"))
    assert {r.rid for r in st.snapshot().requests} == {"b"}
    assert snap.last_batch.step == 3 and snap.engine.model == "smollm2-135m" and snap.dropped == {"batch": 3}
    assert snap.last_spec_policy is not None and snap.last_spec_policy.reason == "switch"
    assert snap.engine.spec_policy is not None and snap.engine.spec_policy.iterations_by_depth == [4, 7, 2]
    # a snapshot folded into a fresh tracker reproduces itself
    st2 = StateTracker()
    st2.apply(parse_event(dump_event(snap)))
    assert st2.snapshot().model_dump(exclude={"ts"}) == snap.model_dump(exclude={"ts"})
    assert sorted(["draft10", "draft2", "zz", "target"], key=runner_order) == ["target", "draft2", "draft10", "zz"]


def test_zmq_round_trip_one_message_per_publish() -> None:
    """A `publish` goes out as one message [kinds, lines] (a single event is [type, JSON]); `split_events`
    gives every event back in order with its type, and each parses; a malformed JSON line is an
    `EventError`, which the daemon's relay skips, and a message whose frames do not pair is dropped."""
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", max_per_msg=4)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.address)
    try:
        evs = one_of_each()
        assert len(evs) > 4  # more than one message's worth
        got: list = []
        deadline = time.monotonic() + 5
        # PUB drops until the subscription has propagated: publish until something arrives
        while not got and time.monotonic() < deadline:
            pub.publish(evs[:1])
            if sub.poll(50):
                got.append(sub.recv_multipart())
        assert got, "subscriber never received anything"
        while sub.poll(100):
            sub.recv_multipart()
        assert pub.publish(evs) == len(evs)
        msgs = []
        while len(msgs) < -(-len(evs) // 4):
            assert sub.poll(2000), "a message did not arrive"
            msgs.append(sub.recv_multipart())
        pairs = [p for m in msgs for p in split_events(m)]
        assert [k.decode() for k, _ in pairs] == [e.type for e in evs]
        assert [parse_event(raw).model_dump(exclude={"ts"}) for _, raw in pairs] == \
            [e.model_dump(exclude={"ts"}) for e in evs]
        assert split_events([b"pool", b"{not json"]) == [(b"pool", b"{not json")]
        with pytest.raises(EventError):
            parse_event(b"{not json")
        assert split_events([b"pool batch", b"{}"]) == []  # two kinds, one line: not a message of ours
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.close()


def test_zmq_slow_subscriber_never_blocks_publisher() -> None:
    ctx = zmq.Context()
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", hwm=50, ctx=ctx)
    sub = ctx.socket(zmq.SUB)  # connected and subscribed, but never reads
    sub.setsockopt(zmq.RCVHWM, 50)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.address)
    try:
        # wait until the subscription is live (XPUB_NODROP sends succeed only to connected peers)
        time.sleep(0.3)
        big = BatchEvent(step=0, mode="DECODE", rids=[f"r{i}" for i in range(200)],
                         num_tokens_per_req=[1] * 200)  # ~2.5 kB, so kernel buffers fill quickly
        n = 20000
        t = time.perf_counter()
        sent = sum(pub.publish([big]) for _ in range(n))  # a message per call, as the engine's pump sends
        dt = time.perf_counter() - t
        assert sent + pub.dropped["batch"] == n
        assert pub.dropped["batch"] > n // 2, pub.dropped  # bounded: most of them were dropped, counted
        assert sent < n // 2
        assert dt < 20, dt  # never blocked (the send is NOBLOCK; this only catches a hang)
    finally:
        sub.close(linger=0)
        pub.close()
        ctx.term()


# --- a real engine's speculation-policy events -------------------------------------------------------


def test_spec_policy_events_from_a_real_engine() -> None:
    """Under `cycle` (depths 0, 1, ..., S in turn) every decode step reports the depth its iteration ran,
    the same as its target batch shows (depth 0: a plain DECODE of one token per request and no
    acceptance event; depth d: a TARGET_VERIFY of d + 1 with one), its reason and, where a deeper
    iteration follows a shallower one, the requests whose draft layers caught up first; the status
    totals count exactly these iterations and the drafts their acceptance events accepted."""
    e = tiny_engine("random:3:2", spec_policy="cycle")
    bus = EventBus()
    tel = Telemetry.attach(e, bus)
    e.add_request("a", list(range(5, 17)), greedy(14))
    e.add_request("b", list(range(30, 38)), greedy(10))
    while e.has_work():
        e.step()
    tel.status()
    evs = bus.drain()
    pol = [x for x in evs if isinstance(x, SpecPolicyEvent)]
    s = 3
    assert len(pol) >= 2 * (s + 1) and {x.S for x in pol} == {s}
    assert {x.depth for x in pol} == set(range(s + 1))
    assert all(b.depth == (a.depth + 1) % (s + 1) for a, b in itertools.pairwise(pol))  # one depth after another
    assert {x.reason for x in pol} == {x.mode for x in pol} == {"cycle"}
    assert all(x.predicted_gain == 0.0 for x in pol)  # a fixed order predicts nothing
    target = {x.step: x for x in evs if isinstance(x, BatchEvent) and x.runner == "target"}
    acc = {x.step: x for x in evs if isinstance(x, AcceptanceEvent)}
    for x in pol:
        b = target[x.step]
        assert b.mode == ("DECODE" if x.depth == 0 else "TARGET_VERIFY") and b.bs == x.bs
        assert b.num_tokens == x.bs * (x.depth + 1)
        assert (x.step in acc) == (x.depth > 0)
    # depth 0 leaves every draft layer behind, so the next (deeper) iteration catches its requests up
    assert all(x.catch_up == 0 for x in pol if x.depth == 0)
    assert all(b.catch_up == b.bs for a, b in itertools.pairwise(pol) if a.depth == 0)
    tot = [x for x in evs if isinstance(x, EngineEvent)][-1].spec_policy
    assert tot is not None and tot.mode == "cycle"
    assert tot.iterations_by_depth == [sum(x.depth == d for x in pol) for d in range(s + 1)]
    assert tot.choose_calls == len(pol) and tot.choose_mean_s > 0
    assert tot.switches == len(pol)  # every choice changed the depth (the first from S, the initial one)
    assert tot.tokens_gained == sum(sum(a.accept_lens) - len(a.accept_lens) for a in acc.values())
    assert tot.catch_ups > 0 and tot.catch_up_positions >= tot.catch_ups and tot.catch_up_s > 0
    st = StateTracker()
    for x in evs:
        st.apply(x)
    assert st.snapshot().last_spec_policy == pol[-1]


def test_target_only_engine_reports_no_policy() -> None:
    e = tiny_engine()
    bus = EventBus()
    tel = Telemetry.attach(e, bus)
    e.generate([list(range(5, 12))], greedy(4))
    tel.status()
    evs = bus.drain()
    assert any(isinstance(x, BatchEvent) and x.mode == "DECODE" for x in evs)
    assert not any(isinstance(x, SpecPolicyEvent) for x in evs)
    assert [x for x in evs if isinstance(x, EngineEvent)][-1].spec_policy is None
    assert e.stats()["spec_policy"] is None


def test_without_full_detail_only_a_sample_of_steps_is_reported_and_the_idle_state_last() -> None:
    """With `full` off (an engine process nobody watches) the per-step events describe at most one step
    per `sample_every_s`, each step whole (its batches, acceptance, decision and every pool); request
    lifecycle events all still go out; `idle` reports the last step if it was left out, so the latest
    pools say free once the requests end. Turned on, every step is reported again."""
    e = tiny_engine("random:2:1", spec_policy="always")
    bus = EventBus()
    tel = Telemetry.attach(e, bus, full=False)
    tel.sample_every_s = 3600.0  # one sampled step in this test: the first
    for i in range(3):
        e.add_request(f"r{i}", list(range(5 + i, 20 + i)), greedy(12))
    steps = 0
    while e.has_work():
        e.step()
        steps += 1
    evs = bus.drain()
    batch_steps = {x.step for x in evs if isinstance(x, BatchEvent)}
    assert len(batch_steps) == 1 and tel.sampled_out == steps - 1
    pools = [x for x in evs if isinstance(x, PoolEvent)]
    assert {p.runner for p in pools} == {"target", "draft0", "draft1"} and {p.step for p in pools} == batch_steps
    states = Counter(x.state for x in evs if isinstance(x, RequestEvent))
    assert states["queued"] == states["finished"] == 3 and states["running"] >= 3
    assert tel.pending is not None
    tel.idle()  # the engine waits: the last step (left out) is reported now, with its pools free
    last = bus.drain()
    assert tel.pending is None
    assert {x.step for x in last if isinstance(x, BatchEvent)} == {e.scheduler.num_steps}
    free = [x for x in last if isinstance(x, PoolEvent)]
    assert len(free) == 3 and all(p.kv_used == 0 and p.req_used == 0 for p in free)
    tel.full = True
    e.add_request("again", list(range(40, 50)), greedy(6))
    n0 = e.scheduler.num_steps
    while e.has_work():
        e.step()
    evs = bus.drain()
    assert {x.step for x in evs if isinstance(x, BatchEvent)} == set(range(n0 + 1, e.scheduler.num_steps + 1))


def test_the_events_cost_script_reports_both_modes(tmp_path) -> None:
    """scripts/events_cost.py: per mode, rounds after a warm-up one, each with its steps, host time in the
    hooks and the pump, and events per step (sampled: never more than every step's)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("events_cost", Path(__file__).parents[2] / "scripts" / "events_cost.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    out = tmp_path / "cost.json"
    assert mod.main(["--draft", "random:2", "--requests", "2", "--tokens", "8", "--rounds", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    every, sampled = res["modes"]["every step"], res["modes"]["sampled"]
    assert len(every) == len(sampled) == 1
    for row in every + sampled:
        assert row["steps"] > 0 and row["hooks_us_per_step"] > 0 and row["pump_us_per_step"] >= 0
    assert every[0]["events_per_step"] > 0 and sampled[0]["events_per_step"] <= every[0]["events_per_step"]
