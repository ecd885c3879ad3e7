"""Python's garbage collector in a serving process: freeze what start-up built, and time every collection.

Both serving processes use it (hence the contract: the daemon imports nothing else of the engine).
A cyclic collection of the oldest generation walks every tracked container the process holds: in the
engine process that is the model's module tree, the tokenizer's vocabulary and merges, the graph
runners, and every request alive. Built once and never freed, they need never be walked, so once the
process is ready `freeze()` collects once and moves everything alive into the permanent generation
(`gc.freeze`), as SGLang and vLLM do after start-up. `GcWatch` times each collection through
`gc.callbacks` (a callback pair costs a few microseconds per collection), so a pause that lands in an
engine step shows in the engine's stats (`/debug/engine`, the benchmarks' JSON) instead of as an
unexplained slow step; the daemon freezes once its engine is ready and reports its own collections in
`/debug/engine` (`daemon.gc`).
"""

from __future__ import annotations

import gc
import time
from typing import Any


def freeze() -> int:
    """Collect, then move every object alive into the permanent generation; returns how many it holds."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcWatch:
    """Collections and their pauses, per generation, since `install` (or the last `reset`)."""

    def __init__(self, frozen: int = 0) -> None:
        # `gc.get_freeze_count()` walks the whole permanent generation (a linked list of every object
        # frozen at start-up, hundreds of thousands): counted once, at the freeze, not per snapshot.
        self.frozen = frozen
        self.count = [0, 0, 0]
        self.pause_s = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]
        self._t0 = 0.0
        self._on = False

    def install(self) -> GcWatch:
        if not self._on:
            gc.callbacks.append(self._callback)
            self._on = True
        return self

    def remove(self) -> None:
        if self._on:
            gc.callbacks.remove(self._callback)
            self._on = False

    def reset(self) -> None:
        self.count, self.pause_s, self.max_s = [0, 0, 0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        g = int(info.get("generation", 0))
        dt = time.perf_counter() - self._t0
        self.count[g] += 1
        self.pause_s[g] += dt
        self.max_s[g] = max(self.max_s[g], dt)

    def snapshot(self) -> dict[str, Any]:
        """Counts, total and longest pause (ms) per generation, and the objects frozen at start-up."""
        return {"collections": list(self.count), "pause_ms": [round(s * 1e3, 3) for s in self.pause_s],
                "max_pause_ms": [round(s * 1e3, 3) for s in self.max_s], "frozen": self.frozen}
