"""mleagle-tui's Policy tab: the speculation policy's decisions (depth S', reason, predicted and
measured gain) and totals, from events. A deterministic recording of an `auto` session gives the SVG
snapshot; a real tiny engine under `cycle` (every depth in turn), its events written to a recording
and replayed headless, must show every depth, its reason and the engine's totals.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from mleagle.engine.contract.event_bus import EventBus
from mleagle.engine.contract.events import (
    BatchEvent,
    EngineEvent,
    SnapshotEvent,
    SpecPolicyEvent,
    SpecPolicyTotals,
    write_recording,
)
from mleagle.engine.service.telemetry import Telemetry
from mleagle.tui.model import Dashboard
from tests.spec_helpers import greedy, tiny_engine
from tests.tui_helpers import SIZE, no_animations, paused_at, replay_app, screen_text  # noqa: F401

S = 3


def auto_session() -> list:
    """An `auto` policy's first iterations at batch size 4, S = 3, as an engine reports them: every depth
    measured twice (the full depth first), then depth 2 as the best with a runner-up every 16th, a
    switch to 1, and the engine status with the totals of exactly these decisions. Fixed seed and clock."""
    rng = random.Random(0)
    plan = [(3, "explore: not measured yet")] * 2 + [(0, "explore: not measured yet")] * 2 + \
        [(1, "explore: not measured yet")] * 2 + [(2, "explore: not measured yet")] * 2
    for i in range(1, 60):
        plan.append((1 if i % 16 == 0 else 2, "explore: runner-up" if i % 16 == 0 else "best"))
    plan += [(1, "switch")] + [(1, "best")] * 12
    evs: list = []
    by_depth = [0] * (S + 1)
    prev, switches, catch_ups, gained = S, 0, 0, 0
    for k, (d, why) in enumerate(plan):
        measuring = why.startswith("explore: not")
        pred = 0.0 if measuring else round({1: 1.31, 2: 1.42}[d] + rng.uniform(-0.03, 0.03), 3)
        meas = 0.0 if k < 3 else round({0: 1.0, 1: 1.27, 2: 1.36, 3: 1.12}[d] + rng.uniform(-0.05, 0.05), 3)
        up = d > prev
        evs.append(SpecPolicyEvent(step=10 + k, bs=4, depth=d, S=S, mode="auto", reason=why, predicted_gain=pred,
                                   measured_gain=meas, catch_up=4 if up else 0, ts=2.0 + 0.01 * k))
        by_depth[d] += 1
        switches += d != prev
        catch_ups += up
        gained += sum(rng.random() < 0.7 ** (j + 1) for j in range(d) for _ in range(4))
        prev = d
    tot = SpecPolicyTotals(mode="auto", iterations_by_depth=by_depth, tokens_gained=gained,
                           explore_iterations=sum(why.startswith("explore") for _, why in plan), switches=switches,
                           catch_ups=catch_ups, catch_up_positions=catch_ups * 4 * 3, catch_up_s=catch_ups * 0.0021,
                           choose_calls=len(plan), choose_mean_s=7.5e-6)
    eng = EngineEvent(model="tiny-dummy", draft="random:3", spec_steps=S, num_running=4, ts=1.0)
    end = eng.model_copy(update={"spec_policy": tot, "ts": 2.0 + 0.01 * len(plan)})
    # the last event only gives the replay a point to pause before (it pauses, not ends, at the status)
    return [SnapshotEvent(engine=eng, ts=1.0), eng,
            BatchEvent(step=9, mode="EXTEND", bs=4, num_tokens=40, ts=1.5), *evs, end,
            BatchEvent(step=10 + len(plan), mode="DECODE", bs=4, num_tokens=4, ts=end.ts + 0.01)]


def test_policy_snapshot(snap_compare: Callable[..., bool], tmp_path: Path) -> None:
    evs = auto_session()
    path = tmp_path / "policy.jsonl"
    write_recording(path, evs, source="synthetic", created=1.0)
    n = len(evs) - 1
    assert snap_compare(replay_app(path, n), terminal_size=SIZE, run_before=paused_at(n, "8"))


def cycle_session(path: Path) -> list:
    """A real tiny engine (S = 3, the `cycle` policy: depths 0..3 in turn) serving two requests, with
    telemetry attached; its events, then a status, are written to `path` as a recording."""
    e = tiny_engine("random:3:2", spec_policy="cycle")
    bus = EventBus()
    tel = Telemetry.attach(e, bus)
    tel.status()  # the snapshot a subscriber starts from
    e.add_request("a", list(range(5, 17)), greedy(14))
    e.add_request("b", list(range(30, 38)), greedy(10))
    while e.has_work():
        e.step()
    tel.status()
    evs = [SnapshotEvent(engine=None), *bus.drain()]
    evs.append(BatchEvent(step=e.scheduler.num_steps + 1, mode="IDLE"))  # a point for the replay to pause before
    write_recording(path, evs, source="tiny-engine")
    return evs


async def test_policy_tab_from_a_real_engine(tmp_path: Path) -> None:
    evs = cycle_session(tmp_path / "cycle.jsonl")
    pol = [x for x in evs if isinstance(x, SpecPolicyEvent)]
    tot = [x for x in evs if isinstance(x, EngineEvent)][-1].spec_policy
    assert tot is not None and len(pol) > S + 1
    n = len(evs) - 1
    app = replay_app(tmp_path / "cycle.jsonl", n)
    async with app.run_test(size=SIZE) as pilot:
        await paused_at(n, "8")(pilot)
        m: Dashboard = app.model
        assert app.query_one("#tabs").active == "policy"
        text = screen_text(app)
    assert m.policy_count == len(pol) and set(m.policy_by_depth) == set(range(S + 1))
    assert m.policy_reasons == {"cycle": len(pol)}
    assert f"mode cycle   S {S}   S' {pol[-1].depth}   reason cycle" in text
    strip = next(ln for ln in text.splitlines() if "last depths" in ln).split("last depths")[1].strip()
    assert strip == "".join(str(x.depth) for x in pol)  # every decision, in order
    assert "iterations by depth (engine totals)" in text
    rows = {ln.split()[0]: ln.split()[1] for ln in text.splitlines()
            if ln.split()[:1] in ([str(d)] for d in range(S + 1)) and "%" in ln}
    assert rows == {str(d): str(k) for d, k in enumerate(tot.iterations_by_depth)}
    assert f"drafts accepted {tot.tokens_gained}" in text and f"catch-ups {tot.catch_ups} (" in text


async def test_the_served_check_shows_where_served_rates_discount_drafting(tmp_path: Path) -> None:
    """The engine totals' served discounts appear below the totals, per bucket, smallest first; a
    status without any (the snapshot above) shows no such line."""
    evs = auto_session()
    end = next(i for i, x in reversed(list(enumerate(evs))) if isinstance(x, EngineEvent))
    tot = evs[end].spec_policy
    assert tot is not None
    evs[end] = evs[end].model_copy(update={"spec_policy": tot.model_copy(
        update={"served_discount": {"64": 0.74, "32": 1.0}})})
    write_recording(tmp_path / "slow.jsonl", evs, source="synthetic", created=1.0)
    n = len(evs) - 1
    app = replay_app(tmp_path / "slow.jsonl", n)
    async with app.run_test(size=SIZE) as pilot:
        await paused_at(n, "8")(pilot)
        text = screen_text(app)
    assert "served check bs<=32 1.00x  bs<=64 0.74x" in text
