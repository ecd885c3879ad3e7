"""How long a bare aiohttp server takes from a client's request headers to its route, while it streams.

`python scripts/intake_latency.py [--concurrency 32] [--requests 128]`: starts an aiohttp app in a
process of its own (one POST route that reads the JSON body, then streams 64 SSE frames 2 ms apart:
a stream's shape at ~500 tokens a second), runs a closed loop of aiohttp clients against it, and
prints, per request, the time from the client sending to the route beginning and from the client's
request headers leaving (aiohttp's `on_request_headers_sent` trace) to the route beginning
(`time.monotonic()`, one clock on one host). Nothing of mleagle runs: this is the floor under the
`before_route` part of `bench serve`'s TTFT (the daemon adds its own per-token work to the same loop).
On the 2-core dev VM at 32 streams: headers to route 1.9-2.7 ms mean, 3.4-4.7 ms p90; at 4 streams
0.9-1.1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from typing import Any

import aiohttp
from aiohttp import web

PORT = 18499


def serve(port: int, ready: Any) -> None:
    marks: dict[str, float] = {}

    async def stream(request: web.Request) -> web.StreamResponse:
        t = time.monotonic()
        body = await request.json()
        marks[str(body["i"])] = t
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await asyncio.sleep(0.002)
        await resp.prepare(request)
        for _ in range(64):
            await resp.write(b'data: {"content": "x"}\n\n')
            await asyncio.sleep(0.002)
        await resp.write_eof()
        return resp

    async def get_marks(request: web.Request) -> web.Response:
        return web.json_response(marks)

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/x", stream)
        app.router.add_get("/marks", get_marks)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


async def client(port: int, conc: int, n: int) -> dict[str, Any]:
    sent: dict[int, tuple[float, float]] = {}
    tc = aiohttp.TraceConfig()

    async def headers_sent(s: Any, ctx: Any, p: Any) -> None:
        ctx.trace_request_ctx["headers"] = time.monotonic()

    tc.on_request_headers_sent.append(headers_sent)
    sem = asyncio.Semaphore(conc)
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession(trace_configs=[tc], connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one(i: int) -> None:
            async with sem:
                ctx: dict[str, float] = {}
                t = time.monotonic()
                async with s.post(url + "/x", json={"i": i}, trace_request_ctx=ctx) as r:
                    async for _ in r.content:
                        pass
                sent[i] = (t, ctx["headers"])

        await asyncio.gather(*(one(i) for i in range(n)))
        async with s.get(url + "/marks", trace_request_ctx={}) as r:
            route = {int(k): v for k, v in (await r.json()).items()}

    def summary(xs: list[float]) -> dict[str, float]:
        s = sorted(xs)
        return {"mean_ms": statistics.fmean(s), "p50_ms": s[len(s) // 2], "p90_ms": s[int(0.9 * (len(s) - 1))]}

    return {"concurrency": conc, "requests": n,
            "send_to_route": summary([1e3 * (route[i] - a) for i, (a, _) in sent.items()]),
            "headers_to_route": summary([1e3 * (route[i] - h) for i, (_, h) in sent.items()])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--port", type=int, default=PORT)
    a = ap.parse_args()
    ready = mp.get_context("spawn").Event()
    p = mp.get_context("spawn").Process(target=serve, args=(a.port, ready), daemon=True)
    p.start()
    try:
        if not ready.wait(30):
            raise SystemExit("the server did not start")
        res = asyncio.run(client(a.port, a.concurrency, a.requests))
    finally:
        p.terminate()
        p.join(5)
    for k in ("send_to_route", "headers_to_route"):
        v = res[k]
        print(f"c{a.concurrency} {k:<18} mean {v['mean_ms']:.2f}  p50 {v['p50_ms']:.2f}  p90 {v['p90_ms']:.2f} ms")


if __name__ == "__main__":
    main()
