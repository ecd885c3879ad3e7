"""Moving state events out of the engine without ever slowing it: a bounded bus, a state tracker, ZMQ.

The engine calls `EventBus.emit(event)` from its loop: an O(1) append to a bounded deque that never
blocks and never raises into the engine; when the deque is full the oldest event is dropped and counted
per type (recent state matters more than old state). The engine process periodically `drain()`s the bus
and hands the events to `ZmqEventPublisher.publish`, a PUB socket with a small high-water mark and
non-blocking sends (XPUB_NODROP makes a full queue raise EAGAIN so the drop is counted, not silent). The
daemon binds the SUB side (`daemon/zmq_reader.py` reads it from its event loop), folds the events into
a `StateTracker` so a new WebSocket subscriber gets a `SnapshotEvent` first, then relays the deltas. Torch-free; zmq is imported
only by the ZMQ classes, so the tracker is importable with pydantic alone.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from mleagle.engine.contract.events import (
    AcceptanceEvent,
    BatchEvent,
    DropsEvent,
    EngineEvent,
    Event,
    GraphEvent,
    PoolEvent,
    RequestEvent,
    SnapshotEvent,
    SpecPolicyEvent,
    dump_event,
)

if TYPE_CHECKING:
    import zmq


class EventBus:
    """Bounded, drop-oldest event queue between the engine loop and whoever forwards the events.

    `emit` is safe to call from the engine thread while another thread drains: deque append/popleft are
    atomic, and the only race (two emitters on a full deque) at worst drops one extra event, counted.
    `enabled` lets the engine skip building events when nobody listens.
    """

    def __init__(self, maxlen: int = 8192, enabled: bool = True) -> None:
        self.maxlen = maxlen
        self.enabled = enabled
        self.q: deque[Any] = deque()
        self.dropped: Counter[str] = Counter()
        self.emitted = 0
        self._seq = itertools.count(1)

    def emit(self, event: Any) -> None:
        """Queue one event; O(1), never blocks, never raises."""
        if not self.enabled:
            return
        try:
            event.seq = next(self._seq)
            if len(self.q) >= self.maxlen:
                try:
                    old = self.q.popleft()
                    self.dropped[getattr(old, "type", "?")] += 1
                except IndexError:  # drained concurrently: there is room now
                    pass
            self.q.append(event)
            self.emitted += 1
        except Exception:  # an event bug must never take the engine down
            self.dropped["error"] += 1

    def drain(self, limit: int | None = None) -> list[Event]:
        """Take the queued events (up to `limit`), oldest first."""
        out: list[Event] = []
        q = self.q
        n = len(q) if limit is None else min(limit, len(q))
        for _ in range(n):
            try:
                out.append(q.popleft())
            except IndexError:
                break
        return out

    def __len__(self) -> int:
        return len(self.q)

    def drops_event(self, stage: str = "engine") -> DropsEvent:
        return DropsEvent(stage=stage, dropped=dict(self.dropped))


class StateTracker:
    """Folds events into the current state, so a late subscriber can be sent one SnapshotEvent.

    Keeps the latest engine status, the latest pool and graph event per runner, the requests that have
    not finished (without their token deltas: those are history, not state), the last batch,
    acceptance and speculation-policy events, and the drop counters last reported by any stage.
    """

    def __init__(self) -> None:
        self.engine: EngineEvent | None = None
        self.pools: dict[str, PoolEvent] = {}
        self.graphs: dict[str, GraphEvent] = {}
        self.requests: dict[str, RequestEvent] = {}
        self.last_batch: BatchEvent | None = None
        self.last_acceptance: AcceptanceEvent | None = None
        self.last_spec_policy: SpecPolicyEvent | None = None
        self.dropped: dict[str, dict[str, int]] = {}

    def apply(self, e: Event) -> None:
        if isinstance(e, PoolEvent):
            self.pools[e.runner] = e
        elif isinstance(e, GraphEvent):
            self.graphs[e.runner] = e
        elif isinstance(e, BatchEvent):
            self.last_batch = e
        elif isinstance(e, AcceptanceEvent):
            self.last_acceptance = e
        elif isinstance(e, SpecPolicyEvent):
            self.last_spec_policy = e
        elif isinstance(e, EngineEvent):
            self.engine = e
        elif isinstance(e, RequestEvent):
            if e.state in ("finished", "aborted"):
                self.requests.pop(e.rid, None)
            else:
                self.requests[e.rid] = e.model_copy(update={"tokens": None}) if e.tokens else e
        elif isinstance(e, DropsEvent):
            self.dropped[e.stage] = dict(e.dropped)
        elif isinstance(e, SnapshotEvent):
            self.engine = e.engine
            self.pools = {p.runner: p for p in e.pools}
            self.graphs = {g.runner: g for g in e.graphs}
            self.requests = {r.rid: r for r in e.requests}
            self.last_batch = e.last_batch
            self.last_acceptance = e.last_acceptance
            self.last_spec_policy = e.last_spec_policy
            if e.dropped:
                self.dropped["snapshot"] = dict(e.dropped)

    def snapshot(self) -> SnapshotEvent:
        dropped: Counter[str] = Counter()
        for d in self.dropped.values():
            dropped.update(d)
        return SnapshotEvent(
            engine=self.engine,
            pools=[self.pools[k] for k in sorted(self.pools, key=runner_order)],
            graphs=[self.graphs[k] for k in sorted(self.graphs, key=runner_order)],
            requests=list(self.requests.values()),
            last_batch=self.last_batch,
            last_acceptance=self.last_acceptance,
            last_spec_policy=self.last_spec_policy,
            dropped=dict(dropped),
        )


def runner_order(name: str) -> tuple[int, int, str]:
    """Sort key: target first, then draft0, draft1, ... numerically, then anything else by name."""
    if name == "target":
        return (0, 0, name)
    if name.startswith("draft") and name[5:].isdigit():
        return (1, int(name[5:]), name)
    return (2, 0, name)


def _attach(sock: zmq.Socket, address: str, bind: bool) -> str:
    """Bind (returning the actual endpoint, e.g. the port a `tcp://...:0` got) or connect."""
    import zmq  # lazily, like the classes below

    if bind:
        sock.bind(address)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.connect(address)
    return address


def split_events(frames: list[bytes]) -> list[tuple[bytes, bytes]]:
    """One published message's events as (type, JSON) pairs, in order (`ZmqEventPublisher`'s format;
    a message whose two frames do not pair up is dropped whole)."""
    kinds = frames[0].split(b" ")
    lines = frames[-1].split(b"\n")
    if len(frames) != 2 or len(kinds) != len(lines):
        return []
    return list(zip(kinds, lines))


class ZmqEventPublisher:
    """PUB socket for the engine process: the events of one `publish` go out as one 2-frame message,
    [kinds, lines]: their types separated by spaces, and their JSON lines separated by newlines (a JSON
    line holds no raw newline). One event is therefore [type, JSON]. `split_events` takes them apart.

    One message a call rather than one per event: zmq costs a few microseconds a frame, and a
    speculative engine emits ~15 events a step, hundreds of steps a second (on the dev VM, 14 typical
    events took 142-168 µs to publish one message each and 65-71 µs as one message). A call's events travel in
    messages of at most `max_per_msg`. Sends are NOBLOCK with a small send HWM and XPUB_NODROP, so a
    subscriber that does not read makes `publish` count drops instead of blocking or buffering without
    bound. With no subscriber connected, PUB discards messages (not counted).
    """

    def __init__(self, address: str, hwm: int = 1000, bind: bool = True, ctx: zmq.Context | None = None,
                 max_per_msg: int = 512) -> None:
        import zmq

        self._zmq = zmq
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.XPUB_NODROP, 1)
        self.address = _attach(self.sock, address, bind)
        self.max_per_msg = max_per_msg
        self.dropped: Counter[str] = Counter()
        self.sent = 0

    def publish(self, events: Iterable[Any]) -> int:
        """Send events without blocking; returns how many were sent (the rest are counted in dropped)."""
        zmq = self._zmq
        kinds: list[str] = []
        lines: list[bytes] = []
        for e in events:
            t = getattr(e, "type", "?")
            try:
                lines.append(dump_event(e).encode())
                kinds.append(t)
            except Exception:
                self.dropped[t] += 1
        n = 0
        for i in range(0, len(lines), self.max_per_msg):
            k = kinds[i : i + self.max_per_msg]
            try:
                self.sock.send_multipart([" ".join(k).encode(), b"\n".join(lines[i : i + self.max_per_msg])],
                                         flags=zmq.NOBLOCK)
                n += len(k)
            except Exception:  # zmq.Again (a subscriber's queue is full) or a closed socket
                for t in k:
                    self.dropped[t] += 1
        self.sent += n
        return n

    def drops_event(self) -> DropsEvent:
        return DropsEvent(stage="publisher", dropped=dict(self.dropped))

    def close(self) -> None:
        self.sock.close(linger=0)
