"""The relay's per-subscriber queue: bounded, oldest dropped first, drops counted by type, filters."""

from __future__ import annotations

from mleagle.daemon.events_relay import SUB_QUEUE, _Sub
from mleagle.engine.contract.events import BatchEvent, PoolEvent


def test_queue_is_bounded_and_counts_drops() -> None:
    s = _Sub(None)
    n = SUB_QUEUE + 100
    for i in range(n):
        s.put(BatchEvent(step=i, mode="DECODE"))
    assert s.q.qsize() == SUB_QUEUE
    assert s.dropped["batch"] == 100
    assert s.q.get_nowait().step == 100  # the oldest went first


def test_type_filter_keeps_only_wanted_types() -> None:
    s = _Sub({"pool"})
    s.put(BatchEvent(step=0, mode="DECODE"))
    s.put(PoolEvent(runner="target", kv_used=0, kv_total=8, req_used=0, req_total=2))
    assert s.q.qsize() == 1 and s.q.get_nowait().type == "pool"
    assert not s.dropped


async def test_relay_drains_a_burst_and_snapshots_the_newest_of_what_it_left_unparsed() -> None:
    """The relay fed by a `ZmqReader` on a real ZMQ pair, as the engine client feeds it: a burst of
    events with no subscriber is all counted; the latest-only types are left unparsed then, and a
    subscriber's snapshot still holds the newest of each (and the pools, which are parsed as they
    come); a new engine generation starts a new tracker."""
    import asyncio
    import time

    import zmq

    from mleagle.daemon.events_relay import EventsRelay
    from mleagle.daemon.zmq_reader import ZmqReader
    from mleagle.engine.contract.event_bus import ZmqEventPublisher
    from mleagle.engine.contract.events import SpecPolicyEvent

    class Client:
        on_events = None

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:*")
    pub = ZmqEventPublisher(sub.getsockopt(zmq.LAST_ENDPOINT).decode(), bind=False)
    c = Client()
    relay = EventsRelay(c)
    relay.start()
    assert c.on_events == relay.feed
    gen = 1
    reader = ZmqReader(sub, lambda batch: c.on_events(gen, batch) if c.on_events else None, multipart=True,
                       max_batch=64)
    reader.start()
    try:
        probe = [PoolEvent(runner="target", kv_used=0, kv_total=8, req_used=0, req_total=2)]
        deadline = time.monotonic() + 5
        while relay.received == 0 and time.monotonic() < deadline:  # until the subscription is live
            pub.publish(probe)
            await asyncio.sleep(0.02)
        base = relay.received
        burst = [BatchEvent(step=i, mode="DECODE") for i in range(300)]
        burst += [SpecPolicyEvent(step=299, bs=4, depth=2, S=3, mode="auto", reason="best")]
        burst += [PoolEvent(runner="draft0", kv_used=3, kv_total=8, req_used=1, req_total=2)]
        assert pub.publish(burst) == len(burst)
        while relay.received < base + len(burst) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert relay.received == base + len(burst)  # more than max_batch: the reader rescheduled itself
        assert relay.tracker.last_batch is None and b"batch" in relay.latest  # left unparsed, kept raw
        assert set(relay.tracker.pools) == {"target", "draft0"}  # parsed as they came
        relay._settle()
        snap = relay.tracker.snapshot()
        assert snap.last_batch is not None and snap.last_batch.step == 299
        assert snap.last_spec_policy is not None and snap.last_spec_policy.depth == 2
        assert not relay.latest
        gen = 2  # a new engine: what the old one said is gone
        n = relay.received
        pub.publish([PoolEvent(runner="target", kv_used=1, kv_total=8, req_used=1, req_total=2)])
        while relay.received == n and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert relay.gen == 2 and set(relay.tracker.pools) == {"target"}
    finally:
        relay.stop()
        assert c.on_events is None
        reader.close()
        sub.close(linger=0)
        pub.close()
        ctx.term()


async def test_zmq_reader_survives_a_failing_callback_and_a_closed_socket() -> None:
    """One failing batch is logged and the reader goes on; `close` unregisters the fd, so closing the
    socket afterwards leaves nothing registered with the loop, and no callback comes after it."""
    import asyncio
    import time

    import zmq

    from mleagle.daemon.zmq_reader import ZmqReader

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("tcp://127.0.0.1:*")
    push = ctx.socket(zmq.PUSH)
    push.connect(pull.getsockopt(zmq.LAST_ENDPOINT).decode())
    got: list[bytes] = []
    calls = 0

    def on_batch(batch: list[bytes]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bad batch")
        got.extend(batch)

    r = ZmqReader(pull, on_batch)
    push.send(b"a")  # before start: the first drain finds it
    r.start()
    deadline = time.monotonic() + 5
    while calls == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    for i in range(5):
        push.send(b"%d" % i)
    while len(got) < 5 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert got == [b"0", b"1", b"2", b"3", b"4"] and r.received == 6
    r.close()
    push.send(b"late")
    await asyncio.sleep(0.1)
    assert got == [b"0", b"1", b"2", b"3", b"4"]
    pull.close(linger=0)
    push.close(linger=0)
    ctx.term()
