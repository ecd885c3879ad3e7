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
    """The relay's loop on a real ZMQ pair: a burst of events with no subscriber is all counted; the
    latest-only types are left unparsed then, and a subscriber's snapshot still holds the newest of each
    (and the pools, which are parsed as they come); after that, every event is parsed and queued."""
    import asyncio
    import time

    from mleagle.daemon.events_relay import EventsRelay
    from mleagle.engine.contract.event_bus import ZmqEventPublisher, ZmqEventSubscriber
    from mleagle.engine.contract.events import SpecPolicyEvent

    class Client:
        events: ZmqEventSubscriber | None = None

    c = Client()
    c.events = ZmqEventSubscriber("tcp://127.0.0.1:*", bind=True)
    pub = ZmqEventPublisher(c.events.address, bind=False)
    relay = EventsRelay(c)
    relay.start()
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
        assert relay.received == base + len(burst)
        assert relay.tracker.last_batch is None and b"batch" in relay.latest  # left unparsed, kept raw
        assert set(relay.tracker.pools) == {"target", "draft0"}  # parsed as they came
        relay._settle()
        snap = relay.tracker.snapshot()
        assert snap.last_batch is not None and snap.last_batch.step == 299
        assert snap.last_spec_policy is not None and snap.last_spec_policy.depth == 2
        assert not relay.latest
    finally:
        await relay.stop()
        c.events.close()
        pub.close()
