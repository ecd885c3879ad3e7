"""The engine process's collector watch: a collection is counted and timed, `freeze` empties the
generations the collector walks."""

from __future__ import annotations

import gc

import pytest

from mleagle.engine.contract.gc_watch import GcWatch, freeze


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


def test_a_snapshot_never_walks_the_frozen_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gc.get_freeze_count()` walks every frozen object (about 11 ms for the engine process's 180k,
    which a pong once a second paid inside the serving loop): the snapshot reports the count taken at
    the freeze instead."""
    w = GcWatch(frozen=1234)

    def walk() -> int:
        raise AssertionError("snapshot walked the permanent generation")

    monkeypatch.setattr(gc, "get_freeze_count", walk)
    assert w.snapshot()["frozen"] == 1234
