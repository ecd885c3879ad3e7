"""The daemon-engine channel's round trip: zmq PUSH/PULL over `ipc://` against a Unix SOCK_SEQPACKET pair.

`python scripts/ipc_round_trip.py [--requests 300] [--gap-ms 5] [--out FILE.json]`: an "engine" process
polls its request socket without sleeping (a non-blocking receive, then `sched_yield`), as the GPU
engine loop does after a step, and sends each message straight back; the "daemon" waits for the
answer in asyncio (`add_reader` on the socket's fd, as `ZmqReader` does), sending a 300-byte message
every `--gap-ms` (a c1 client's pace). Nothing of mleagle runs: this measures the transport under the
TTFT split's `to_engine` + `to_daemon` (0.26 + 0.23 ms at c1 on the H200). zmq moves each message
through an I/O thread on both sides, each of which must wake; a Unix socket wakes the reader directly.
On the 2-core dev VM, four runs: zmq 220-269 us median, Unix SOCK_SEQPACKET 50-110 us.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import zmq

MSG = os.urandom(300)


def engine_zmq(d: str) -> None:
    c = zmq.Context()
    pull, push = c.socket(zmq.PULL), c.socket(zmq.PUSH)
    pull.connect(f"ipc://{d}/req")
    push.connect(f"ipc://{d}/out")
    while True:
        try:
            m = pull.recv(zmq.NOBLOCK)
        except zmq.Again:
            os.sched_yield()
            continue
        if m == b"end":
            return
        push.send(m)


def engine_unix(path: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    s.setblocking(False)
    while True:
        try:
            m = s.recv(1 << 20)
        except BlockingIOError:
            os.sched_yield()
            continue
        if m == b"end":
            return
        s.send(m)


async def rounds(send: Callable[[bytes], object], fd: int, recv_all: Callable[[], bool], n: int,
                 gap: float) -> list[float]:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[float] | None = None

    def readable() -> None:
        if recv_all() and fut is not None and not fut.done():
            fut.set_result(time.perf_counter())

    loop.add_reader(fd, readable)
    out = []
    try:
        for _ in range(n):
            await asyncio.sleep(gap)
            fut = loop.create_future()
            t0 = time.perf_counter()
            send(MSG)
            loop.call_soon(readable)  # a zmq fd signals a state change: drain once after every send
            out.append(await fut - t0)
    finally:
        loop.remove_reader(fd)
    return out


async def run_zmq(d: str, n: int, gap: float) -> list[float]:
    c = zmq.Context()
    push, pull = c.socket(zmq.PUSH), c.socket(zmq.PULL)
    push.bind(f"ipc://{d}/req")
    pull.bind(f"ipc://{d}/out")
    p = mp.Process(target=engine_zmq, args=(d,))
    p.start()
    await asyncio.sleep(0.5)

    def recv_all() -> bool:
        got = False
        while True:
            try:
                pull.recv(zmq.NOBLOCK)
                got = True
            except zmq.Again:
                return got

    ts = await rounds(lambda m: push.send(m, zmq.NOBLOCK), pull.getsockopt(zmq.FD), recv_all, n, gap)
    push.send(b"end")
    p.join()
    c.destroy(linger=0)
    return ts


async def run_unix(d: str, n: int, gap: float) -> list[float]:
    path = f"{d}/u.sock"
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lst.bind(path)
    lst.listen(1)
    p = mp.Process(target=engine_unix, args=(path,))
    p.start()
    conn, _ = lst.accept()
    conn.setblocking(False)

    def recv_all() -> bool:
        got = False
        while True:
            try:
                conn.recv(1 << 20)
                got = True
            except BlockingIOError:
                return got

    ts = await rounds(conn.send, conn.fileno(), recv_all, n, gap)
    conn.setblocking(True)
    conn.send(b"end")
    p.join()
    conn.close()
    lst.close()
    return ts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="ipc-rtt-")
    res = {}
    print("| transport | round trip median us | p90 us |\n|---|---:|---:|")
    for name, f in (("zmq ipc PUSH/PULL", run_zmq), ("unix SOCK_SEQPACKET", run_unix)):
        ts = sorted(asyncio.run(f(d, a.requests, a.gap_ms / 1e3)))[a.requests // 10:]  # the first tenth warms up
        res[name] = {"median_us": round(statistics.median(ts) * 1e6, 1), "p90_us": round(ts[int(0.9 * len(ts))] * 1e6, 1)}
        print(f"| {name} | {res[name]['median_us']} | {res[name]['p90_us']} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"requests": a.requests, "gap_ms": a.gap_ms, "cpus": os.cpu_count(),
                                           "results": res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
