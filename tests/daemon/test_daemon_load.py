"""The daemon under concurrency: 64 simultaneous streams each equal to the non-streamed greedy answer
(nothing lost, nothing duplicated), many clients that vanish mid-stream or mid-request, and every
pool of every runner free afterwards; a queue limit that answers 429 with Retry-After."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from tests.daemon_helpers import ServerProc, sse_events

N = 64
MT = 6


@pytest.fixture(scope="module")
def srv():
    # A random 2-layer draft at full depth every iteration (`auto` would stop drafting a draft that never
    # pays): output stays exactly greedy, and three runners' pools must all come back free.
    s = ServerProc("--config", "smollm2-135m", "--max-total-tokens", "16384", "--max-running-requests", "64",
                   "--max-queued-requests", "64", "--draft", "random:2", "--spec-policy", "always", "--threads", "1")
    s.wait_healthy(60)
    yield s
    assert s.terminate() == 0, s.log()


def prompt(i: int) -> str:
    return f"{i} plus {i % 7} is"  # short prompts: prefill of 64 requests is most of the CPU time


async def full(s: aiohttp.ClientSession, url: str, i: int) -> dict:
    body = {"prompt": prompt(i), "max_tokens": MT, "temperature": 0}
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def streamed(s: aiohttp.ClientSession, url: str, i: int) -> tuple[str, list[str | None], int, int]:
    body = {"prompt": prompt(i), "max_tokens": MT, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "spec_stats": True}
    text, finishes, done, usage = "", [], 0, -1
    spec = None
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for ch in sse_events(r.content):
            if ch is None:
                done += 1
                continue
            assert done == 0, "data after [DONE]"
            for c in ch["choices"]:
                text += c["text"]
                if c["finish_reason"]:
                    finishes.append(c["finish_reason"])
                    spec = c["spec_stats"]
            if ch.get("usage"):
                usage = ch["usage"]["completion_tokens"]
    assert spec is not None and len(spec["accepted_per_depth"]) == 2 and spec["num_verify"] > 0
    return text, finishes, done, usage


async def test_64_concurrent_streams_equal_greedy(srv):
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        ref = await asyncio.gather(*(full(s, srv.url, i) for i in range(N)))
        got = await asyncio.gather(*(streamed(s, srv.url, i) for i in range(N)))
    for i, (r, (text, finishes, done, usage)) in enumerate(zip(ref, got)):
        want = r["choices"][0]["text"]
        assert text == want, (i, text, want)
        assert finishes == [r["choices"][0]["finish_reason"]] and done == 1
        assert usage == r["usage"]["completion_tokens"]
    d = srv.wait_pools_free()
    assert {p["runner"] for p in d["pool_usage"]} == {"target", "draft0", "draft1"}


async def test_random_disconnects_free_every_slot(srv):
    rng = random.Random(0)

    async def leave_stream(s: aiohttp.ClientSession, i: int) -> None:
        body = {"prompt": prompt(i), "max_tokens": 64, "temperature": 0, "stream": True, "ignore_eos": True}
        stop_after = rng.randrange(0, 6)
        async with s.post(srv.url + "/v1/completions", json=body) as r:
            n = 0
            async for line in r.content:
                if line.startswith(b"data: "):
                    n += 1
                    if n > stop_after:
                        break  # leaving the block closes the connection mid-stream
            r.close()

    async def leave_request(s: aiohttp.ClientSession, i: int) -> None:
        body = {"prompt": prompt(i), "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        try:
            await asyncio.wait_for(s.post(srv.url + "/v1/completions", json=body), rng.uniform(0.2, 3.0))
        except asyncio.TimeoutError:
            pass

    # force_close: every request on its own connection, so closing one really disconnects that client.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as s:
        jobs = [leave_stream(s, i) if i % 3 else leave_request(s, i) for i in range(30)]
        await asyncio.gather(*jobs)
    d = srv.wait_pools_free(timeout=60)
    assert d["inflight"] == 0 and d["active_http"] == 0
    async with aiohttp.ClientSession() as s:
        r = await full(s, srv.url, 1)
        assert r["choices"][0]["finish_reason"] in ("length", "stop")
    _st, m = srv.get("/metrics")
    assert 'mleagle:kv_pool_used_tokens{runner="target"} 0.0' in m
