"""`GET /v1/events`: the engine's state events relayed to WebSocket subscribers.

The engine client reads the SUB socket of the current engine generation and hands the relay every
waiting event in one `feed` call per wake-up; the relay folds them into a `StateTracker` (a new
generation starts a new one). Each WebSocket subscriber first gets a
`snapshot` event (the current state), then the deltas as JSON text frames, optionally filtered by
type (`?types=batch,pool`). A subscriber that cannot keep up loses its oldest events (its queue is
bounded) and is told how many with a `drops` event of stage "relay"; the engine never waits for it, and
one that takes no frame at all within the write timeout is disconnected. What the events say about
requests is decided in the engine (counts and lifecycle; token text only with
`server.events_include_text`). The route sits behind the API key like every other route but `/health`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import Any

from aiohttp import web

from mleagle.daemon.errors import APIError
from mleagle.engine.contract.event_bus import StateTracker, split_events
from mleagle.engine.contract.events import EVENT_TYPES, DropsEvent, EventError, dump_event, parse_event

log = logging.getLogger("mleagle.daemon.events")
SUB_QUEUE = 2048
# Event types the tracker keeps only the newest of: with no subscriber they are stored raw and parsed
# only for a snapshot. Logprob metadata the tracker does not keep at all: with no subscriber it is dropped.
LATEST_ONLY = frozenset({b"batch", b"acceptance", b"spec_policy"})
UNTRACKED = frozenset({b"logprob_meta"})


class _Sub:
    def __init__(self, types: set[str] | None) -> None:
        self.types = types
        self.q: asyncio.Queue[Any] = asyncio.Queue(SUB_QUEUE)
        self.dropped: Counter[str] = Counter()

    def put(self, e: Any) -> None:
        if self.types is not None and e.type not in self.types:
            return
        if self.q.full():
            old = self.q.get_nowait()
            self.dropped[old.type] += 1
        self.q.put_nowait(e)


class EventsRelay:
    def __init__(self, client: Any, write_timeout_s: float = 30.0) -> None:
        self.client = client
        self.write_timeout_s = write_timeout_s
        self.tracker = StateTracker()
        self.latest: dict[bytes, bytes] = {}  # type frame -> the newest unparsed event of that type
        self.subs: set[_Sub] = set()
        self.gen: int | None = None  # the engine generation whose events the tracker holds
        self.received = 0

    def start(self) -> None:
        """Take the engine client's events (its SUB socket's reader calls `feed` once per wake-up)."""
        self.client.on_events = self.feed

    def stop(self) -> None:
        if getattr(self.client, "on_events", None) == self.feed:
            self.client.on_events = None

    def feed(self, gen: int, batch: list[list[bytes]]) -> None:
        """Every event that was waiting, in one call: a speculative engine publishes ~15 events a step,
        hundreds of steps a second, so the per-wake-up cost is what the daemon pays per step."""
        if gen != self.gen:
            self.gen, self.tracker, self.latest = gen, StateTracker(), {}  # a new engine: old state is gone
        for msg in batch:
            for kind, raw in split_events(msg):
                self.received += 1
                if not self.subs and (kind in LATEST_ONLY or kind in UNTRACKED):
                    # Nobody is listening and the tracker keeps only the newest of these (or none): parse
                    # it when a subscriber's snapshot needs it (`_settle`), not hundreds of times a second.
                    if kind in LATEST_ONLY:
                        self.latest[kind] = raw
                    continue
                try:
                    e = parse_event(raw)
                except EventError:
                    continue
                self.tracker.apply(e)
                for s in self.subs:
                    s.put(e)

    def _detail(self) -> None:
        """Every step's events while anyone subscribes, a sample of them otherwise (`EventDetail`)."""
        set_detail = getattr(self.client, "set_event_detail", None)
        if set_detail is not None:
            set_detail(bool(self.subs))

    def _settle(self) -> None:
        """Fold the unparsed newest events into the tracker (before a snapshot is taken)."""
        latest, self.latest = self.latest, {}
        for raw in latest.values():
            try:
                self.tracker.apply(parse_event(raw))
            except EventError:
                pass

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if not self.client.cfg.server.state_events:
            raise APIError(404, "this server publishes no state events (started with --no-state-events)",
                           code="state_events_off")
        raw = request.query.get("types", "").strip()
        types = None
        if raw:
            types = {t.strip() for t in raw.split(",") if t.strip()}
            bad = types - set(EVENT_TYPES)
            if bad:
                raise APIError(400, f"unknown event types {sorted(bad)}; known: {', '.join(EVENT_TYPES)}", param="types")
        ws = web.WebSocketResponse(heartbeat=30.0)
        await ws.prepare(request)
        sub = _Sub(types)
        self._settle()  # before the subscriber is added: from here on every event is parsed and relayed
        self.subs.add(sub)
        self._detail()
        # Two tasks, both owned here: whatever ends this handler (the client closing, a dropped
        # connection cancelling it, a send that times out) cancels and awaits both, so no task is
        # ever left pending for the garbage collector.
        reader = asyncio.create_task(self._drain_client(ws))
        getter: asyncio.Task[Any] | None = None
        try:
            await self._send(ws, dump_event(self.tracker.snapshot()))
            reported = 0
            while not ws.closed and not reader.done():
                getter = asyncio.create_task(sub.q.get())
                done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    break
                e, getter = getter.result(), None
                await self._send(ws, dump_event(e))
                lost = sum(sub.dropped.values())
                if lost != reported and (types is None or "drops" in types):
                    reported = lost
                    await self._send(ws, dump_event(DropsEvent(stage="relay", dropped=dict(sub.dropped))))
        except (ConnectionResetError, RuntimeError, asyncio.TimeoutError):
            pass
        finally:
            self.subs.discard(sub)
            self._detail()
            for t in (getter, reader):
                if t is not None:
                    t.cancel()
            await asyncio.gather(*(t for t in (getter, reader) if t is not None), return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), 1.0)
        return ws

    async def _send(self, ws: web.WebSocketResponse, text: str) -> None:
        """A subscriber that does not take a frame within the write timeout is disconnected."""
        await asyncio.wait_for(ws.send_str(text), self.write_timeout_s)

    @staticmethod
    async def _drain_client(ws: web.WebSocketResponse) -> None:
        async for _ in ws:  # subscribers only listen; reading notices their close
            pass
