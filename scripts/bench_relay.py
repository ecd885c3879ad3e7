"""What the daemon's event relay costs per state event: `python scripts/bench_relay.py [--repeats 5] [--out FILE]`.

A speculative engine publishes about 15 state events a step (a batch and logprob-metadata event per
runner, pools, acceptance, the policy's decision, request lifecycle), and through the server it runs
hundreds of steps a second; the daemon folds every one into its `StateTracker` on the same event loop
that streams the responses. This records the events of a real engine run (a tiny random model with a
random 3-layer draft at full depth, 64 requests of 40 tokens: `tests/spec_helpers.tiny_engine`), then
per repeat starts the daemon's real `EventsRelay` fed by the engine client's `ZmqReader` on a real SUB
socket, floods it from a PUB
socket in another thread, and times the relay from its first event to its last (wall, the publisher
thread sharing the interpreter). Prints a table and writes JSON (default results/bench_relay.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.spec_helpers

import torch
import zmq

from mleagle.daemon.events_relay import EventsRelay
from mleagle.daemon.zmq_reader import ZmqReader
from mleagle.engine.contract.event_bus import EventBus
from mleagle.engine.contract.events import dump_event
from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.service.telemetry import Telemetry


def record_events() -> list[list[bytes]]:
    from tests.spec_helpers import tiny_engine

    torch.set_num_threads(1)
    e = tiny_engine("random:3", max_running_requests=64)
    bus = EventBus()
    Telemetry.attach(e, bus)
    rng = random.Random(0)
    sp = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    for i in range(64):
        e.add_request(f"r{i}", [rng.randrange(3, 250) for _ in range(40)], sp)
    frames: list[list[bytes]] = []
    steps = 0
    while e.has_work():
        e.step()
        steps += 1
        frames += [[x.type.encode(), dump_event(x).encode()] for x in bus.drain()]
    print(f"recorded {len(frames)} events over {steps} steps ({len(frames) / steps:.1f} a step)")
    return frames


class _Client:
    on_events: Any = None


async def one_run(frames: list[list[bytes]]) -> float:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, len(frames) + 10)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:*")
    address = sub.getsockopt(zmq.LAST_ENDPOINT).decode()
    c = _Client()
    relay = EventsRelay(c)
    relay.start()
    reader = ZmqReader(sub, lambda batch: c.on_events(0, batch), multipart=True)  # as the engine client reads
    reader.start()

    def flood() -> None:
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.SNDHWM, len(frames) + 10)
        s.connect(address)
        time.sleep(0.5)  # the subscription propagates
        for f in frames:
            s.send_multipart(f)
        time.sleep(1.0)
        s.close(linger=0)

    th = threading.Thread(target=flood, daemon=True)
    th.start()
    t0 = None
    deadline = time.monotonic() + 60
    while relay.received < len(frames) and time.monotonic() < deadline:
        await asyncio.sleep(0.0005)
        if t0 is None and relay.received:
            t0 = time.perf_counter()
    dt = time.perf_counter() - (t0 or time.perf_counter())
    got = relay.received
    relay.stop()
    reader.close()
    th.join()
    sub.close(linger=0)
    ctx.term()
    if got < len(frames):
        raise RuntimeError(f"the relay took {got} of {len(frames)} events")
    return dt / got * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--copies", type=int, default=3, help="the recorded events sent this many times per run")
    ap.add_argument("--out", default="results/bench_relay.json")
    a = ap.parse_args()
    frames = record_events() * a.copies
    us = [asyncio.run(one_run(frames)) for _ in range(a.repeats)]
    rep: dict[str, Any] = {"machine": f"{platform.processor() or platform.machine()}, {platform.python_version()}",
                           "events_per_run": len(frames), "us_per_event": [round(x, 2) for x in us],
                           "median_us": round(statistics.median(us), 2)}
    print("| events per run | µs per event, median (min-max) |\n|---:|---:|")
    print(f"| {len(frames)} | {rep['median_us']} ({min(us):.1f}-{max(us):.1f}) |")
    if a.out:
        Path(a.out).write_text(json.dumps(rep, indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
