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
