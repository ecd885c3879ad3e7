"""The engine process's collector watch: a collection is counted and timed, `freeze` empties the
generations the collector walks."""

from __future__ import annotations

import gc

from mleagle.engine.service.gc_watch import GcWatch, freeze


def test_a_collection_is_counted_and_timed() -> None:
    w = GcWatch().install()
    try:
        gc.collect(0)
        gc.collect(2)
        snap = w.snapshot()
        assert snap["collections"][0] >= 1 and snap["collections"][2] >= 1
        assert snap["pause_ms"][2] >= snap["max_pause_ms"][2] > 0
        w.reset()
        assert w.snapshot()["collections"] == [0, 0, 0]
    finally:
        w.remove()
    n = len(gc.callbacks)
    w.remove()  # twice is harmless
    assert len(gc.callbacks) == n


def test_freeze_moves_what_is_alive_out_of_reach() -> None:
    keep = [[i] for i in range(1000)]  # containers the collector tracks
    try:
        frozen = freeze()
        assert frozen >= len(keep) and gc.get_count()[0] < 100
    finally:
        gc.unfreeze()
