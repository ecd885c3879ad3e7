"""mleagle-tui, headless: replay of the committed recording, keys, drill-down, malformed input, SVG
snapshots of every panel, and the live WebSocket source reconnecting to a real aiohttp server that the
test stops and restarts. The TUI must import without torch (checked in a subprocess that blocks it).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web
from textual.pilot import Pilot
from textual.widgets import DataTable

from mleagle.engine.contract.events import (
    BatchEvent,
    EngineEvent,
    PoolEvent,
    SnapshotEvent,
    dump_event,
    read_recording,
)
from mleagle.tui.app import HelpScreen, MleagleTui, build_app
from mleagle.tui.model import Dashboard
from mleagle.tui.panels.requests import RequestScreen
from mleagle.tui.source import LiveSource, ReplaySource, Status, events_url
from tests.tui_helpers import SIZE, no_animations, paused_at, replay_app, screen_text, until  # noqa: F401

SAMPLE = Path(__file__).parents[1] / "data" / "events_sample.jsonl"
STOP = 300  # snapshot index: mid-session, after the injected logprob mismatch, with one request running


# --- torch-free ----------------------------------------------------------------------------------


def test_tui_imports_without_torch() -> None:
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
        sys.meta_path.insert(0, Block())
        import mleagle.tui.app, mleagle.tui.source, mleagle.tui.model
        from mleagle.tui.panels import overview, batches, pools, graphs, logprobs, acceptance, requests, policy
        import mleagle.engine.contract.events, mleagle.engine.contract.event_bus
        app = mleagle.tui.app.build_app(["--replay", sys.argv[1], "--speed", "0"])
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "transformers"))
        assert not bad, bad
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code, str(SAMPLE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


# --- model (no Textual) ---------------------------------------------------------------------------


def test_dashboard_folds_the_sample() -> None:
    rec = read_recording(SAMPLE)
    m = Dashboard()
    for e in rec.events:
        m.apply(e)
    assert m.events == len(rec.events) and m.malformed == 0
    assert m.lpm_mismatch == 1  # the one injected by the sample generator
    assert m.S == 2 and len(m.acc_per_depth) == 2
    # chain acceptance: depth 2 can never be accepted more often than depth 1
    assert m.acc_per_depth[1] <= m.acc_per_depth[0] <= m.proposed_per_depth[0]
    # accepted drafts + one bonus per request-iteration == sum of accept lengths
    n = sum(m.accept_hist.values())
    assert sum(m.acc_per_depth) + n == sum(k * v for k, v in m.accept_hist.items())
    assert all(r.state == "finished" and len(r.tokens) == r.output_tokens for r in m.requests.values())
    assert all(p.kv_used == 0 and p.req_used == 0 for p in m.tracker.pools.values())  # all free at the end
    assert m.apply_raw("{oops") is None and m.malformed == 1 and "JSON" in (m.last_error or "")


def test_events_url() -> None:
    assert events_url("http://127.0.0.1:8000") == "ws://127.0.0.1:8000/v1/events"
    assert events_url("https://h/x/") == "wss://h/x/v1/events"
    assert events_url("127.0.0.1:9") == "ws://127.0.0.1:9/v1/events"
    assert events_url("ws://h/v1/events", ["batch", "pool"]) == "ws://h/v1/events?types=batch%2Cpool"


# --- replay with Pilot ----------------------------------------------------------------------------


async def test_replay_keys_drilldown_help() -> None:
    src = ReplaySource(SAMPLE, speed=0)
    app = MleagleTui(src)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: src.done)
        assert app.model.events == src.total == len(read_recording(SAMPLE).events)
        assert app.conn_status.state == "ended"
        for i, tid in enumerate(["overview", "batches", "pools", "graphs", "logprobs", "acceptance", "requests",
                                 "policy"]):
            await pilot.press(str(i + 1))
            assert app.query_one("#tabs").active == tid
        await pilot.press("7")  # back to the requests for the drill-down
        await pilot.pause()
        table = app.query_one("#requests-table", DataTable)
        assert table.row_count == 6 and app.focused is table
        await pilot.press("down", "enter")
        await pilot.pause()
        assert isinstance(app.screen, RequestScreen)
        r = app.screen.r
        assert r.rid == "r1"
        assert app.screen.query_one("#tokens-table", DataTable).row_count == len(r.tokens) == r.output_tokens > 0
        await pilot.press("escape")
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("q")
    assert app.return_code == 0


async def test_pause_step_resume_and_speed() -> None:
    src = ReplaySource(SAMPLE, speed=0, stop_at=50)
    app = MleagleTui(src)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: src.paused and src.delivered == 50)
        await pilot.pause(0.1)
        assert src.delivered == 50 and app.model.events == 50  # really stopped
        await pilot.press("full_stop")
        await until(pilot, lambda: src.delivered == 51)
        await pilot.pause(0.1)
        assert src.delivered == 51
        src.speed = 1.0
        await pilot.press("plus")
        assert src.speed == 2.0
        await pilot.press("minus", "minus")
        assert src.speed == 0.5
        await pilot.press("p")
        assert not src.paused
        await until(pilot, lambda: src.delivered > 52, timeout=5)  # plays on in real time (recorded gaps ~ms)
        await pilot.press("p")
        assert src.paused
        n = src.delivered
        await pilot.pause(0.2)
        assert src.delivered <= n + 1  # at most the event already past the gate
        src.speed = 0
        await pilot.press("p")
        await until(pilot, lambda: src.done)
        assert "replay ended" in screen_text(app)


async def test_malformed_lines_are_counted_and_shown(tmp_path: Path) -> None:
    lines = SAMPLE.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0], "garbage", *lines[1:20], '{"type":"pool"}', '{"type":"teleport"}',
                              *lines[20:40]]) + "\n")
    src = ReplaySource(bad, speed=0)
    app = MleagleTui(src)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: src.done)
        app.sink_raw("[1,2,3]")  # a bad live frame goes the same way
        app.refresh_view(force=True)
        await pilot.pause()
        assert app.model.malformed == 4 and app.model.events == 39
        assert "malformed 4" in screen_text(app)


async def test_missing_recording_shows_error(tmp_path: Path) -> None:
    app = build_app(["--replay", str(tmp_path / "nope.jsonl")])
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.conn_status.state == "error")
        await pilot.pause()
        assert "FileNotFoundError" in screen_text(app)


# --- snapshots ------------------------------------------------------------------------------------


def snap_app() -> MleagleTui:
    return replay_app(SAMPLE, STOP)


def before(*keys: str) -> Callable[[Pilot], object]:
    return paused_at(STOP, *keys)


@pytest.mark.parametrize("key, tab", [("1", "overview"), ("2", "batches"), ("3", "pools"), ("4", "graphs"),
                                      ("5", "logprobs"), ("6", "acceptance"), ("7", "requests")])
def test_panel_snapshot(snap_compare: Callable[..., bool], key: str, tab: str) -> None:
    assert snap_compare(snap_app(), terminal_size=SIZE, run_before=before(key))


def test_drilldown_snapshot(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(snap_app(), terminal_size=SIZE, run_before=before("7", "down", "enter"))


def test_help_snapshot(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(snap_app(), terminal_size=SIZE, run_before=before("question_mark"))


def _prefix_cache_recording(path: Path) -> Path:
    """Three runners sharing 260 cached slots (200 evictable), 60 held by a running request's prefix
    plus its own 60: what a cache-on engine reports mid-session."""
    from mleagle.engine.contract.events import write_recording

    eng = EngineEvent(model="smollm2-135m", draft="mtp-s2", spec_steps=2, num_running=1, ts=1.0,
                      prefix_cache_queries_total=1840, prefix_cache_hits_total=1180)
    pools = [PoolEvent(runner=r, kv_used=120, kv_total=512, kv_cached=260, kv_evictable=200, req_used=1,
                       req_total=8, step=7, ts=1.0) for r in ("target", "draft0", "draft1")]
    evs = [SnapshotEvent(engine=eng, pools=pools, ts=1.0), eng, *pools,
           BatchEvent(step=8, mode="DECODE", rids=["r1"], num_tokens_per_req=[1], num_tokens=1, bs=1, padded_bs=1,
                      ts=1.1)]
    write_recording(path, evs, source="synthetic", created=1.0)
    return path


async def test_pools_show_the_prefix_cache(tmp_path: Path) -> None:
    app = replay_app(_prefix_cache_recording(tmp_path / "prefix.jsonl"), 5)
    async with app.run_test(size=SIZE) as pilot:
        await paused_at(5, "3")(pilot)
        text = screen_text(app)
    assert "cached" in text and "evictable" in text
    assert "120/512" in text and text.count(" 260 ") == 3 and text.count(" 200 ") == 3
    assert "prefix cache: 1180/1840 prompt tokens hit (64.1 %)" in text


def test_pools_prefix_cache_snapshot(snap_compare: Callable[..., bool], tmp_path: Path) -> None:
    app = replay_app(_prefix_cache_recording(tmp_path / "prefix.jsonl"), 5)
    assert snap_compare(app, terminal_size=SIZE, run_before=paused_at(5, "3"))


# --- live source against a real WebSocket server, stopped and restarted ---------------------------


class FakeDaemon:
    """A tiny stand-in for the daemon's GET /v1/events: checks the bearer key, sends a snapshot, a few
    events and one malformed frame, then keeps the socket open until the server is stopped."""

    def __init__(self, key: str = "k") -> None:
        self.key = key
        self.port = 0
        self.runner: web.AppRunner | None = None
        self.connections = 0
        self.seen_types: list[str | None] = []

    async def handler(self, req: web.Request) -> web.StreamResponse:
        if req.headers.get("Authorization") != f"Bearer {self.key}":
            return web.Response(status=401, text="bad key")
        ws = web.WebSocketResponse()
        await ws.prepare(req)
        self.connections += 1
        self.seen_types.append(req.query.get("types"))
        n = self.connections
        await ws.send_str(dump_event(SnapshotEvent(engine=EngineEvent(model="fake", spec_steps=2))))
        await ws.send_str("\n".join(dump_event(BatchEvent(step=n * 10 + i, mode="DECODE", bs=1)) for i in range(3)))
        await ws.send_str(dump_event(PoolEvent(runner="target", kv_used=n, kv_total=8, req_used=1, req_total=2)))
        await ws.send_str("{malformed")
        try:
            async for _ in ws:
                pass
        finally:
            await ws.close()
        return ws

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/events", self.handler)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Collect:
    def __init__(self) -> None:
        self.m = Dashboard()
        self.statuses: list[Status] = []

    def sink_raw(self, text: str) -> None:
        self.m.apply_raw(text)

    def sink_event(self, e: object) -> None:
        self.m.apply(e)  # type: ignore[arg-type]

    def sink_status(self, s: Status) -> None:
        self.statuses.append(s)


async def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    t = 0.0
    while not cond():
        assert t < timeout, "condition not reached in time"
        await asyncio.sleep(0.02)
        t += 0.02


async def test_live_source_reconnects_after_restart() -> None:
    d = FakeDaemon()
    await d.start()
    sink = Collect()
    src = LiveSource(d.url, api_key="k", types=["batch", "pool"], backoff=0.05, backoff_max=0.2)
    task = asyncio.create_task(src.run(sink))
    try:
        await wait_for(lambda: sink.m.events == 5 and sink.m.malformed == 1)
        assert d.seen_types == ["batch,pool"]
        assert sink.m.tracker.pools["target"].kv_used == 1
        assert [s.state for s in sink.statuses[:2]] == ["connecting", "connected"]
        await d.stop()
        await wait_for(lambda: sink.statuses[-1].state == "reconnecting" and sink.statuses[-1].attempt >= 3)
        delays = [s.retry_in for s in sink.statuses if s.state == "reconnecting"]
        assert delays[:3] == [0.05, 0.1, 0.2] and max(delays) == 0.2  # exponential, capped
        await d.start()  # same port
        await wait_for(lambda: sink.m.events == 10)
        assert src.connects == 2 and sink.statuses[-1].state == "connected"
        assert sink.m.tracker.pools["target"].kv_used == 2 and sink.m.malformed == 2
    finally:
        task.cancel()
        await d.stop()


async def test_live_source_reports_bad_key() -> None:
    d = FakeDaemon(key="right")
    await d.start()
    sink = Collect()
    task = asyncio.create_task(LiveSource(d.url, api_key="wrong", backoff=0.05, backoff_max=0.1).run(sink))
    try:
        await wait_for(lambda: any(s.state == "reconnecting" for s in sink.statuses))
        s = next(s for s in sink.statuses if s.state == "reconnecting")
        assert "unauthorized (401)" in s.detail and sink.m.events == 0
    finally:
        task.cancel()
        await d.stop()


async def test_app_live_disconnect_reconnect_and_record(tmp_path: Path) -> None:
    d = FakeDaemon()
    await d.start()
    rec = tmp_path / "live.jsonl"
    app = MleagleTui(LiveSource(d.url, api_key="k", backoff=0.05, backoff_max=0.1), record=rec, refresh_s=0.05)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.model.events == 5)
            await pilot.pause(0.1)
            assert "● connected" in screen_text(app) and "malformed 1" in screen_text(app)
            await d.stop()
            await until(pilot, lambda: app.conn_status.state == "reconnecting")
            await pilot.pause()
            txt = screen_text(app)
            assert "disconnected" in txt and "reconnecting in" in txt
            await pilot.press("p")  # live pause freezes the view but keeps receiving
            assert app.frozen
            await d.start()
            await until(pilot, lambda: app.model.events == 10)
            await pilot.pause(0.1)
            assert "● connected" in screen_text(app) and "VIEW FROZEN" in screen_text(app)
            await pilot.press("p")
            assert not app.frozen
    finally:
        await d.stop()
    got = read_recording(rec, strict=True)
    assert len(got.events) == 10 and [e.type for e in got.events[:2]] == ["snapshot", "batch"]
    assert json.loads(rec.read_text().splitlines()[0])["source"].startswith("ws://127.0.0.1")


@pytest.mark.skipif(shutil.which("mleagle-tui") is None and not Path(sys.executable).with_name("mleagle-tui").exists(),
                    reason="console script not installed")
def test_console_script_help() -> None:
    exe = shutil.which("mleagle-tui") or str(Path(sys.executable).with_name("mleagle-tui"))
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--replay" in r.stdout and "--api-key" in r.stdout
