"""Does a subscriber that never reads `/v1/events` slow the engine? A benchmark figure for issue 5.

Starts one `mleagle serve` (default tiny-dummy with `--draft random:2`: tiny forwards, so the event
path is as large a share of each step as it gets), then runs interleaved rounds of two arms, each
sending N concurrent native `/generate` requests of `--max-tokens` tokens and timing them:
(a) no subscriber; (b) one WebSocket subscriber on `/v1/events` that completes the handshake on a raw
socket with a small receive buffer and then never reads a byte (so the relay's writes back up and its
bounded queue drops). Reports generated tokens/s per round and the median per arm, prints a table and
writes JSON (default results/bench_events.json). Rounds are interleaved because other work shares the
machine. Run from the repository root: `.venv/bin/python scripts/bench_events.py [--config smollm2-135m]`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import re
import socket
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.daemon_helpers import ServerProc


def stalled_subscriber(url: str) -> socket.socket:
    """Open /v1/events as a WebSocket on a raw socket and return it unread (caller closes it)."""
    host, port = url.split("://")[1].split(":")
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills after a few events
    s.connect((host, int(port)))
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall((f"GET /v1/events HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)  # read the response headers one byte at a time: nothing of the frames after them
    assert head.startswith(b"HTTP/1.1 101"), head[:80]
    return s


def read_backlog(s: socket.socket) -> tuple[int, int]:
    """After the round, read what the stalled subscriber left queued: its size, and the most events the
    relay reported dropping for it (its `drops` events of stage "relay"), i.e. whether it really backed up."""
    s.settimeout(1.0)
    data = b""
    try:
        while chunk := s.recv(1 << 20):
            data += chunk
    except TimeoutError:
        pass
    drops = [sum(int(n) for n in re.findall(rb'"[a-z_]+":(\d+)', m)) for m in
             re.findall(rb'"type":"drops","stage":"relay","dropped":\{([^}]*)\}', data)]
    return len(data), max(drops, default=0)


async def one_round(url: str, n: int, max_tokens: int, seed: int) -> tuple[int, float]:
    async def req(s: aiohttp.ClientSession, i: int) -> int:
        ids = [(seed * 31 + i * 7 + k) % 400 + 3 for k in range(16)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                                      "ignore_eos": True}}
        async with s.post(url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            return int((await r.json())["meta_info"]["completion_tokens"])

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        t0 = time.perf_counter()
        toks = await asyncio.gather(*(req(s, i) for i in range(n)))
        return sum(toks), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny-dummy")
    ap.add_argument("--draft", default="random:2")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="results/bench_events.json")
    a = ap.parse_args()
    srv = ServerProc("--config", a.config, "--draft", a.draft, "--max-running-requests", str(max(8, a.concurrency)))
    rows: list[dict[str, object]] = []
    try:
        srv.wait_healthy(120)
        asyncio.run(one_round(srv.url, a.concurrency, 8, 0))  # warm-up
        for r in range(a.rounds):
            order = ["none", "stalled"] if r % 2 == 0 else ["stalled", "none"]
            for arm in order:
                sock = stalled_subscriber(srv.url) if arm == "stalled" else None
                try:
                    toks, dt = asyncio.run(one_round(srv.url, a.concurrency, a.max_tokens, r))
                finally:
                    backlog = relay_drops = 0
                    if sock is not None:
                        backlog, relay_drops = read_backlog(sock)
                        sock.close()
                rows.append({"round": r, "arm": arm, "tokens": toks, "seconds": round(dt, 3), "tok_s": round(toks / dt, 2),
                             "unread_bytes": backlog, "relay_dropped": relay_drops})
                print(f"round {r} {arm:8s} {toks} tokens in {dt:.2f}s = {toks / dt:.1f} tok/s"
                      f"{f'  (unread {backlog} B, relay dropped {relay_drops})' if sock else ''}", flush=True)
                time.sleep(0.5)
        health = srv.get("/health")[1]
    finally:
        srv.terminate()
    med = {arm: statistics.median(float(x["tok_s"]) for x in rows if x["arm"] == arm) for arm in ("none", "stalled")}
    delta = (med["stalled"] / med["none"] - 1) * 100
    print("\n| arm | median tok/s | rounds |\n|---|---|---|")
    for arm in ("none", "stalled"):
        runs = ", ".join(str(x["tok_s"]) for x in rows if x["arm"] == arm)
        print(f"| {arm} | {med[arm]:.1f} | {runs} |")
    print(f"stalled vs none: {delta:+.1f}%")
    out = {"machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus", "device": "cpu",
           "model": a.config, "draft": a.draft, "concurrency": a.concurrency, "max_tokens": a.max_tokens,
           "rounds": rows, "median_tok_s": med, "stalled_vs_none_pct": round(delta, 2),
           "engine_restarts": health.get("restarts") if isinstance(health, dict) else None,
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
