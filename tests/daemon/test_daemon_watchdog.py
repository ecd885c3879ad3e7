"""Issue 12 on the tiny random-weight model (token-id prompts, fast), against a real `mleagle serve`:
a frozen engine (`kill -STOP`) is noticed within the ping budget (`/health` 503, requests in flight
fail with a clear error, new ones are refused at once), killed and restarted, and later requests
answer exactly; a client that never reads its stream holds a bounded amount of output in the daemon,
its engine request is aborted and its stream ends with an error event; a stream cut at the shutdown
timeout ends with an error event; the run folder is removed when the daemon is killed with SIGKILL,
and stale ones are swept at start.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.daemon_helpers import ServerProc, gen_stream

TINY = ("--config", "tiny-dummy", "--threads", "1")
BUDGET = 2.0  # --engine-ping-timeout


@pytest.fixture(scope="module")
def srv():
    s = ServerProc(*TINY, "--engine-ping-interval", "0.25", "--engine-ping-timeout", str(BUDGET),
                   "--stream-buffer-tokens", "64", "--write-timeout", "2", "--shutdown-timeout", "1")
    s.wait_healthy(60)
    s.ref = greedy(s)
    yield s
    s.kill()


def greedy(srv: ServerProc) -> list[int]:
    import urllib.request

    body = json.dumps({"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                                                     "ignore_eos": True}}).encode()
    req = urllib.request.Request(srv.url + "/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["token_ids"]


def _slow_client(srv: ServerProc) -> socket.socket:
    """A stream of 8 x 1000 tokens with 20 logprobs each (~8 MB of SSE, more than the kernel's socket
    buffers take on loopback) on a socket with a tiny receive buffer, of which the client reads
    nothing for now."""
    host, port = srv.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": [1, 2, 3, 4], "stream": True, "n": 8, "max_tokens": 1000, "temperature": 0,
                       "ignore_eos": True, "logprobs": 20}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _read_all(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """Everything until the server closes (True) or `timeout` passes (False); a reset counts as closed."""
    data, end = b"", time.monotonic() + timeout
    while time.monotonic() < end:
        sock.settimeout(max(0.01, end - time.monotonic()))
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            break
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


async def test_client_that_never_reads_is_bounded_and_cut(srv: ServerProc) -> None:
    """Two such clients. The daemon holds at most 64 unsent tokens for each: past that it stops the
    engine request (long before 1000 tokens). The first client then reads: it gets what was sent,
    a `client_too_slow` error event and [DONE]. The second never reads: its connection is closed."""
    a, b = _slow_client(srv), _slow_client(srv)
    try:
        t0, seen = time.monotonic(), 0
        while time.monotonic() - t0 < 20:  # both engine requests stop while the clients read nothing
            d = srv.engine()
            seen = max(seen, d["inflight"])
            if seen and d["inflight"] == 0 and d["num_requests"] == 0:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the slow clients' requests are still in flight: {d}")
        data, closed = _read_all(a, 15)
        assert closed, (len(data), data[-300:], srv.engine(), srv.log()[-2000:])
        _, closed_b = _read_all(b, 15)
        assert closed_b, "a client that never reads keeps its connection"
    finally:
        a.close()
        b.close()
    events = [ln[6:] for ln in data.decode().splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert err["code"] == "client_too_slow" and err["type"], err
    tokens = sum(len(c["logprobs"]["tokens"]) for e in events[:-2] for c in json.loads(e)["choices"])
    assert tokens < 8000, tokens  # cut before the end, not buffered to completion
    srv.wait_pools_free()
    assert greedy(srv) == srv.ref


async def test_engine_refusals_are_4xx_with_the_param(srv: ServerProc) -> None:
    """Requests the engine would refuse are refused by the daemon with the field named (the engine's
    refusals used to reach clients as 500s)."""
    async with aiohttp.ClientSession() as s:
        for path, body, param in [
            ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop": ["x"]}}, "sampling_params.stop"),
            ("/v1/completions", {"prompt": [1, 2], "stop": "x"}, "stop"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ]:
            async with s.post(srv.url + path, json=body) as r:
                assert r.status == 400, (path, await r.text())
                assert (await r.json())["error"]["param"] == param


async def test_frozen_engine_is_detected_and_restarted(srv: ServerProc) -> None:
    pid = srv.engine()["pid"]
    try:
        async with aiohttp.ClientSession() as s:
            first = asyncio.Event()
            streams = [asyncio.create_task(gen_stream(s, srv.url, 1000, first)) for _ in range(2)]
            await asyncio.wait_for(first.wait(), 30)
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            while True:
                async with s.get(srv.url + "/health") as r:
                    if r.status == 503:
                        down = await r.json()
                        break
                assert time.monotonic() - t0 < BUDGET + 3, "a frozen engine is still reported healthy"
                await asyncio.sleep(0.05)
            took = time.monotonic() - t0
            res = await asyncio.wait_for(asyncio.gather(*streams), 15)
            # while it is replaced, new requests are refused at once, not queued behind a dead engine
            async with s.post(srv.url + "/generate", json={"input_ids": [1], "sampling_params": {}}) as r:
                if r.status != 200:
                    assert r.status == 503 and (await r.json())["error"]["code"] == "engine_unavailable"
        assert took <= BUDGET + 1.5, took
        assert "respond" in (down["error"] or ""), down
        for x in res:  # a stream that had sent nothing yet gets the status itself, the others an error event
            assert x["error"] is not None and x["after_error"] == 0 and (x["done"] or x["status"] == 503), x
            assert "respond" in x["error"]["message"] and x["error"]["code"] == "engine_dead", x
        srv.wait_healthy(60)
        d = srv.engine()
        assert d["restarts"] == 1 and d["pid"] != pid
        t0 = time.monotonic()
        while Path(f"/proc/{pid}").exists() and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert not Path(f"/proc/{pid}").exists(), "the frozen engine was not killed"
        assert greedy(srv) == srv.ref
        srv.wait_pools_free()
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)


async def test_zz_stream_cut_at_shutdown_timeout_gets_an_error_event(srv: ServerProc) -> None:
    async with aiohttp.ClientSession() as s:
        # Every stream under way before the signal: one still on its way in would be refused at
        # admission (a 503 before any stream, not a cut), which a loaded machine made happen.
        firsts = [asyncio.Event() for _ in range(16)]
        jobs = [asyncio.create_task(gen_stream(s, srv.url, 1000, f)) for f in firsts]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 30)
        srv.proc.send_signal(signal.SIGTERM)
        res = await asyncio.wait_for(asyncio.gather(*jobs), 30)
    assert srv.proc.wait(30) == 0, srv.log()
    cut = [r for r in res if r["tokens"] < 1000]
    assert cut, "every stream finished within the 1 s shutdown timeout: nothing was cut"
    for r in cut:
        assert r["done"] and r["error"] is not None and r["error"]["code"] == "shutting_down", r


def test_run_folder_removed_when_the_daemon_is_killed(tmp_path: Path) -> None:
    # a stale folder of a daemon that died before this one started: swept at start
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"mleagle-run-{dead.pid}-x1y2"
    stale.mkdir(mode=0o700)
    (stale / "g1-req").write_text("")
    live = tmp_path / f"mleagle-run-{os.getpid()}-keep"  # a live process's folder is left alone
    live.mkdir(mode=0o700)
    srv = ServerProc(*TINY, env={"TMPDIR": str(tmp_path)})
    try:
        srv.wait_healthy(60)
        assert not stale.exists() and live.exists()
        mine = [p for p in tmp_path.glob("mleagle-*") if p != live]
        assert len(mine) == 1, mine
        pid = srv.engine()["pid"]
        srv.proc.kill()  # SIGKILL: no cleanup code runs in the daemon
        t0 = time.monotonic()
        while (mine[0].exists() or Path(f"/proc/{pid}").exists()) and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        assert not mine[0].exists(), list(mine[0].iterdir())
    finally:
        srv.kill()


def test_engine_unwinds_once_however_many_sigterms_come() -> None:
    """A SIGKILLed daemon's threads exit one by one and PDEATHSIG fires at each re-parenting, so the
    engine can get several SIGTERMs. Only the first may raise: a second SystemExit inside main's cleanup
    skipped the run dir's removal (the run-folder test above failed about one run in five)."""
    from mleagle.engine.service import process as P

    P._SIGTERM[0] = False
    try:
        with pytest.raises(SystemExit):
            P._exit_on_sigterm(15, None)
        assert P._exit_on_sigterm(15, None) is None and P._SIGTERM[0]
    finally:
        P._SIGTERM[0] = False
