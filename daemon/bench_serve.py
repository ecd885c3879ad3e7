"""`mleagle bench serve`: an online load generator against a running server (`bench_serve_main(argv)`).

It sends prompts from a dataset (`mt_bench`, `gsm8k`, `alpaca`, or any JSONL whose rows carry
`turns`; the first turn is the prompt) to `/v1/chat/completions` (or `/v1/completions`) with streaming
on, either at a Poisson request rate (`--rate`) or at a fixed concurrency (`--concurrency`), or both,
and measures per request the time to first token, the inter-token latencies (per streamed chunk, as
vLLM's benchmark does: with speculation one chunk can carry several tokens) and the end-to-end latency.
It prints a table of mean/p50/p90/p99 and throughput and writes the same as JSON (`--output`), with the
command line, the server's model, and the daemon's and engine's peak memory from `/debug/engine`.
Data comes from `--data-dir`, else `$MLEAGLE_DATA_DIR`, else `../shared/data` next to the repository.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from mleagle.daemon.loop_lag import LoopLag
from mleagle.daemon.loop_lag import summarize as lag_summary
from mleagle.engine.contract.config import data_dir
from mleagle.engine.contract.gc_watch import GcWatch
from mleagle.engine.contract.stats import iteration_summary

DATASETS = {"mt_bench": "mt_bench.jsonl", "gsm8k": "gsm8k_test.jsonl", "alpaca": "alpaca_eval.jsonl"}


def load_prompts(dataset: str, ddir: Path, n: int, seed: int) -> list[str]:
    path = Path(dataset) if dataset.endswith(".jsonl") else ddir / DATASETS.get(dataset, f"{dataset}.jsonl")
    if not path.is_file():
        raise FileNotFoundError(f"dataset {dataset!r}: no file {path} (set --data-dir or MLEAGLE_DATA_DIR)")
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            t = json.loads(line).get("turns") or []
            if t and isinstance(t[0], str) and t[0].strip():
                rows.append(t[0])
    if not rows:
        raise ValueError(f"{path}: no rows with a non-empty first turn")
    random.Random(seed).shuffle(rows)
    return [rows[i % len(rows)] for i in range(n)]


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunks: int = 0
    # time.monotonic() as the request was sent and as its first content arrived, and the response's id:
    # on the server's host these sit beside the daemon's own marks (`outside_split`)
    t_send: float = 0.0
    t_first: float = 0.0
    id: str = ""
    # time.monotonic() as the client's HTTP layer put the request on its connection (its body's write,
    # `_sent_trace`): splits `before_route` into the client's own part and the daemon's
    t_sent: float = 0.0


def request_body(args: argparse.Namespace, model: str, p: str) -> dict[str, Any]:
    """The JSON body sent for prompt `p` (also what `bench serve-matrix` maps to the offline replay's
    sampling parameters, so both paths run the same request)."""
    body: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": p}]
    else:
        body["prompt"] = p
    return body


async def one(s: aiohttp.ClientSession, args: argparse.Namespace, model: str, p: str) -> Result:
    chat = args.endpoint == "chat"
    body = request_body(args, model, p)
    url = args.url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    r = Result()
    t0 = time.perf_counter()
    r.t_send = time.monotonic()
    last = None
    try:
        async with s.post(url, json=body, trace_request_ctx=r) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return r
            async for line in resp.content:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    r.error = ev["error"].get("message", "error")
                    return r
                if ev.get("usage"):
                    r.prompt_tokens = ev["usage"]["prompt_tokens"]
                    r.output_tokens = ev["usage"]["completion_tokens"]
                for c in ev.get("choices", []):
                    piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    if piece:
                        now = time.perf_counter()
                        if last is None:
                            r.ttft = now - t0
                            r.t_first, r.id = time.monotonic(), ev.get("id", "")
                        else:
                            r.itl.append(now - last)
                        last = now
                        r.chunks += 1
        r.e2e = time.perf_counter() - t0
        r.ok = True
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        r.error = f"{type(e).__name__}: {e}"
    return r


def pct(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, round(p * (len(s) - 1)))]

    return {"mean": statistics.fmean(s) * 1e3, "p50": q(0.5) * 1e3, "p90": q(0.9) * 1e3, "p99": q(0.99) * 1e3}


async def _debug(s: aiohttp.ClientSession, url: str, phases_since: int = 1 << 62) -> dict[str, Any]:
    """The server's `/debug/engine` (empty where it is not there, e.g. another server), with the TTFT
    splits of the requests after the one numbered `phases_since` (by default none, only the count)."""
    try:
        async with s.get(url.rstrip("/") + f"/debug/engine?phases_since={phases_since}") as resp:
            return await resp.json() if resp.status == 200 else {}
    except (aiohttp.ClientError, ValueError):
        return {}


def _sent_trace() -> aiohttp.TraceConfig:
    """Marks each request's `Result.t_sent` as aiohttp writes its headers and again as it writes its
    body (the request's `trace_request_ctx`): the last mark is when the whole request left the client."""
    tc = aiohttp.TraceConfig()

    async def sent(_s: aiohttp.ClientSession, ctx: Any, _params: Any) -> None:
        if isinstance(r := ctx.trace_request_ctx, Result):
            r.t_sent = time.monotonic()

    tc.on_request_headers_sent.append(sent)
    tc.on_request_chunk_sent.append(sent)
    return tc


def session(args: argparse.Namespace) -> aiohttp.ClientSession:
    """The client's HTTP session: the API key, the run's timeout, no connection limit, the send marks."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=args.timeout),
                                 connector=aiohttp.TCPConnector(limit=0), trace_configs=[_sent_trace()])


async def run(args: argparse.Namespace) -> dict[str, Any]:
    prompts = load_prompts(args.dataset, data_dir(args.data_dir), args.num_prompts, args.seed)
    async with session(args) as s:
        async with s.get(args.url.rstrip("/") + "/v1/models") as resp:
            resp.raise_for_status()
            model = args.model or (await resp.json())["data"][0]["id"]
        sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None
        rng = random.Random(args.seed)

        async def task(p: str) -> Result:
            if sem is None:
                return await one(s, args, model, p)
            async with sem:
                return await one(s, args, model, p)

        # The server's counters are read just before the load starts (client processes already up) and
        # just after it ends: the engine loop's shares are over that window.
        before: dict[str, Any] = {}

        async def read_before() -> None:
            before["t"] = time.perf_counter()
            before["d"] = await _debug(s, args.url)

        loop = asyncio.get_running_loop()
        load0 = os.getloadavg()
        procs = 1 if args.rate is not None else min(args.client_procs, args.concurrency or 1, len(prompts) or 1)
        if procs > 1:
            def ready() -> None:
                asyncio.run_coroutine_threadsafe(read_before(), loop).result(timeout=60)

            results, dur, shares, gcs, lags = await asyncio.to_thread(_run_procs, args, model, prompts, procs, ready)
        else:
            await read_before()
            watch = GcWatch().install()
            lag = LoopLag().start()
            cpu_client0 = time.process_time()
            t0 = time.perf_counter()
            tasks = []
            for p in prompts:
                tasks.append(asyncio.create_task(task(p)))
                if args.rate and args.rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(args.rate))
            results = list(await asyncio.gather(*tasks))
            dur = time.perf_counter() - t0
            shares = [(time.process_time() - cpu_client0) / dur if dur > 0 else 0.0]
            watch.remove()
            await lag.stop()
            gcs, lags = [watch.snapshot()], [lag.lags]
        tw0, d0 = before["t"], before["d"]
        dm0 = d0.get("daemon", {})
        cpu0, seq0 = dm0.get("cpu_s"), (dm0.get("ttft_phases") or {}).get("seq")
        first_wave = args.concurrency or 0
        summ = summarize(results, dur, first_wave)
        steady_ids = {r.id for r in results[first_wave:] if r.ok and r.id}
        # Each client process is one asyncio loop parsing every SSE chunk: near a whole core, its own
        # queueing is in the TTFT and ITL it reports (the server's TTFT split is not). The busiest one.
        summ["client_procs"] = procs
        summ["client_cpu_share"] = max(shares)
        # A collection in a client process stalls every stream it reads: their frames wait in its socket
        # buffers, and the TTFT and ITL it reports grow by the pause (the server's split does not).
        summ["client_gc"] = {"collections": [sum(g["collections"][i] for g in gcs) for i in range(3)],
                             "pause_ms": [round(sum(g["pause_ms"][i] for g in gcs), 3) for i in range(3)],
                             "max_pause_ms": [max(g["max_pause_ms"][i] for g in gcs) for i in range(3)]}
        # How late each client loop ran a timer every 10 ms: a stopped loop's stall is in every TTFT and
        # ITL it measured then (`loop_lag`); a busy one is late by a millisecond or so.
        summ["client_loop_lag"] = lag_summary(lags)
        server: dict[str, Any] = {}
        d = await _debug(s, args.url, seq0 if seq0 is not None else 1 << 62)
        window = time.perf_counter() - tw0
        if d:
            dm = d.get("daemon", {})
            out_tok = summ["output_tokens"]
            # The daemon's CPU time over the run (its main loop does HTTP, tokenization, detokenization
            # and SSE for every stream): per output token, the serving path's own cost.
            cpu = dm["cpu_s"] - cpu0 if cpu0 is not None and dm.get("cpu_s") is not None else None
            server = {"daemon_max_rss_mb": dm.get("max_rss_mb"), "engine_max_rss_mb": d.get("engine_max_rss_mb"),
                      "daemon_torch_loaded": dm.get("torch_loaded"), "daemon_cpu_s": cpu,
                      "daemon_cpu_us_per_token": 1e6 * cpu / out_tok if cpu is not None and out_tok else None,
                      "daemon_cpu_share": cpu / dur if cpu is not None and dur > 0 else None,
                      # beside a GPU engine the daemon's loop spins while few requests run and after each
                      # ends (`server.spin_ms`): the passes that found nothing to do are polling, not work
                      "daemon_spin_idle_s": dm["spin_idle_s"] - dm0["spin_idle_s"]
                      if "spin_idle_s" in dm and "spin_idle_s" in dm0 else None,
                      # token deltas of later steps merged into an earlier step's because the daemon's
                      # loop was behind (read several steps at once): writes it did not have to make
                      "daemon_coalesced": dm["coalesced"] - dm0["coalesced"] if "coalesced" in dm and "coalesced" in dm0 else None,
                      "ttft_phases": phase_summary(dm.get("ttft_phases")),
                      # the same split over the requests sent after the opening burst
                      "ttft_phases_steady": phase_summary(dm.get("ttft_phases"), steady_ids),
                      "ttft_outside": outside_split(results, dm.get("ttft_phases"), first_wave),
                      "daemon_gc": gc_summary(dm0.get("gc"), dm.get("gc")),
                      "engine_loop": loop_summary((d0.get("stats") or {}).get("loop"), (d.get("stats") or {}).get("loop"),
                                                  window),
                      "engine_iterations": iteration_summary(d0.get("stats"), d.get("stats"), window),
                      "spec": spec_summary(d0.get("stats"), d.get("stats"))}
    return {
        "command": "mleagle bench serve " + " ".join(sys.argv[1:] if args.argv is None else args.argv),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        # The client's view of how busy the machine was (a shared CPU box skews every figure).
        "loadavg_1m_start_end": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
        "url": args.url, "model": model, "endpoint": args.endpoint, "dataset": args.dataset,
        "num_prompts": len(prompts), "rate": args.rate, "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "temperature": args.temperature,
        **summ,
        "server": server,
        "per_request": [asdict(r) | {"itl": None} for r in results] if args.per_request else None,
    }


def _tail_stats(xs: list[float], slow: list[float]) -> dict[str, float]:
    """Seconds `xs` as mean, p50 and p90 in ms, and the mean (ms) of `slow`, the same figure over the
    slowest tenth of the requests."""
    q = pct(xs)
    return {"mean_ms": q["mean"], "p50_ms": q["p50"], "p90_ms": q["p90"], "slowest_tenth_mean_ms": 1e3 * sum(slow) / len(slow)}


def _slowest_tenth(items: list[Any], key: Any) -> list[Any]:
    return sorted(items, key=key, reverse=True)[: max(1, -(-len(items) // 10))]


def gc_summary(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """The daemon's garbage collections over the run, per generation, and their total pause (ms); the
    longest pause is since the daemon started (a collection of the oldest generation, on the loop
    every stream shares, is a pause in every stream and in every arrival's route)."""
    if not before or not after:
        return None
    return {"collections": [a - b for a, b in zip(after["collections"], before["collections"])],
            "pause_ms": [round(a - b, 3) for a, b in zip(after["pause_ms"], before["pause_ms"])],
            "max_pause_ms_since_start": after["max_pause_ms"], "frozen": after.get("frozen")}


def loop_summary(before: dict[str, Any] | None, after: dict[str, Any] | None, dur: float) -> dict[str, Any] | None:
    """Where the engine process's main thread spent the run (its loop's counters, read through a fresh
    ping just before the load starts and just after it ends): steps taken, and per kind of work its
    share of `dur`, the wall time between the two reads (the run and the reads: dividing by the run's
    own time let a very short run read over 1). `step` is `engine.step()` (scheduling,
    the forwards, the host work around them; the telemetry hooks are inside it, `telemetry` says how
    much), `send_outputs` encoding and sending each step's outputs, `pump` the state events, `messages`
    the daemon's requests (answering its pings included: `pong` is that part), and inside `step` the time
    blocked on the device (`device_wait`: on a GPU, near `step` means the device is the limit, near 0
    the host is). What is left of 1.0 is
    the loop idle or polling: where the served figure falls short of the offline one with the loop near
    1.0, the engine process is the limit."""
    if not before or not after or dur <= 0:
        return None
    out: dict[str, Any] = {"steps": after.get("steps", 0) - before.get("steps", 0)}
    for k, v in after.items():
        if k.endswith("_s") and isinstance(v, (int, float)):
            out[k[:-2] + "_share"] = (v - before.get(k, 0.0)) / dur
    out["busy_share"] = sum(out.get(k + "_share", 0.0) for k in ("step", "send_outputs", "pump", "messages"))
    return out


def _minus(after: list[Any], before: list[Any]) -> list[Any]:
    """Counts per index over a run: `after` less `before` (shorter when the counter was new)."""
    return [x - (before[i] if i < len(before) else 0) for i, x in enumerate(after)]


def spec_summary(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the speculation ran over the run (a speculative server's counters before and after; None for
    target-only): its decode iterations, the share at each draft depth S' and their mean, the accept
    length of the verifies (1 + accepted drafts per verify, the bonus token counted), and the policy's
    own moves (switches, explorations, catch-ups and their time). Where `auto` lands below `always`,
    this says whether it drafted less or paid for switching."""
    pb, pa = (before or {}).get("spec_policy"), (after or {}).get("spec_policy")
    sb, sa = (before or {}).get("spec"), (after or {}).get("spec")
    if not pa or not pb or not sa or not sb:
        return None
    by_depth = _minus(pa.get("iterations_by_depth") or [], pb.get("iterations_by_depth") or [])
    its = sum(by_depth)
    verify = sa.get("num_verify", 0) - sb.get("num_verify", 0)
    acc = sa.get("num_accepted_tokens", 0) - sb.get("num_accepted_tokens", 0)
    out: dict[str, Any] = {
        "iterations": its,
        "depth_share": [round(x / its, 4) for x in by_depth] if its else None,
        "mean_depth": sum(d * x for d, x in enumerate(by_depth)) / its if its else None,
        "accept_len": 1 + acc / verify if verify else None,
    }
    for k in ("switches", "explore_iterations", "catch_ups", "catch_up_positions"):
        out[k] = pa.get(k, 0) - pb.get(k, 0)
    why0, why1 = pb.get("explore_by_reason") or {}, pa.get("explore_by_reason") or {}
    out["explore_by_reason"] = {k: v - why0.get(k, 0) for k, v in why1.items() if v != why0.get(k, 0)}
    out["catch_up_ms"] = 1e3 * (pa.get("catch_up_s", 0.0) - pb.get("catch_up_s", 0.0))
    out["fills"] = pa.get("fills", 0) - pb.get("fills", 0)
    out["fill_ms"] = 1e3 * (pa.get("fill_s", 0.0) - pb.get("fill_s", 0.0))
    calls = pa.get("choose_calls", 0) - pb.get("choose_calls", 0)  # the policy's own host time per choice
    out["choose_us"] = round(1e6 * (pa.get("choose_s", 0.0) - pb.get("choose_s", 0.0)) / calls, 2) if calls else None
    # What each depth really made: output tokens per request-iteration and per timed millisecond (the
    # iterations whose wall time the policy could measure): whether the depths `auto` chose paid.
    rows = _minus(pa.get("rows_by_depth") or [], pb.get("rows_by_depth") or [])
    made = _minus(pa.get("tokens_by_depth") or [], pb.get("tokens_by_depth") or [])
    secs = _minus(pa.get("seconds_by_depth") or [], pb.get("seconds_by_depth") or [])
    timed = _minus(pa.get("timed_by_depth") or [], pb.get("timed_by_depth") or [])
    out["by_depth"] = {str(d): {"rows": rows[d], "tokens_per_row": round(made[d] / rows[d], 4),
                                "ms_per_iteration": round(1e3 * secs[d] / timed[d], 4) if timed[d] else None}
                       for d in range(min(len(rows), len(made), len(secs), len(timed))) if rows[d]}
    # Which depth each size bucket ran in this run, and what the policy believed at its end: the costs
    # it timed per (bucket:depth), its acceptance rates and the charges for a catch-up and for the
    # draft layers' pass over arriving prompts. These say why `auto` chose what it did.
    b0, b1 = pb.get("iterations_by_bucket") or {}, pa.get("iterations_by_bucket") or {}
    out["iterations_by_bucket"] = {k: _minus(v, b0.get(k) or []) for k, v in b1.items() if v != b0.get(k)}
    out["beliefs"] = {k: pa[k] for k in ("cost_ms", "primed_ms", "served_discount", "acceptance", "acceptance_seen", "catch_up_cost_ms",
                                         "fill_cost_ms", "fills_per_token") if k in pa}
    return out


# `outside_split`'s parts, in a request's order: before the route (then that again in two, the client's
# send and what follows it), and after the write
OUTSIDE = ("before_route", "client_send", "to_route", "after_write")


def outside_split(results: list[Result], ph: dict[str, Any] | None, first_wave: int = 0) -> dict[str, Any] | None:
    """The part of each request's TTFT the server's split does not see, matched by response id: from
    the client sending it to the daemon's route beginning (`before_route`: the connection, the HTTP
    parser, the loop's queue before the handler) and from the daemon writing the first frame to the
    client reading its content (`after_write`: the socket, the client's own loop; the daemon marks
    just after its write, so a client that reads at once can come out a hair negative).
    `before_route` in two: `client_send`, from the client starting the request to its HTTP layer
    writing it (the body's JSON, the request's build, a connection from the pool: a busy client's
    own delay), and `to_route`, from that write to the route (the socket and the daemon's loop). One clock: the
    client and the server share a host (a remote server's marks are on another clock: then the
    figures are meaningless, and a loopback URL is what `serve-matrix` uses). Means, p50 and p90 in ms,
    and their means over the requests slowest by client TTFT; `steady` has the same figures over the
    requests sent after the first `first_wave` (a closed loop's opening burst queues its own intake)."""
    if not ph or not ph.get("recent"):
        return None
    n = len(ph["names"])
    marks = {r[1 + n]: (r[2 + n], r[3 + n]) for r in ph["recent"] if len(r) >= n + 4}
    def split(rs: list[Result]) -> dict[str, Any] | None:
        def parts(r: Result) -> dict[str, float]:
            route, written = marks[r.id]
            sent = r.t_sent or r.t_send  # (no trace mark: all of it counts as the daemon's side)
            return {"ttft": r.ttft, "before_route": route - r.t_send, "client_send": sent - r.t_send,
                    "to_route": route - sent, "after_write": r.t_first - written}

        got = [parts(r) for r in rs if r.ok and r.id and r.id in marks and r.t_send and r.t_first]
        if not got:
            return None
        slow = _slowest_tenth(got, key=lambda g: g["ttft"])
        out: dict[str, Any] = {"requests": len(got)}
        for k in OUTSIDE:
            out[k] = _tail_stats([g[k] for g in got], [g[k] for g in slow])
        return out

    out = split(results)
    if out is not None and first_wave:
        out["steady"] = split(results[first_wave:])
    return out


def phase_summary(ph: dict[str, Any] | None, ids: set[str] | None = None) -> dict[str, Any] | None:
    """The server's TTFT split (`/debug/engine`'s `ttft_phases`) over this run's requests (with `ids`,
    over the responses of those ids only): per phase its mean, p50 and p90 in ms, and its mean over
    the slowest tenth of the requests (by the split's total), which says what the tail of the TTFT is
    made of."""
    if not ph or not ph.get("recent"):
        return None
    names = ph["names"]
    recent = [r for r in ph["recent"] if ids is None or (len(r) > 1 + len(names) and r[1 + len(names)] in ids)]
    if not recent:
        return None
    # each record's phases, then their total (summarised like a phase, and what ranks the slowest)
    rows = [[*r[1:1 + len(names)], sum(r[1:1 + len(names)])] for r in recent]
    slow = _slowest_tenth(rows, key=lambda r: r[-1])
    return {"requests": len(rows),
            "phases": {n: _tail_stats([r[i] for r in rows], [r[i] for r in slow]) for i, n in enumerate([*names, "total"])}}


def _client_proc(args: argparse.Namespace, model: str, prompts: list[str], conc: int, barrier: Any,
                 out: Any) -> None:
    """One client process of `--client-procs`: a closed loop over its prompts at `conc`, started with
    the others at the barrier; puts (results, monotonic end, CPU seconds, its collections, its loop's
    timer lateness) on `out`."""

    async def go() -> tuple[list[Result], float, float, dict[str, Any], list[float]]:
        async with session(args) as s:
            sem = asyncio.Semaphore(conc)

            async def task(p: str) -> Result:
                async with sem:
                    return await one(s, args, model, p)

            await asyncio.to_thread(barrier.wait)  # every process ready: the parent reads the server's counters
            await asyncio.to_thread(barrier.wait)  # released together
            watch = GcWatch().install()
            lag = LoopLag().start()
            cpu0 = time.process_time()
            res = list(await asyncio.gather(*(task(p) for p in prompts)))
            end, cpu = time.monotonic(), time.process_time() - cpu0
            watch.remove()
            await lag.stop()
            return res, end, cpu, watch.snapshot(), lag.lags

    try:
        out.put(asyncio.run(go()))
    except BaseException as e:  # the parent must hear of it rather than wait for a result
        out.put(e)
        raise


def _run_procs(args: argparse.Namespace, model: str, prompts: list[str], procs: int,
               ready: Callable[[], None] | None = None
               ) -> tuple[list[Result], float, list[float], list[dict[str, Any]], list[list[float]]]:
    """The closed loop split over `procs` client processes (started, then released together; `ready`
    runs once all are up, just before the release): request
    j goes to process j mod procs, the concurrency is shared out as evenly as it divides. Returns the
    results with every process's first wave first (so `summarize`'s first wave is theirs together),
    the wall time from the release to the last finish, and each process's CPU share of a core, garbage
    collections and timer lateness (`LoopLag`)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # never fork a process that runs an event loop
    c = args.concurrency
    concs = [c // procs + (i < c % procs) for i in range(procs)]
    barrier, out = ctx.Barrier(procs + 1), ctx.Queue()
    kids = [ctx.Process(target=_client_proc, args=(args, model, prompts[i::procs], concs[i], barrier, out), daemon=True)
            for i in range(procs)]
    for k in kids:
        k.start()
    try:
        barrier.wait(timeout=120)
        if ready is not None:
            ready()
        barrier.wait(timeout=120)
        t0 = time.monotonic()
        got = [out.get(timeout=args.timeout + 60) for _ in kids]
    finally:
        for k in kids:
            k.join(timeout=10)
            if k.is_alive():
                k.kill()
    errs = [g for g in got if isinstance(g, BaseException)]
    if errs:
        raise RuntimeError(f"a client process failed: {errs[0]!r}")
    dur = max(g[1] for g in got) - t0
    firsts = [r for g, k in zip(got, concs) for r in g[0][:k]]
    rest = [r for g, k in zip(got, concs) for r in g[0][k:]]
    return (firsts + rest, dur, [g[2] / dur if dur > 0 else 0.0 for g in got], [g[3] for g in got],
            [g[4] for g in got])


def summarize(results: list[Result], dur: float, first_wave: int = 0) -> dict[str, Any]:
    """Counts, throughput and latency percentiles of one run's requests (in the order they were sent)
    over `dur` seconds (also used for `bench serve-matrix`'s offline replay, so both paths are measured
    by the same definitions). A closed loop sends its first `first_wave` requests (its concurrency) at
    once, a burst a steady load never has: with 4·c requests a run, that burst is a quarter of the TTFT
    samples, so `ttft_steady_ms` gives the TTFT of the requests sent after it too, and `loaded` the
    output rate without the run's closing drain."""
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    d = max(dur, 1e-9)  # an empty run (every request refused at once) has no duration to divide by
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": dur, "request_throughput": len(ok) / d,
        "output_throughput": out_tok / d, "total_token_throughput": (out_tok + in_tok) / d,
        "prompt_tokens": in_tok, "output_tokens": out_tok,
        "mean_tokens_per_chunk": out_tok / max(1, sum(r.chunks for r in ok)),
        "ttft_ms": pct([r.ttft for r in ok]), "ttft_steady_ms": pct([r.ttft for r in results[first_wave:] if r.ok]),
        "itl_ms": pct([x for r in ok for x in r.itl]),
        "e2e_ms": pct([r.e2e for r in ok]),
        "tpot_ms": pct([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "loaded": loaded(ok, first_wave),
    }


def loaded(ok: list[Result], conc: int) -> dict[str, float] | None:
    """Output tokens a second while a closed loop of `conc` had its load: from its first request sent
    to its last. After the last send a run only drains (requests end and none take their place): with
    4·c requests the last wave is a quarter of them, and its drain a tenth or more of the run's time,
    which a static batch of c equal requests (`Engine.generate`, `bench gpu`) never has. A request's
    tokens count at their chunks' arrival (each chunk taken as the request's tokens per chunk);
    `inflight` is the mean number of requests in flight over the window (c, less the client's turnaround
    between one request's end and the next one's send), which says the window was loaded. None for an
    open-loop or single-wave run, or records without send times."""
    ok = [r for r in ok if r.t_send and r.t_first]
    if conc < 1 or len(ok) <= conc:
        return None
    a, b = min(r.t_send for r in ok), max(r.t_send for r in ok)
    if b <= a:
        return None
    tokens = busy = 0.0
    for r in ok:
        n, t = 0, r.t_first
        if t <= b:
            n = 1
            for x in r.itl:
                t += x
                if t > b:
                    break
                n += 1
        tokens += n * r.output_tokens / max(1, r.chunks)
        busy += max(0.0, min(r.t_send + r.e2e, b) - max(r.t_send, a))
    return {"output_throughput": tokens / (b - a), "seconds": b - a, "inflight": busy / (b - a)}


def _gc_line(who: str, g: dict[str, Any], longest: str, max_ms: list[float]) -> str:
    """A report line of garbage collections: per generation, how many, the pause in all, the longest."""
    return (f"{who + ' GC (gen 0/1/2)':<28}{'/'.join(map(str, g['collections']))} collections, "
            f"{sum(g['pause_ms']):.1f} ms paused{longest} {'/'.join(f'{x:.1f}' for x in max_ms)} ms")


def table(res: dict[str, Any]) -> str:
    lines = [
        f"{'model':<28}{res['model']}",
        f"{'dataset / endpoint':<28}{res['dataset']} / {res['endpoint']}",
        f"{'load':<28}rate={res['rate'] or 'inf'} concurrency={res['concurrency'] or '-'} max_tokens={res['max_tokens']}"
        f" temperature={res['temperature']}",
        f"{'completed / failed':<28}{res['completed']} / {res['failed']}",
        f"{'load average (start/end)':<28}{res['loadavg_1m_start_end'][0]} / {res['loadavg_1m_start_end'][1]}",
        f"{'duration (s)':<28}{res['duration_s']:.2f}",
        f"{'requests/s':<28}{res['request_throughput']:.3f}",
        f"{'output tokens/s':<28}{res['output_throughput']:.2f}",
        *([f"{'  until the last send':<28}{ld['output_throughput']:.2f} ({ld['seconds']:.2f} s, {ld['inflight']:.1f} in flight)"]
          if (ld := res.get("loaded")) else []),
        f"{'total tokens/s':<28}{res['total_token_throughput']:.2f}",
        f"{'tokens per chunk':<28}{res['mean_tokens_per_chunk']:.2f}",
        f"{'client CPU (busiest proc)':<28}{100 * (res.get('client_cpu_share') or 0):.0f} % of one core"
        f" ({res.get('client_procs', 1)} client process{'es' * (res.get('client_procs', 1) != 1)})",
        f"{'':<28}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for k, name in (("ttft_ms", "TTFT (ms)"), ("ttft_steady_ms", "TTFT after the first wave"), ("itl_ms", "ITL (ms)"),
                    ("tpot_ms", "TPOT (ms)"), ("e2e_ms", "E2E (ms)")):
        v = res[k]
        lines.append(f"{name:<28}{v['mean']:>10.1f}{v['p50']:>10.1f}{v['p90']:>10.1f}{v['p99']:>10.1f}")
    g = res.get("client_gc")
    if g:
        lines.append(_gc_line("client", g, " (all processes); longest", g["max_pause_ms"]))
    lag = res.get("client_loop_lag")
    if lag:
        lines.append(f"{'client loop late (timers)':<28}p50 {lag['p50_ms']:.2f} p99 {lag['p99_ms']:.2f} max {lag['max_ms']:.1f} ms;"
                     f" {lag['stalls']} stalls of 5 ms or more, {lag['stalled_ms']:.0f} ms in all")
    srv = res.get("server") or {}
    if srv:
        lines.append(f"{'peak RSS daemon/engine (MB)':<28}{srv.get('daemon_max_rss_mb') or 0:.0f} / "
                     f"{srv.get('engine_max_rss_mb') or 0:.0f}")
        if srv.get("daemon_cpu_us_per_token") is not None:
            co = srv.get("daemon_coalesced")
            idle = srv.get("daemon_spin_idle_s")
            spun = f", {100 * idle / srv['daemon_cpu_s']:.0f} % of it polling in its spin" if idle and srv.get("daemon_cpu_s") else ""
            lines.append(f"{'daemon CPU per token (us)':<28}{srv['daemon_cpu_us_per_token']:.1f}"
                         f" ({100 * srv['daemon_cpu_share']:.0f} % of one core{spun}"
                         + (f"; {co} token deltas coalesced)" if co is not None else ")"))
        g = srv.get("daemon_gc")
        if g:
            lines.append(_gc_line("daemon", g, "; longest since start", g["max_pause_ms_since_start"]))
        lp = srv.get("engine_loop")
        if lp:
            parts = ", ".join(f"{k} {100 * lp.get(k + '_share', 0.0):.0f} %" for k in ("step", "send_outputs", "pump", "messages"))
            parts += f"; of the steps, waiting for the device {100 * lp.get('device_wait_share', 0.0):.0f} %"
            lines.append(f"{'engine loop busy':<28}{100 * lp['busy_share']:.0f} % of the run ({parts}; {lp['steps']} steps)")
        ei = srv.get("engine_iterations")
        if ei and ei["iterations"]:
            dev = (f"; the device busy {100 * ei['device_busy_share']:.0f} % of the run, {ei['device_us_per_iteration']:.0f} us "
                   f"an iteration" if "device_busy_share" in ei else "")
            lines.append(f"{'engine iterations':<28}{ei['iterations_per_s']:.0f} a second, {ei['rows_per_iteration']:.2f} "
                         f"decoding requests each{dev}")
        sp = srv.get("spec")
        if sp and sp["iterations"]:
            mix = " ".join(f"{d}:{100 * x:.0f}%" for d, x in enumerate(sp["depth_share"]) if x)
            acc = f", accept length {sp['accept_len']:.2f}" if sp["accept_len"] else ""
            lines.append(f"{'speculation':<28}{sp['iterations']} iterations by depth {mix}, mean depth "
                         f"{sp['mean_depth']:.2f}{acc}; {sp['switches']} switches, {sp['explore_iterations']} "
                         f"explored, {sp['catch_ups']} catch-ups ({sp['catch_up_ms']:.1f} ms)")
            made = "; ".join(f"depth {d}: {v['tokens_per_row']:.2f} tokens a request-iteration"
                             + (f", {v['ms_per_iteration']:.3f} ms an iteration" if v["ms_per_iteration"] else "")
                             for d, v in (sp.get("by_depth") or {}).items())
            if made:
                lines.append(f"{'  made by depth':<28}{made}")
            if sp.get("explore_by_reason"):
                lines.append(f"{'  explored for':<28}" + "; ".join(f"{k}: {v}" for k, v in sp["explore_by_reason"].items()))
        ph = srv.get("ttft_phases")
        if ph:
            lines.append(f"TTFT split in the server, ms ({ph['requests']} requests){'mean':>10}{'p50':>10}{'p90':>10}"
                         f"{'slow 10%':>10}")
            def row(n: str, v: dict[str, float]) -> str:
                return f"  {n:<26}{v['mean_ms']:>10.2f}{v['p50_ms']:>10.2f}{v['p90_ms']:>10.2f}{v['slowest_tenth_mean_ms']:>10.2f}"

            lines += [row(n, v) for n, v in ph["phases"].items()]
            out = srv.get("ttft_outside")
            if out:
                lines.append(f"TTFT outside the split, ms ({out['requests']} requests; slow 10%: by client TTFT)")
                lines += [row(n, out[n]) for n in OUTSIDE if n in out]
            st, st_out = srv.get("ttft_phases_steady"), (out or {}).get("steady")
            if st:
                lines.append(f"after the first wave, ms ({st['requests']} requests)")
                lines += [row(n, v) for n, v in st["phases"].items()]
                if st_out:
                    lines += [row(n, st_out[n]) for n in OUTSIDE if n in st_out]
    if res["errors"]:
        lines.append(f"{'errors':<28}{res['errors']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mleagle bench serve", description="Online benchmark against a running server.")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=os.environ.get("MLEAGLE_API_KEY"))
    ap.add_argument("--model", default=None, help="model name to send (default: the server's)")
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    ap.add_argument("--dataset", default="mt_bench", help="mt_bench | gsm8k | alpaca | path.jsonl")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--rate", type=float, default=None, help="requests/s, Poisson arrivals (default: all at once)")
    ap.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client-procs", type=int, default=1,
                    help="split a closed loop (--concurrency) over this many client processes, so that the load "
                         "generator's own loop is not what a high concurrency measures")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    ap.add_argument("--per-request", action="store_true", help="include per-request figures in the JSON")
    return ap


def bench_serve_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.rate is None and args.concurrency is None:
        args.concurrency = 8
    if args.client_procs < 1 or (args.client_procs > 1 and args.rate is not None):
        print("mleagle bench serve: --client-procs must be >= 1, and above 1 only for a closed loop "
              "(--concurrency without --rate)", file=sys.stderr)
        return 2
    try:
        res = asyncio.run(run(args))
    except (OSError, ValueError, aiohttp.ClientError) as e:
        print(f"mleagle bench serve: {e}", file=sys.stderr)
        return 1
    print(table(res))
    if args.output:
        Path(args.output).write_text(json.dumps(res, indent=1))
        print(f"wrote {args.output}")
    return 0 if res["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(bench_serve_main())
