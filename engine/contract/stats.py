"""Reading `Engine.stats()` over a run: what two snapshots, before and after, say about the engine's
decode iterations. Torch-free, so that the daemon's benchmark (`bench serve`, the matrix and its
offline replay) and the engine's own (`bench gpu`, the profiling scripts) compute the same figures
from the same counters."""

from __future__ import annotations

from typing import Any


def iteration_summary(before: dict[str, Any] | None, after: dict[str, Any] | None, dur: float) -> dict[str, Any] | None:
    """The engine's decode (or verify) iterations over a run, from its stats before and after
    (`Engine.stats`'s `iterations` and `iteration_rows`): how many a second, and the decoding rows each
    carried on average (a fused step's arrivals not counted). Served beside the offline replay, fewer
    rows say requests were away from the engine (between its last token and the client's next
    request), fewer iterations a second that each took longer. On CUDA also the device's time on them
    (`device_busy_s`): its share of the run, and a timed iteration's mean in µs; beside the iterations'
    wall (1 / iterations a second) the difference is the device waiting for the host. None where the
    counters are missing."""
    if not before or not after or dur <= 0 or before.get("iterations") is None or after.get("iterations") is None:
        return None
    it = after["iterations"] - before["iterations"]
    rows = after["iteration_rows"] - before["iteration_rows"]
    out = {"iterations": it, "iterations_per_s": it / dur, "rows_per_iteration": rows / it if it else 0.0}
    timed = (after.get("device_busy_iterations") or 0) - (before.get("device_busy_iterations") or 0)
    if timed > 0:
        busy = after["device_busy_s"] - before["device_busy_s"]
        out.update(device_busy_share=busy / dur, device_us_per_iteration=busy * 1e6 / timed)
    return out
