"""What the state events cost an engine's loop per step: the telemetry hooks and the event pump.

Builds an engine (a config name, e.g. `tiny-dummy`, with `--draft`), attaches the engine process's
`EventPump` to a real zmq PUB socket with a SUB reading it, and runs closed batches of greedy requests
through `Engine.add_request`/`step`, pumping after each step as the engine process does. Per round it
reports the host microseconds per step spent in the telemetry hooks (inside `step`) and in the pump
(building the JSON and publishing), and the events per step, for every step reported (`full`, what a
`/v1/events` subscriber gets) and for the sampled mode a server uses while nobody subscribes. The
first round of each mode is a warm-up and is not reported.

    python scripts/events_cost.py --config tiny-dummy --draft random:3 --rounds 3 --out events_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def one_round(e: Any, pump: Any, sub: Any, zmq: Any, tag: str, n_req: int, tokens: int) -> dict[str, float]:
    from mleagle.engine.contract.sampling_params import SamplingParams

    for i in range(n_req):
        e.add_request(f"{tag}-{i}", list(range(1, 30 + i)), SamplingParams(temperature=0, max_new_tokens=tokens,
                                                                           ignore_eos=True))
    tel0, ev0, pump_s, steps = pump.telemetry.spent_s, pump.bus.emitted, 0.0, 0
    while e.has_work():
        e.step()
        steps += 1
        t0 = time.perf_counter()
        pump.pump()
        pump_s += time.perf_counter() - t0
    while True:  # what the subscriber got, so no queue grows between rounds
        try:
            sub.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
    return {"steps": steps, "hooks_us_per_step": 1e6 * (pump.telemetry.spent_s - tel0) / steps,
            "pump_us_per_step": 1e6 * pump_s / steps, "events_per_step": (pump.bus.emitted - ev0) / steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="tiny-dummy")
    ap.add_argument("--draft", default="random:3")
    ap.add_argument("--requests", type=int, default=8, help="requests per round, all at once")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON with every round")
    a = ap.parse_args(argv)
    import zmq

    from mleagle.engine.contract.config import load_config
    from mleagle.engine.contract.event_bus import ZmqEventPublisher
    from mleagle.engine.service.process import EventPump, build_engine

    cfg = load_config(a.config)
    cfg.engine.draft = a.draft
    e = build_engine(cfg)
    ctx = zmq.Context()
    addr = f"ipc://{tempfile.mkdtemp(prefix='events-cost-')}/ev"
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.bind(addr)
    pub = ZmqEventPublisher(addr, bind=False, hwm=0)
    pump = EventPump(pub)
    pump.attach(e, full=True, sample_every_s=cfg.server.events_sample_ms / 1e3)
    time.sleep(0.3)  # the subscription propagates
    res: dict[str, Any] = {"config": a.config, "draft": a.draft, "requests": a.requests, "tokens": a.tokens,
                           "sample_every_s": pump.telemetry.sample_every_s, "modes": {}}
    print(f"{a.config}, draft {a.draft}: {a.requests} requests of {a.tokens} tokens a round\n")
    print("| events | hooks µs/step | pump µs/step | events/step |")
    print("|---|---:|---:|---:|")
    for mode in ("every step", "sampled"):
        pump.telemetry.full = mode == "every step"
        rows = [one_round(e, pump, sub, zmq, f"{mode[0]}{r}", a.requests, a.tokens) for r in range(a.rounds + 1)][1:]
        res["modes"][mode] = rows
        med = {k: statistics.median(x[k] for x in rows) for k in ("hooks_us_per_step", "pump_us_per_step", "events_per_step")}
        print(f"| {mode} | {med['hooks_us_per_step']:.0f} | {med['pump_us_per_step']:.0f} | {med['events_per_step']:.1f} |")
    pub.close()
    sub.close(linger=0)
    ctx.term()
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
