"""Where the TUI's events come from: a live daemon over WebSocket, or a recording replayed in time.

Both sources are async and run inside a Textual worker on the app's event loop, so nothing here blocks
the UI thread. They push into a `Sink` (the app): `sink_raw(text)` for live frames (each frame is one
event or several newline-separated events, parsed by the sink so malformed ones are counted),
`sink_event(event)` for already-validated recorded events, and `sink_status(status)` whenever the connection
or replay state changes. `LiveSource` reconnects with exponential backoff (reset after a successful
connect) and reports Connecting / Connected / Reconnecting-in-N-s with the last error, including a
rejected API key. `ReplaySource` honours the recorded gaps divided by `speed` (0 = as fast as possible),
caps long idle gaps, and can pause, resume, step and stop at a fixed event index (for study and for
deterministic snapshot tests).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol
from urllib.parse import urlencode, urlsplit, urlunsplit

import aiohttp

from mleagle.engine.contract.events import Event, read_recording

State = Literal["connecting", "connected", "reconnecting", "replaying", "paused", "ended", "error"]


@dataclass(frozen=True)
class Status:
    """Connection or replay state, shown in the status bar."""

    state: State
    detail: str = ""
    attempt: int = 0
    retry_in: float = 0.0


class Sink(Protocol):
    def sink_raw(self, text: str) -> None: ...
    def sink_event(self, e: Event) -> None: ...
    def sink_status(self, s: Status) -> None: ...


def events_url(url: str, types: list[str] | None = None) -> str:
    """http(s)://host:port[/prefix] → ws(s)://host:port[/prefix]/v1/events[?types=a,b]; ws URLs pass as-is."""
    p = urlsplit(url if "://" in url else f"http://{url}")
    scheme = {"http": "ws", "https": "wss"}.get(p.scheme, p.scheme)
    path = p.path.rstrip("/")
    if not path.endswith("/v1/events"):
        path += "/v1/events"
    query = p.query
    if types:
        query = "&".join(x for x in (query, urlencode({"types": ",".join(types)})) if x)
    return urlunsplit((scheme, p.netloc, path, query, ""))


class LiveSource:
    """WebSocket client of the daemon's `GET /v1/events`, reconnecting with exponential backoff."""

    kind = "live"

    def __init__(
        self, url: str, api_key: str | None = None, types: list[str] | None = None,
        backoff: float = 0.5, backoff_max: float = 10.0, connect_timeout: float = 5.0,
    ) -> None:
        self.url = events_url(url, types)
        self.types = list(types) if types else None
        self.filtered = bool(types)  # subscribed to some event types only
        self.api_key = api_key
        self.backoff, self.backoff_max = backoff, backoff_max
        self.connect_timeout = connect_timeout
        self.connects = 0
        self.frames = 0
        self.status = Status("connecting")

    def delay(self, attempt: int) -> float:
        """Backoff before reconnect attempt `attempt` (1-based): backoff·2^(attempt-1), capped."""
        return min(self.backoff_max, self.backoff * 2 ** (attempt - 1))

    def _set(self, sink: Sink, s: Status) -> None:
        self.status = s
        sink.sink_status(s)

    async def run(self, sink: Sink) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        attempt = 0
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                self._set(sink, Status("connecting", self.url, attempt))
                err = "connection closed"
                try:
                    async with session.ws_connect(self.url, headers=headers, heartbeat=20, max_msg_size=0) as ws:
                        attempt = 0
                        self.connects += 1
                        self._set(sink, Status("connected", self.url))
                        async for msg in ws:
                            if msg.type == aiohttp.WSMsgType.TEXT:
                                data = msg.data
                            elif msg.type == aiohttp.WSMsgType.BINARY:
                                data = msg.data.decode("utf-8", "replace")
                            else:  # ERROR / CLOSE
                                break
                            self.frames += 1
                            for line in data.splitlines():
                                if line.strip():
                                    sink.sink_raw(line)
                        if ws.close_code not in (None, 1000):
                            err = f"closed by server (code {ws.close_code})"
                except aiohttp.WSServerHandshakeError as e:
                    err = (f"unauthorized ({e.status}): check --api-key" if e.status in (401, 403)
                           else f"handshake failed ({e.status} {e.message})")
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                    err = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                attempt += 1
                d = self.delay(attempt)
                self._set(sink, Status("reconnecting", err, attempt, d))
                await asyncio.sleep(d)


class ReplaySource:
    """Plays a recording back with its original timing scaled by `speed`; pause/resume/step/stop_at."""

    kind = "replay"

    def __init__(
        self, path: str | Path, speed: float = 1.0, paused: bool = False, stop_at: int | None = None,
        max_gap: float = 2.0,
    ) -> None:
        self.path = Path(path)
        self.speed = speed
        self.stop_at = stop_at
        self.max_gap = max_gap
        self.delivered = 0
        self.total = 0
        self.filtered = False
        self.bad_lines = 0
        self.done = False
        self._go = asyncio.Event()
        self._steps = 0
        self.paused = paused
        if not paused:
            self._go.set()
        self.status = Status("paused" if paused else "replaying")

    def pause(self) -> None:
        self.paused = True
        self._go.clear()

    def resume(self) -> None:
        self.paused = False
        if self.stop_at is not None and self.delivered >= self.stop_at:
            self.stop_at = None  # resuming past the stop point plays on
        self._go.set()

    def step(self, n: int = 1) -> None:
        """Deliver n more events, then pause again."""
        self._steps += n
        self._go.set()

    def _state(self) -> Status:
        if self.done:
            return Status("ended", f"{self.delivered}/{self.total} events")
        return Status("paused" if self.paused else "replaying", f"{self.delivered}/{self.total} events")

    def _notify(self, sink: Sink) -> None:
        self.status = self._state()
        sink.sink_status(self.status)

    async def _gate(self, sink: Sink) -> None:
        """Before each event: pause at `stop_at`, wait while paused; a pending step lets one event through."""
        if self.stop_at is not None and self.delivered >= self.stop_at and not self.paused and not self._steps:
            self.pause()
            self._notify(sink)
        while self.paused and not self._steps:
            self._go.clear()
            await self._go.wait()
            self._notify(sink)
        if self._steps:
            self._steps -= 1

    async def _wait(self, gap: float) -> None:
        """Sleep `gap` seconds of recorded time, following speed changes and pauses while waiting."""
        left = min(max(gap, 0.0), self.max_gap)
        while left > 1e-6 and self.speed > 0 and not self._steps:
            if self.paused:
                self._go.clear()
                await self._go.wait()
                continue
            tick = min(0.05, left / self.speed)
            await asyncio.sleep(tick)
            left -= tick * self.speed

    async def run(self, sink: Sink) -> None:
        rec = await asyncio.to_thread(read_recording, self.path)
        self.total, self.bad_lines = len(rec.events), rec.bad_lines
        self.filtered = bool(rec.header.meta.get("types"))  # recorded from a type-filtered subscription
        for _ in range(rec.bad_lines):
            sink.sink_raw("")  # counted as malformed by the sink, like a bad live frame
        self._notify(sink)
        prev: float | None = None
        for e in rec.events:
            if prev is not None:
                await self._wait(e.ts - prev)
            await self._gate(sink)
            prev = e.ts
            sink.sink_event(e)
            self.delivered += 1
            if self.speed <= 0 and self.delivered % 64 == 0:
                await asyncio.sleep(0)  # let the UI breathe during a fast-forward
            if self.delivered % 16 == 0:
                self._notify(sink)
        self.done = True
        self._notify(sink)
