"""`GET /v1/events`: the engine's state events relayed to WebSocket subscribers.

The SUB socket of the current engine generation (bound by the engine client) feeds a `StateTracker`; each WebSocket subscriber first gets a
`snapshot` event (the current state), then the deltas as JSON text frames, optionally filtered by
type (`?types=batch,pool`). A subscriber that cannot keep up loses its oldest events (its queue is
bounded) and is told how many with a `drops` event of stage "relay"; the engine never waits for it.
The route sits behind the API key like every other route but `/health`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import zmq
from aiohttp import web

from mleagle.daemon.errors import APIError
from mleagle.engine.contract.event_bus import StateTracker
from mleagle.engine.contract.events import EVENT_TYPES, DropsEvent, EventError, dump_event, parse_event

log = logging.getLogger("mleagle.daemon.events")
SUB_QUEUE = 2048


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
    def __init__(self, client: Any) -> None:
        self.client = client
        self.tracker = StateTracker()
        self.subs: set[_Sub] = set()
        self.task: asyncio.Task[None] | None = None
        self.received = 0
        self._stop = False

    def start(self) -> None:
        self._stop = False
        self.task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        # No cancellation of a pending zmq.asyncio recv: with pyzmq that can wait for the next message.
        # The loop polls with a short timeout and sees the flag instead.
        self._stop = True
        if self.task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.task), 2.0)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                self.task.cancel()

    async def _run(self) -> None:
        current = None
        while not self._stop:
            sub = self.client.events
            if sub is None:
                await asyncio.sleep(0.2)
                continue
            try:
                if not await sub.sock.poll(200, zmq.POLLIN):
                    continue
                frames = await sub.sock.recv_multipart(zmq.NOBLOCK)
            except (zmq.ZMQError, asyncio.CancelledError):
                # The engine generation ended and its socket was closed (pyzmq cancels the pending poll
                # future then); a cancellation of this task itself is passed on.
                task = asyncio.current_task()
                if task is not None and getattr(task, "cancelling", lambda: 0)():
                    raise
                await asyncio.sleep(0.1)
                continue
            try:
                e = parse_event(frames[-1])
            except EventError:
                continue
            if sub is not current:
                current, self.tracker = sub, StateTracker()  # a new engine: old state is gone
            self.received += 1
            self.tracker.apply(e)
            for s in self.subs:
                s.put(e)

    async def handle(self, request: web.Request) -> web.StreamResponse:
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
        self.subs.add(sub)
        reader = asyncio.create_task(self._drain_client(ws))
        try:
            await ws.send_str(dump_event(self.tracker.snapshot()))
            reported = 0
            while not ws.closed and not reader.done():
                get = asyncio.create_task(sub.q.get())
                done, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    break
                await ws.send_str(dump_event(get.result()))
                lost = sum(sub.dropped.values())
                if lost != reported and (types is None or "drops" in types):
                    reported = lost
                    await ws.send_str(dump_event(DropsEvent(stage="relay", dropped=dict(sub.dropped))))
        except (ConnectionResetError, RuntimeError):
            pass
        finally:
            self.subs.discard(sub)
            reader.cancel()
            await ws.close()
        return ws

    @staticmethod
    async def _drain_client(ws: web.WebSocketResponse) -> None:
        async for _ in ws:  # subscribers only listen; reading notices their close
            pass
