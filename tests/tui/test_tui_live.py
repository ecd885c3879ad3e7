"""mleagle-tui on real data: SVG snapshots of every panel on a recording of a real session (SmolLM2 on
the CPU with its shipped 3-layer draft, made by scripts/record_events_real.py), and the app headless against
a live `mleagle serve` (tiny-dummy, `--draft random:2`): it shows the batches, pools, acceptance and
speculation-policy decisions of a request it did not send itself, and reconnects when the daemon is
killed and started again on the same port.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from textual.pilot import Pilot

from mleagle.engine.contract.events import read_recording
from mleagle.tui.app import MleagleTui
from mleagle.tui.model import Dashboard
from mleagle.tui.source import LiveSource
from tests.daemon_helpers import ServerProc
from tests.tui_helpers import SIZE, no_animations, paused_at, replay_app, screen_text, until  # noqa: F401

REAL = Path(__file__).parents[1] / "data" / "events_real.jsonl"
STOP = 300  # mid second wave: three requests decoding, three finished, acceptance and pools populated
REC_RUNNERS = {"target", "draft0", "draft1", "draft2"}  # the recording: SmolLM2's 3-layer draft
RUNNERS = {"target", "draft0", "draft1"}  # the live daemon: tiny-dummy with random:2


async def until_live(pilot: Pilot, cond: Callable[[], bool], timeout: float = 20.0) -> None:
    """A live daemon answers slower than a replay: wait longer, poll less often."""
    await until(pilot, cond, timeout, step=0.05)


# --- the real recording ---------------------------------------------------------------------------


def test_real_recording_is_consistent() -> None:
    rec = read_recording(REAL, strict=True)
    assert rec.header.meta["model"] == "smollm2-135m" and rec.header.meta["draft"] == "drafts/smollm2-135m-mtp3"
    m = Dashboard()
    for e in rec.events:
        m.apply(e)
    assert rec.events[0].type == "snapshot" and m.malformed == 0 and m.seq_gaps == 0
    assert m.lpm_count > 0 and m.lpm_mismatch == 0
    assert {mode for (_, mode) in m.lpm_by} >= {"EXTEND", "TARGET_VERIFY", "DRAFT_EXTEND"}
    assert m.S == 3 and m.acc_per_depth[2] <= m.acc_per_depth[1] <= m.acc_per_depth[0] <= m.proposed_per_depth[0]
    # a trained draft: a real share of its first drafts is accepted (a random draft's is about 0)
    assert m.acc_per_depth[0] > 0.3 * m.proposed_per_depth[0]
    assert set(m.tracker.pools) == REC_RUNNERS
    assert all(p.kv_used == 0 and p.req_used == 0 for p in m.tracker.pools.values())
    done = [r for r in m.requests.values() if r.state == "finished"]
    assert len(done) == 6 and all(len(r.tokens) == r.output_tokens > 0 for r in done)
    assert all(t.text is not None and len(t.top) == 3 for r in done for t in r.tokens)


def snap_app() -> MleagleTui:
    return replay_app(REAL, STOP)


def before(*keys: str) -> Callable[[Pilot], object]:
    return paused_at(STOP, *keys)


@pytest.mark.parametrize("key, tab", [("1", "overview"), ("2", "batches"), ("3", "pools"), ("4", "graphs"),
                                      ("5", "logprobs"), ("6", "acceptance"), ("7", "requests")])
def test_real_panel_snapshot(snap_compare: Callable[..., bool], key: str, tab: str) -> None:
    assert snap_compare(snap_app(), terminal_size=SIZE, run_before=before(key))


def test_real_drilldown_snapshot(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(snap_app(), terminal_size=SIZE, run_before=before("7", "enter"))


# --- against a live daemon ------------------------------------------------------------------------


def start(*extra: str) -> ServerProc:
    # Drafting every iteration: `auto` measures a drafting depth only where it could pay, and on the
    # tiny model's CPU timings two random drafts cannot, so it would never send an acceptance event.
    s = ServerProc("--config", "tiny-dummy", "--draft", "random:2", "--spec-policy", "always", *extra)
    s.wait_healthy(60)
    return s


async def generate(url: str, n: int = 8) -> None:
    body = {"input_ids": [3, 4, 5, 6, 7], "sampling_params": {"max_new_tokens": n, "temperature": 0, "logprobs": 2}}
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()


async def send_until_seen(pilot: Pilot, app: MleagleTui, url: str, kind: str = "acceptance") -> None:
    """Send requests until the app has seen one of `kind`: a fresh daemon's relay joins the engine's event
    socket a moment after /health says ready, and events published before that are lost."""
    n0 = app.model.by_type[kind]
    for _ in range(20):
        await generate(url)
        for _ in range(20):
            if app.model.by_type[kind] > n0:
                return
            await pilot.pause(0.05)
    raise AssertionError(f"no {kind} event reached the app: {dict(app.model.by_type)}")


async def test_app_against_live_daemon() -> None:
    srv = await asyncio.to_thread(start, "--events-include-text")  # the operator's opt-in: tokens in events
    try:
        app = MleagleTui(LiveSource(srv.url), refresh_s=0.05)
        async with app.run_test(size=SIZE) as pilot:
            await until_live(pilot, lambda: app.model.by_type["snapshot"] == 1)
            await send_until_seen(pilot, app, srv.url)
            m = app.model
            await until_live(pilot, lambda: bool(m.requests) and all(r.state == "finished" for r in m.requests.values())
                        and set(m.tracker.pools) == RUNNERS
                        and all(p.kv_used == 0 for p in m.tracker.pools.values()))
            assert m.by_type["batch"] > 0 and m.by_type["pool"] > 0 and m.by_type["logprob_meta"] > 0
            assert m.malformed == 0 and m.lpm_mismatch == 0 and m.S == 2 and m.iterations > 0
            assert {b.mode for b in m.batches} >= {"EXTEND", "TARGET_VERIFY", "DRAFT_EXTEND"}
            r = next(r for r in reversed(m.requests.values()) if r.tokens)
            assert r.output_tokens == len(r.tokens) == 8
            await pilot.press("3")
            await pilot.pause(0.1)
            txt = screen_text(app)
            assert "● connected" in txt and all(name in txt for name in RUNNERS)
            await pilot.press("6")
            await pilot.pause(0.1)
            assert app.query_one("#tabs").active == "acceptance"
            # the speculation policy's decisions reach the Policy tab too
            last = m.tracker.last_spec_policy
            assert m.by_type["spec_policy"] > 0 and last is not None and last.S == 2 and last.mode == "always"
            await pilot.press("8")
            await pilot.pause(0.1)
            assert f"mode always   S 2   S' {last.depth}" in screen_text(app)
    finally:
        await asyncio.to_thread(srv.terminate)


async def test_app_reconnects_after_daemon_restart() -> None:
    a = await asyncio.to_thread(start)
    port = a.url.rsplit(":", 1)[1]
    b: ServerProc | None = None
    try:
        src = LiveSource(a.url, backoff=0.1, backoff_max=0.5)
        app = MleagleTui(src, refresh_s=0.05)
        async with app.run_test(size=SIZE) as pilot:
            await until_live(pilot, lambda: src.connects == 1 and app.model.events > 0)
            await send_until_seen(pilot, app, a.url)
            a.kill()  # the whole daemon goes, not just its engine
            await until_live(pilot, lambda: app.conn_status.state == "reconnecting")
            await pilot.pause(0.1)
            assert "disconnected" in screen_text(app)
            b = await asyncio.to_thread(start, "--port", port)
            assert b.url == a.url
            await until_live(pilot, lambda: src.connects == 2 and app.conn_status.state == "connected", timeout=30)
            seen = app.model.by_type["acceptance"]
            await send_until_seen(pilot, app, b.url)
            assert app.model.by_type["acceptance"] > seen and app.model.by_type["snapshot"] == 2
            # by default a daemon publishes counts, not tokens: the requests (with logprobs) show none
            await until_live(pilot, lambda: any(r.state == "finished" for r in app.model.requests.values()))
            reqs = list(app.model.requests.values())
            assert any(r.output_tokens == 8 for r in reqs) and not any(r.tokens for r in reqs)
            await pilot.pause(0.1)
            assert "● connected" in screen_text(app)
    finally:
        a.kill()
        if b is not None:
            await asyncio.to_thread(b.terminate)
