"""Start a real `mleagle serve` subprocess on an ephemeral loopback port, for the daemon tests.

`ServerProc` runs `python -m mleagle.cli serve --port 0 ...`, reads the port from the line the server
prints, drains its output on a thread (kept for failure messages), and waits for `/health`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ServerProc:
    def __init__(self, *args: str, api_key: str | None = None, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "mleagle.cli", "serve", "--port", "0", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.api_key = api_key
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.url = ""
        got = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                if not self.url and line.startswith("mleagle: serving"):
                    self.url = line.split(" on ")[1].split()[0]
                    got.set()
            got.set()

        threading.Thread(target=pump, daemon=True).start()
        if not got.wait(30) or not self.url:
            self.kill()
            raise RuntimeError("server did not start:\n" + self.log())
        self.t_listen = time.monotonic()

    def log(self) -> str:
        return "\n".join(self.lines[-80:])

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, Any]:
        req = urllib.request.Request(self.url + path, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                body = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            body, status = e.read(), e.code
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body.decode()

    def wait_healthy(self, timeout: float = 60.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if self.get("/health", timeout=2)[0] == 200:
                    return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server not healthy in time:\n" + self.log())

    def engine(self) -> dict[str, Any]:
        return self.get("/debug/engine")[1]

    def wait_pools_free(self, timeout: float = 20.0) -> dict[str, Any]:
        """Poll until the engine holds no request and every pool of every runner is free."""
        t0 = time.monotonic()
        d: dict[str, Any] = {}
        while time.monotonic() - t0 < timeout:
            d = self.engine()
            pools = d.get("pool_usage") or []
            if d.get("state") == "ready" and d.get("num_requests") == 0 and d.get("inflight") == 0 and pools and all(
                p["kv_used"] == 0 and p["req_used"] == 0 for p in pools
            ):
                return d
            time.sleep(0.2)
        raise AssertionError(f"pools not free: {d}")

    def wait_restart(self, down_timeout: float = 60.0, up_timeout: float = 90.0) -> list[dict[str, Any]]:
        """Wait until `/health` answers 503 (the engine died) and then 200 again (restarted); returns the
        503 bodies seen on the way. Fails if the daemon never reports the engine down."""
        down: list[dict[str, Any]] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < down_timeout:
            st, body = self.get("/health")
            if st == 503:
                down.append(body)
            elif down:
                break
            time.sleep(0.05)
        assert down, "the daemon never reported the engine down (no 503 from /health)"
        self.wait_healthy(up_timeout)
        return down

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"server did not exit {timeout:.0f}s after SIGTERM:\n{self.log()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


async def raw_http(url: str, data: bytes, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes on a fresh connection (headers no HTTP client would build) and read the answer
    until the server closes the connection or `timeout` passes; returns (status, headers, body)."""
    import asyncio

    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        buf = b""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            head, sep, rest = buf.partition(b"\r\n\r\n")
            if sep:
                lines = head.decode("latin-1").split("\r\n")
                hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
                n = int(hdrs.get("content-length", "-1"))
                if 0 <= n <= len(rest):
                    return int(lines[0].split()[1]), hdrs, rest[:n]
            try:
                chunk = await asyncio.wait_for(reader.read(65536), max(0.01, end - loop.time()))
            except asyncio.TimeoutError:
                raise AssertionError(f"no complete answer in {timeout}s; got {buf[:300]!r}") from None
            if not chunk:
                if sep:
                    return int(lines[0].split()[1]), hdrs, rest
                raise AssertionError(f"connection closed before an answer; got {buf[:300]!r}")
            buf += chunk
    finally:
        writer.close()


async def sse_events(content: Any) -> AsyncIterator[dict | None]:
    """The JSON events of a server-sent-events body (an aiohttp response's `content`); None for `[DONE]`."""
    async for line in content:
        line = line.strip()
        if line == b"data: [DONE]":
            yield None
        elif line.startswith(b"data: "):
            yield json.loads(line[6:])


async def gen_stream(s: Any, url: str, n: int, first: Any = None) -> dict[str, Any]:
    """One streamed native `/generate` request (n tokens, greedy, ignore_eos) on aiohttp session `s`:
    the token count, the final meta_info, any error event, whether [DONE] came, tokens after an error,
    and the HTTP status. `first` (an asyncio.Event) is set once a token arrived."""
    body = {"input_ids": [1, 2, 3, 4], "stream": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    out: dict[str, Any] = {"tokens": 0, "meta": None, "error": None, "done": False, "after_error": 0}
    async with s.post(url + "/generate", json=body) as r:
        out["status"] = r.status
        if r.status != 200:
            out["error"] = (await r.json())["error"]
            return out
        async for ev in sse_events(r.content):
            if ev is None:
                out["done"] = True
            elif "error" in ev:
                out["error"] = ev["error"]
            else:
                out["after_error"] += out["error"] is not None
                out["tokens"] += len(ev["token_ids"])
                if first is not None and out["tokens"]:
                    first.set()
                if ev["finished"]:
                    out["meta"] = ev["meta_info"]
    return out
