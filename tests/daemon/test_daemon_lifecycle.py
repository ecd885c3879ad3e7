"""Daemon lifecycle on the tiny random-weight model (token-id prompts, fast): SIGTERM drains requests in
flight and exits 0; a killed engine fails its requests with a clear error, `/health` says so and the
engine comes back (or the server exits 1 with restarts off); the queue limit answers 429 with
Retry-After; an engine that cannot start makes `mleagle serve` exit non-zero."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from tests.daemon_helpers import ServerProc, gen_stream

TINY = ("--config", "tiny-dummy", "--threads", "1")  # one OMP thread: 10x faster on a busy 2-core box
DRAIN_TOKENS = 1000  # tiny-dummy's context is 1024


async def test_sigterm_drains_in_flight_then_exits_0():
    srv = ServerProc(*TINY, "--shutdown-timeout", "60")
    try:
        srv.wait_healthy(60)
        async with aiohttp.ClientSession() as s, aiohttp.ClientSession() as idle:
            async with idle.get(srv.url + "/health") as r:  # leaves a keep-alive connection open
                assert r.status == 200
            first = asyncio.Event()
            # Enough work (8 x 1000 tokens, the pool holds it) that the drain outlasts the checks below;
            # 4 x 400 could finish first on an idle machine, and the server would be gone before them.
            jobs = [asyncio.create_task(gen_stream(s, srv.url, DRAIN_TOKENS, first)) for _ in range(8)]
            await asyncio.wait_for(first.wait(), 30)
            # All eight admitted before the signal (on a loaded machine the first can stream while the
            # last is still connecting, and a request that arrives after the signal is refused).
            deadline = time.monotonic() + 30
            while (await asyncio.to_thread(srv.engine))["active_http"] < 8:
                assert time.monotonic() < deadline, "the eight requests were never all in flight"
                await asyncio.sleep(0.02)
            srv.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            with pytest.raises(aiohttp.ClientConnectionError):  # no longer listening
                async with aiohttp.ClientSession() as s2, s2.get(srv.url + "/health") as r:
                    await r.read()
            # a new request on a connection opened before the signal is refused, not queued
            async with idle.post(srv.url + "/generate", json={"input_ids": [1], "sampling_params": {}}) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "shutting_down"
            res = await asyncio.gather(*jobs)
        for r in res:
            assert r["error"] is None and r["done"], r
            assert r["tokens"] == DRAIN_TOKENS and r["meta"]["finish_reason"] == "length"
        assert srv.proc.wait(30) == 0, srv.log()
    finally:
        srv.kill()


async def test_engine_death_fails_requests_then_recovers():
    srv = ServerProc(*TINY)
    try:
        srv.wait_healthy(60)
        pid = srv.engine()["pid"]
        async with aiohttp.ClientSession() as s:
            first = asyncio.Event()
            streams = [asyncio.create_task(gen_stream(s, srv.url, 1000, first)) for _ in range(3)]
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
            plain = asyncio.create_task(s.post(srv.url + "/generate", json=body))
            await asyncio.wait_for(first.wait(), 30)
            await asyncio.sleep(0.3)
            os.kill(pid, signal.SIGKILL)
            res = await asyncio.wait_for(asyncio.gather(*streams), 30)
            r = await asyncio.wait_for(plain, 30)
            assert r.status == 503
            err = (await r.json())["error"]
            assert err["code"] == "engine_dead" and "engine" in err["message"]
        for x in res:
            assert x["error"] is not None and "engine" in x["error"]["message"] and x["done"], x
        down = srv.wait_restart(60, 60)
        assert all(body["status"] in ("dead", "starting") for body in down)
        d = srv.engine()
        assert d["restarts"] == 1 and d["pid"] != pid
        async with aiohttp.ClientSession() as s, s.ws_connect(srv.url + "/v1/events?types=batch") as ws:
            assert json.loads((await ws.receive(timeout=10)).data)["type"] == "snapshot"
            ok = await gen_stream(s, srv.url, 5)
            # state events flow again from the new engine
            assert json.loads((await ws.receive(timeout=10)).data)["type"] == "batch"
        assert ok["tokens"] == 5 and ok["meta"]["finish_reason"] == "length"
        assert srv.terminate() == 0, srv.log()
    finally:
        srv.kill()


async def test_engine_death_without_restart_exits_1():
    srv = ServerProc(*TINY, "--no-restart-engine")
    try:
        srv.wait_healthy(60)
        os.kill(srv.engine()["pid"], signal.SIGKILL)
        assert srv.proc.wait(30) == 1, srv.log()
    finally:
        srv.kill()


async def test_queue_limit_429_with_retry_after():
    srv = ServerProc(*TINY, "--max-running-requests", "2", "--max-queued-requests", "2")
    try:
        srv.wait_healthy(60)
        body = {"prompt": [1, 2, 3], "max_tokens": 150, "ignore_eos": True, "temperature": 0}
        async with aiohttp.ClientSession() as s:

            async def one() -> tuple[int, dict, str | None]:
                async with s.post(srv.url + "/v1/completions", json=body) as r:
                    return r.status, await r.json(), r.headers.get("Retry-After")

            res = await asyncio.gather(*(one() for _ in range(10)))
        ok = [r for r in res if r[0] == 200]
        busy = [r for r in res if r[0] == 429]
        assert len(ok) == 4 and len(busy) == 6, [r[0] for r in res]
        for _, b, retry in busy:
            assert retry == "1" and b["error"]["code"] == "queue_full" and b["error"]["type"] == "rate_limit_error"
        assert all(b["usage"]["completion_tokens"] == 150 for _, b, _ in ok)
        # A client-chosen rid names the response only (the engine's ids are the daemon's own): two
        # requests in flight with the same rid both run, undisturbed.
        dup = {"input_ids": [1, 2, 3], "rid": "dup", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        async with aiohttp.ClientSession() as s:
            first = asyncio.create_task(s.post(srv.url + "/generate", json=dup))
            await asyncio.sleep(0.3)
            async with s.post(srv.url + "/generate", json=dup) as r:
                assert r.status == 200 and (await r.json())["meta_info"]["id"] == "dup"
            r1 = await first
            body1 = await r1.json()
            assert r1.status == 200 and body1["meta_info"]["completion_tokens"] == 400 and body1["meta_info"]["id"] == "dup"
        srv.wait_pools_free()
        assert srv.terminate() == 0, srv.log()
    finally:
        srv.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(ln for ln in f if ln.startswith("State:")).split()[1]
    except (FileNotFoundError, StopIteration):
        return False
    return state not in ("Z", "X")


def test_killed_daemon_leaves_no_engine():
    srv = ServerProc(*TINY)
    try:
        srv.wait_healthy(60)
        pid = srv.engine()["pid"]
        assert _alive(pid)
        srv.proc.kill()  # SIGKILL: no cleanup code runs in the daemon
        t0 = time.monotonic()
        while _alive(pid) and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        assert not _alive(pid), "the engine outlived its daemon"
    finally:
        srv.kill()


def test_engine_that_cannot_start_exits_nonzero(tmp_path):
    cfg = tmp_path / "broken.toml"
    cfg.write_text('[model]\nname = "broken"\npath = "/nonexistent/model.gguf"\nload_format = "gguf"\n')
    srv = ServerProc("--config", str(cfg))
    try:
        assert srv.proc.wait(60) == 1
        assert "engine failed to start" in srv.log()
    finally:
        srv.kill()
