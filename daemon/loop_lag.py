"""How late a load generator's event loop runs its own timers: when it fell behind its streams, and by how much.

`bench serve` reads every stream of a client process on one asyncio loop, and its TTFT and ITL are
measured there: a frame the daemon wrote sits in the socket until that loop gets to it. An H200 run at
concurrency 32 (`results/gpu/stop48/`, its request-by-request timeline) found 6 % of first frames read
15-57 ms after they were written, in runs of one client process at a time, with that process's garbage
collections too short to explain it. `LoopLag` runs
beside the streams a timer every `period_s` and records how late each one fires: a loop busy parsing
frames is late by its busy stretch (about a millisecond), one that was stopped (descheduled, blocked
in a call) is late by the whole stop, and the report says which the run met. A late timer is an upper
bound on what the loop owed its streams then, since the streams' frames wait as long. Its cost is a
wake-up every `period_s`: 10 ms, where a stall worth finding is longer than that and a machine that
also serves a CPU engine gives the client's wake-ups the engine's cores (on the 2-core dev VM at
concurrency 4 the client took 2 % of a core with it, 1 % without, 5-6 % with a 2 ms period).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

STALL_S = 0.005  # a timer this late or later counts as a stall: far beyond a loop's busy stretch


class LoopLag:
    """Timer lateness (seconds) of the running loop while `start`ed, in `lags`; `summarize` reads them."""

    def __init__(self, period_s: float = 0.01) -> None:
        self.period_s = period_s
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> LoopLag:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def stop(self) -> None:
        t, self._task = self._task, None
        if t is not None:
            t.cancel()
            try:
                await t
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        p = self.period_s
        while True:
            t = time.perf_counter()
            await asyncio.sleep(p)
            self.lags.append(max(0.0, time.perf_counter() - t - p))


def summarize(runs: list[list[float]]) -> dict[str, Any]:
    """Several loops' lateness together (a closed loop split over client processes): the timers seen,
    their p50 / p99 / max lateness, the stalls (timers `STALL_S` late or more) and their total."""
    lags = sorted(x for r in runs for x in r)
    stalls = [x for x in lags if x >= STALL_S]

    def q(p: float) -> float:
        return round(1e3 * lags[min(len(lags) - 1, int(p * len(lags)))], 3) if lags else 0.0

    return {"timers": len(lags), "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": round(1e3 * lags[-1], 3) if lags else 0.0,
            "stalls": len(stalls), "stalled_ms": round(1e3 * sum(stalls), 3)}
