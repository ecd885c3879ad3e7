"""`LoopLag` (bench serve's client loops): a loop stopped in a blocking call shows as a stall of that length;
the timers of a loop that only waits fire about on time."""

from __future__ import annotations

import asyncio
import time

from mleagle.daemon.loop_lag import STALL_S, LoopLag, summarize


async def test_a_blocked_loop_is_one_stall_of_the_block() -> None:
    lag = LoopLag(period_s=0.002).start()  # finer than the default: a short test
    await asyncio.sleep(0.05)  # idle: timers fire about on time
    quiet = list(lag.lags)
    time.sleep(0.06)  # the loop stopped, as a client process descheduled or blocked in a call
    await asyncio.sleep(0.02)
    await lag.stop()
    s = summarize([lag.lags])
    assert len(quiet) >= 5 and s["timers"] > len(quiet)
    assert s["max_ms"] >= 55 and s["stalls"] >= 1 and s["stalled_ms"] >= 55, s
    assert max(quiet) < 0.055  # the waiting loop's timers were not late by anything like the block
    assert lag._task is None


def test_several_loops_summarize_together() -> None:
    s = summarize([[0.0, 0.001], [0.02, STALL_S]])
    assert s == {"timers": 4, "p50_ms": 5.0, "p99_ms": 20.0, "max_ms": 20.0, "stalls": 2, "stalled_ms": 25.0}
    assert summarize([[], []]) == {"timers": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0, "stalls": 0, "stalled_ms": 0.0}
