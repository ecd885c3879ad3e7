"""What an engine step costs the host beside the model: `Engine.generate` on the CPU with a model small
enough that its forward is not everything. From the repository root:
`python scripts/engine_host_step.py [--config tiny-dummy] [--batch-sizes 32,64] [--repeats 5] [--set FIELD=VALUE]
[--emulate-graphs] [--overlap] [--output F.json]`.

Each repeat is one `Engine.generate` over a static batch of random prompts (30-90 tokens) whose
`max_new_tokens` are drawn from 64-256, so requests finish on different steps as served answers do.
Every decode step is split into the model's forwards (a runner's forward, replayed or eager, and a
whole-iteration replay, timed by wrapping them: `time_forwards`) and the rest: scheduling, KV page
bookkeeping, sampling-row flags, the results' unpacking, the per-request deltas. On a GPU the forward is a graph replay and this rest is most of what a served step
costs the host (the engine loop there is busy 97-99 % at 32-64 requests). Beside it, the step's deltas
are put into the engine's per-step message (`Outputs.of` and `encode`, what the serving loop sends),
timed apart, and with `--events` the state events the engine process attaches (its telemetry hooks
and the pump that publishes them, sampled as `mleagle serve` starts them, no subscriber) are taken
out of the host figure and timed apart too. Then 100 arrivals of 60 tokens at an idle engine, one at
a time: the host time of each one's prefill step beside its forward (a served first token's engine
part), and that step in its parts (`PREFILL_PARTS`: scheduling with the KV pages, the input (the
slot-state rows and the batch, or on a prefill graph both staged in one copy), the forward, the first token's sampling, the wait for its copy, the rest), with the
prefix cache empty at the start of each repeat, or with `--cache full` full of other prompts so that
every arrival evicts (a server that has run a while; `--pool-tokens` sets the pool's size). Then what
an arrival costs a running batch of the largest size less one (`arrivals`: phases with and without an
arrival every 4 decode iterations, alternating; on a GPU the arrival rides in a mixed step, so this is
its whole cost to the requests decoding, host and device). Last, the
per-request host functions of a steady decode step at the largest batch, each in a hot loop
(`bookkeeping`). Prints a table (median and range over the repeats) and writes JSON. `--device cuda` runs the same on a GPU
(with its CUDA graphs): there a forward is a graph launch and the rest of a step includes waiting for
the device, so the decode split reads differently, but the lone arrival's parts are what a first
token's `prefill` phase is made of on that machine.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def one(e: Any, bs: int, seed: int, acc: list[float], pump: Any = None) -> dict[str, float]:
    from mleagle.engine.contract.protocol import Outputs, encode
    from mleagle.engine.contract.sampling_params import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(1, e.arch.vocab_size) for _ in range(rng.randrange(30, 91))] for _ in range(bs)]
    params = [SamplingParams(max_new_tokens=rng.randrange(64, 257), temperature=0.0, ignore_eos=True) for _ in range(bs)]
    step, n, host, fwd, msg, rows, events = e.step, [0], [0.0], [0.0], [0.0], [0], [0.0]

    def timed() -> list[Any]:
        acc[0] = 0.0
        tel0 = pump.telemetry.spent_s if pump is not None else 0.0
        t0 = time.perf_counter()
        outs = step()
        t1 = time.perf_counter()
        if outs:
            encode(Outputs.of(outs))
        t2 = time.perf_counter()
        if pump is not None:  # the serving loop's state events: the step's telemetry hooks, then the pump
            pump.pump()
        t3 = time.perf_counter()
        if e.last_report.mode == "DECODE":
            tel = pump.telemetry.spent_s - tel0 if pump is not None else 0.0
            n[0] += 1
            rows[0] += len(e.scheduler.running) or len(outs)
            host[0] += t1 - t0 - acc[0] - tel
            fwd[0] += acc[0]
            msg[0] += t2 - t1
            events[0] += tel + t3 - t2
        return outs

    e.step = timed
    try:
        t = time.perf_counter()
        e.generate(prompts, params)
        wall = time.perf_counter() - t
    finally:
        del e.step
    k = max(n[0], 1)
    return {"decode_steps": n[0], "mean_rows": rows[0] / k, "wall_s": wall,
            "host_us": host[0] / k * 1e6, "forward_us": fwd[0] / k * 1e6, "message_us": msg[0] / k * 1e6,
            "events_us": events[0] / k * 1e6,
            "host_us_per_row": host[0] / max(rows[0], 1) * 1e6}


# The parts of a lone arrival's prefill step, in the order it runs them: (name, class path, method,
# whether it is top-level; `kv pages` is inside `schedule`; `admit` and `build batch` inside `input`, the
# admission and the batch, which a prefill graph takes staged instead, neither called). Beside them the forward is the model
# runner's (on a GPU the launch of its graph); `first token` is its sampling and the copy back started;
# `settle` waits for that copy (on a GPU, for the device); `rest` is the step less the forward and the
# top-level parts (scheduling bookkeeping, the deltas).
PREFILL_PARTS = [
    ("schedule", "mleagle.engine.core.scheduler:Scheduler", "_schedule_prefill", True),
    ("kv pages", "mleagle.engine.memory.manager:MemoryManager", "ensure", False),
    ("input", "mleagle.engine.executor.worker:TargetWorker", "prefill_input", True),
    ("admit", "mleagle.engine.executor.worker:TargetWorker", "admit", False),
    ("build batch", "mleagle.engine.executor.worker:TargetWorker", "prefill_batch", False),
    ("first token", "mleagle.engine.executor.worker:TargetWorker", "finish_prefill", True),
    ("settle", "mleagle.engine.executor.worker:TargetWorker", "settle_prefill", True),
]


@contextlib.contextmanager
def wrapped(parts: list[tuple[str, str, str, bool]], before: Any, after: Any) -> Iterator[None]:
    """Each part's method wrapped while this lasts: `before(name)` as it is entered, `after(name)` as it
    returns (or raises)."""
    undo = []
    for name, where, meth, _ in parts:
        mod, cls = where.split(":")
        klass = getattr(importlib.import_module(mod), cls)
        f = klass.__dict__[meth]

        def w(*args: Any, _f: Any = f, _name: str = name, **kw: Any) -> Any:
            before(_name)
            try:
                return _f(*args, **kw)
            finally:
                after(_name)

        setattr(klass, meth, w)
        undo.append((klass, meth, f))
    try:
        yield
    finally:
        for klass, meth, f in undo:
            setattr(klass, meth, f)


def count_ops(e: Any) -> dict[str, dict[str, int]]:
    """The torch operations one 60-token arrival's prefill step dispatches, by part (inclusive: `kv
    pages` is inside `schedule`) and the forward: `kernels` (every operation that computes or copies;
    on a GPU each is a launch or a copy the host pays for) and `views` (host-only: no launch), and
    `host tensors` (built from Python values or numpy arrays: on a GPU each one the step uses goes
    over in a host-to-device copy, a `kernels` entry there but not on the CPU). Counted on the CPU, it
    moves only when the code does."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from mleagle.engine.contract.sampling_params import SamplingParams

    names = PREFILL_PARTS + [("forward", "mleagle.engine.executor.runner:ModelRunner", "forward", True)]
    counts = {name: {"kernels": 0, "views": 0, "host tensors": 0} for name, *_ in names} | {
        "step": {"kernels": 0, "views": 0, "host tensors": 0}}
    inside: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kind = "host tensors" if func.overloadpacket.__name__ == "lift_fresh" else "views" if func.is_view else "kernels"
            for name in {*inside, "step"}:
                counts[name][kind] += 1
            return func(*args, **(kwargs or {}))

    rng = random.Random(11)
    e.add_request("count-ops", [rng.randrange(1, e.arch.vocab_size) for _ in range(60)],
                  SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    from_numpy = torch.from_numpy

    def counted_from_numpy(a: Any) -> Any:  # not a dispatched operation, but a host tensor as `lift_fresh` is
        for name in {*inside, "step"}:
            counts[name]["host tensors"] += 1
        return from_numpy(a)

    torch.from_numpy = counted_from_numpy  # type: ignore[assignment]
    try:
        with wrapped(names, inside.append, lambda _name: inside.pop()), Count():
            e.step()
    finally:
        torch.from_numpy = from_numpy  # type: ignore[assignment]
    while e.has_work():
        e.step()
    top = [name for name, _, _, is_top in names if is_top]
    counts["rest"] = {k: counts["step"][k] - sum(counts[name][k] for name in top) for k in counts["step"]}
    return counts


def fill_cache(e: Any, rng: random.Random) -> int:
    """Fill the KV pool with cached prompts (distinct, 60 tokens, each ending at its first token) until
    the next such arrival must evict: the state of a server that has run for a while. Returns the
    cache's node count."""
    from mleagle.engine.contract.sampling_params import SamplingParams

    p = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    i = 0
    while (u := e.pool_usage()[0])["kv_total"] - u["kv_cached"] >= 2 * 61:
        e.add_request(f"fill-{i}", [rng.randrange(1, e.arch.vocab_size) for _ in range(60)], p)
        while e.has_work():
            e.step()
        i += 1
    return sum(1 for _ in e.mem.cache.nodes())  # (counted, not `num_nodes`: older trees are measured too)


def bookkeeping(e: Any, bs: int, n: int = 2000) -> dict[str, float]:
    """The host functions a steady decode step runs over every running request, each timed in a hot loop
    with `bs` requests decoding (microseconds a call): the KV check before a launch (`_decode_ready`),
    the unpacking of one-token results (`unpack`), the scan for requests still in prefill, the step's
    message to the daemon (`Outputs.of` + `encode`) and the record of a whole-iteration replay's
    forwards (`replay_forwards`). Hot loops read lower than a served step's cold pass: they rank code,
    not machines."""
    import timeit

    import torch

    from mleagle.engine.contract.outputs import TokenOutput
    from mleagle.engine.contract.protocol import Outputs, encode
    from mleagle.engine.contract.sampling_params import SamplingParams
    from mleagle.engine.executor.results import Pending, unpack
    from mleagle.engine.sampling.processor import RowFlags

    rng = random.Random(7)
    for i in range(bs):
        e.add_request(f"bk{i}", [rng.randrange(1, e.arch.vocab_size) for _ in range(60)],
                      SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True))
    s = e.scheduler
    while s.waiting or any(r.prefilling for r in s.running):
        e.step()
    reqs = list(s.running)
    packed = torch.tensor([[float(rng.randrange(1000)), 1.0] for _ in reqs], dtype=torch.float64)
    p = Pending(reqs, 1, RowFlags(), packed, None, None, [r.epoch for r in reqs], [])
    outs = [TokenOutput(r.rid, [5], len(r.prompt_ids), 1, 0) for r in reqs]
    fns: dict[str, Any] = {
        "decode ready": lambda: s._decode_ready(e.worker.lookahead),
        "unpack": lambda: unpack(p),
        "prefilling scan": lambda: [r for r in reqs if not r.prefilling],
        "message": lambda: encode(Outputs.of(outs)),
        "replay forwards": lambda: e.worker.replay_forwards(reqs, len(reqs)),
    }
    got = {k: timeit.timeit(f, number=n) / n * 1e6 for k, f in fns.items()}
    for r in reqs:
        e.abort(r.rid)
    while e.has_work():
        e.step()
    return got


ARRIVAL_REPS = 3  # `arrivals`' timed alternations (a phase without arrivals, then one with)


def time_forwards(acc: list[float]) -> None:
    """Add to `acc[0]` the seconds of every model forward: a runner's graph replay or eager forward, and
    a whole-iteration replay (emulated on a CPU, all of it is what a GPU runs as one graph), the
    outermost only where one runs inside another."""
    from mleagle.engine.executor.iteration_graph import IterationGraph
    from mleagle.engine.executor.runner import ModelRunner

    depth = [0]

    def timed(f: Any) -> Any:
        def g(self: Any, *args: Any, **kw: Any) -> Any:
            depth[0] += 1
            t = time.perf_counter()
            try:
                return f(self, *args, **kw)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    acc[0] += time.perf_counter() - t
        return g

    for cls, name in ((ModelRunner, "forward"), (ModelRunner, "forward_eager"), (IterationGraph, "run")):
        setattr(cls, name, timed(getattr(cls, name)))


ARRIVAL_KEYS = ("iteration_us", "arrival_us", "iteration_host_us", "arrival_host_us")


def arrival_tokens(n: int, every: int = 4) -> int:
    """New tokens a running request of `arrivals` may take: its warm-up phase and `ARRIVAL_REPS` pairs
    of phases, each `every * n` iterations, and a margin (an iteration in flight is one more)."""
    return (1 + 2 * ARRIVAL_REPS) * every * n + 16


def arrivals(e: Any, bs: int, n: int, seed: int, acc: list[float], every: int = 4) -> dict[str, float]:
    """What one arrival costs a running batch: `bs - 1` requests decode while, in alternating phases of
    `every * n` decode iterations each, either nothing arrives or a 60-token request (ending at its
    first token, so the batch keeps its size) arrives before every `every`-th iteration. The difference
    of the two phases' wall times over `n` is an arrival's marginal cost to the batch, host and device
    together: on a GPU (overlap scheduling) its prefill rides in a mixed step beside the iteration in
    flight; on the CPU it is a prefill step of its own that the decoding requests wait behind. Phases
    count iterations, not steps, so both make the same progress. Each arrival of a served closed loop
    costs every running request this (c32 takes ~90 arrivals a second on an H200). Medians over
    `ARRIVAL_REPS` alternations, microseconds; `arrival_host_us` the same difference with the model
    runners' forwards (`acc`) left out: on a CPU engine scheduled as a GPU one (`--overlap
    --emulate-graphs`), what an arrival costs the host alone, the part a GPU cannot hide when the host
    is behind."""
    from mleagle.engine.contract.sampling_params import SamplingParams

    rng = random.Random(seed)
    iters = every * n
    long = SamplingParams(max_new_tokens=min(e.max_context_len - 61 - e.worker.lookahead, arrival_tokens(n, every)),
                          temperature=0.0, ignore_eos=True)
    one_tok = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(bs - 1):
        e.add_request(f"arr-run-{seed}-{i}", [rng.randrange(1, e.arch.vocab_size) for _ in range(60)], long)
    s = e.scheduler
    while s.waiting or any(r.prefilling for r in s.running):
        e.step()
    k = 0

    def phase(arrive: bool) -> tuple[float, float]:
        """The phase's wall and its host part (the wall less the forwards), seconds."""
        nonlocal k
        done, due = 0, 0
        acc[0] = 0.0
        t0 = time.perf_counter()
        while done < iters:
            if arrive and done >= due:
                e.add_request(f"arr-{seed}-{k}", [rng.randrange(1, e.arch.vocab_size) for _ in range(60)], one_tok)
                k, due = k + 1, due + every
            e.step()
            done += e.last_report.mode in ("DECODE", "MIXED")
        wall = time.perf_counter() - t0
        return wall, wall - acc[0]

    phase(True)  # every shape met once
    fused0 = e.stats()["fused_mixed_steps"]
    plain, mixed = [], []
    for _ in range(ARRIVAL_REPS):
        plain.append(phase(False))
        mixed.append(phase(True))
    if len(s.running) < bs - 1:
        raise RuntimeError(f"the batch shrank to {len(s.running)} rows before the phases ended: lower --arrivals")
    for r in list(s.running) + list(s.waiting):
        e.abort(r.rid)
    while e.has_work():
        e.step()
    p, m = statistics.median(w for w, _ in plain), statistics.median(w for w, _ in mixed)
    ph, mh = statistics.median(h for _, h in plain), statistics.median(h for _, h in mixed)
    return {"rows": bs - 1, "every": every, "iteration_us": p / iters * 1e6, "arrival_us": (m - p) / n * 1e6,
            "iteration_host_us": ph / iters * 1e6, "arrival_host_us": (mh - ph) / n * 1e6, "arrivals": k,
            # the timed arrivals that rode in a fused mixed step (overlap scheduling, target-only)
            "fused_steps": e.stats()["fused_mixed_steps"] - fused0}


def prefill_one(e: Any, n: int, acc: list[float], cache: str = "empty", seed: int = 7) -> dict[str, Any]:
    """`n` arrivals at an idle engine, one at a time (a request of 60 tokens that ends at its first
    token): each one's prefill step, host and forward, as a served request's first token pays them,
    and the step's parts (`PREFILL_PARTS`, each method wrapped while this runs), medians in us. The
    prefix cache starts empty (`cache` "empty"), or full of other prompts so that every arrival evicts
    ("full")."""
    from mleagle.engine.contract.sampling_params import SamplingParams

    rng = random.Random(seed)
    p = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    e.reset_prefix_cache()
    nodes = fill_cache(e, rng) if cache == "full" else 0
    spent: dict[str, float] = {}
    began: list[float] = []

    def start(_name: str) -> None:
        began.append(time.perf_counter())

    def stop(name: str) -> None:
        spent[name] = spent.get(name, 0.0) + time.perf_counter() - began.pop()

    host, fwd, step = [], [], []
    parts: dict[str, list[float]] = {name: [] for name, *_ in PREFILL_PARTS} | {"rest": []}
    with wrapped(PREFILL_PARTS, start, stop):
        for i in range(n):
            e.add_request(f"prefill-{i}", [rng.randrange(1, e.arch.vocab_size) for _ in range(60)], p)
            acc[0] = 0.0
            spent.clear()
            t0 = time.perf_counter()
            e.step()
            dt = time.perf_counter() - t0
            got = dict(spent)
            while e.has_work():
                e.step()
            host.append((dt - acc[0]) * 1e6)
            fwd.append(acc[0] * 1e6)
            step.append(dt * 1e6)
            for name, *_ in PREFILL_PARTS:
                parts[name].append(got.get(name, 0.0) * 1e6)
            top = sum(got.get(name, 0.0) for name, _, _, is_top in PREFILL_PARTS if is_top)
            parts["rest"].append((dt - acc[0] - top) * 1e6)
    return {"host_us": statistics.median(host), "forward_us": statistics.median(fwd), "step_us": statistics.median(step),
            "parts_us": {k: statistics.median(v) for k, v in parts.items()}, "cached_nodes": nodes,
            "evicted_tokens": e.prefix_cache_stats()["evicted_tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny-dummy")
    ap.add_argument("--draft", default="none", help="none, a draft folder, or random:S (random draft layers)")
    ap.add_argument("--spec-policy", default="always", help="with a draft: always (depth S every step), auto, ...")
    ap.add_argument("--batch-sizes", default="32,64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefills", type=int, default=100, help="lone arrivals timed per repeat")
    ap.add_argument("--arrivals", type=int, default=25,
                    help="arrivals per phase for an arrival's cost to a running batch of the largest size (0: skip)")
    ap.add_argument("--cache", default="empty", choices=["empty", "full"],
                    help="the prefix cache at the lone arrivals: empty, or full of other prompts (every arrival evicts)")
    ap.add_argument("--pool-tokens", type=int, default=None, help="KV pool size (default: 400 per request of the largest batch)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the forward does not take the other core)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu (default), or cuda: there the forward is a graph launch and the rest includes waiting "
                         "for the device, so the decode split reads differently; the lone arrival's parts say what "
                         "a first token's engine phase is made of")
    ap.add_argument("--emulate-graphs", action="store_true",
                    help="on the CPU, run every forward through the graph runners' buffers as a GPU would (`graph_emulate`): "
                         "the op count then includes what filling them costs")
    ap.add_argument("--overlap", action="store_true",
                    help="on the CPU, schedule as a CUDA engine does (overlap scheduling: mixed steps, and with "
                         "--emulate-graphs the fused step staged into its graph), so that the host's part of a GPU "
                         "engine's steps is measured here")
    ap.add_argument("--events", action="store_true",
                    help="attach the state events as the engine process does (sampled, no subscriber) and time them apart")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="an engine config field for the measured engine (repeatable), e.g. fuse_mixed_steps=false")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    import torch

    from mleagle.engine.core.engine import Engine

    torch.set_num_threads(a.threads)
    bss = [int(x) for x in a.batch_sizes.split(",")]
    over: dict[str, Any] = {"spec_policy": a.spec_policy} if a.draft != "none" else {}
    if a.emulate_graphs:
        over["graph_emulate"] = True
    for kv in a.set:  # (strings: the engine validates overrides as a config file's [engine] table)
        k, eq, v = kv.partition("=")
        if not eq or not k:
            ap.error(f"--set takes FIELD=VALUE, got {kv!r}")
        over[k] = v
    e = Engine(a.config, device=a.device, draft=a.draft, max_running_requests=max(bss),
               max_total_tokens=a.pool_tokens or max(bss) * max(400, 61 + arrival_tokens(a.arrivals) + 8) + 1024,
               **over)
    if a.overlap:
        e.scheduler.overlap = True
    acc = [0.0]
    time_forwards(acc)
    pump = None
    if a.events:
        import tempfile

        from mleagle.engine.contract.event_bus import ZmqEventPublisher
        from mleagle.engine.service.process import EventPump

        pump = EventPump(ZmqEventPublisher(f"ipc://{tempfile.mkdtemp(prefix='mleagle-ehs-')}/events"))
        pump.attach(e)  # as `mleagle serve` starts it: one step's per-step events every 0.1 s
    rows: list[dict[str, Any]] = []
    for bs in bss:
        one(e, bs, 1000 + bs, acc, pump)  # every shape of this batch size met once
        runs = [one(e, bs, r, acc, pump) for r in range(a.repeats)]
        row: dict[str, Any] = {"batch": bs, "runs": runs}
        for k in ("host_us", "host_us_per_row", "forward_us", "message_us", "events_us", "mean_rows"):
            v = [r[k] for r in runs]
            row[k] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
        rows.append(row)
    prefill_one(e, 20, acc, a.cache)  # warm
    pre = [prefill_one(e, a.prefills, acc, a.cache, seed=r) for r in range(a.repeats)]
    prefill = {k: {"median": statistics.median(r[k] for r in pre), "min": min(r[k] for r in pre),
                   "max": max(r[k] for r in pre)} for k in ("host_us", "forward_us", "step_us")}
    prefill["parts_us"] = {k: statistics.median(r["parts_us"][k] for r in pre) for k in pre[0]["parts_us"]}
    ops = count_ops(e)
    bb = max(bss)
    books = [bookkeeping(e, bb) for _ in range(a.repeats)]
    arr = [arrivals(e, bb, a.arrivals, r, acc) for r in range(a.repeats)] if a.arrivals else []
    book = {k: statistics.median(b[k] for b in books) for k in books[0]}
    head = f"{'batch':>5} {'rows/step':>9} {'host us/step':>22} {'host us/row':>18} {'forward us/step':>22} {'message us/step':>18}"
    if pump is not None:
        head += f" {'events us/step':>18}"
    print(f"{a.config}, draft {a.draft}{f' ({a.spec_policy})' if a.draft != 'none' else ''} on {platform.node()} ({platform.processor() or platform.machine()}), torch threads {a.threads}; "
          f"decode steps only, median (min-max) of {a.repeats} repeats")
    print(head)

    def f(d: dict[str, float], p: int = 0) -> str:
        return f"{d['median']:.{p}f} ({d['min']:.{p}f}-{d['max']:.{p}f})"

    for r in rows:
        print(f"{r['batch']:>5} {r['mean_rows']['median']:>9.1f} {f(r['host_us']):>22} {f(r['host_us_per_row'], 1):>18} "
              f"{f(r['forward_us']):>22} {f(r['message_us']):>18}" + (f" {f(r['events_us']):>18}" if pump is not None else ""))
    nodes = f" ({pre[0]['cached_nodes']} nodes, every arrival evicts)" if a.cache == "full" else ""
    print(f"prefill of one 60-token arrival at an idle engine, prefix cache {a.cache}{nodes} "
          f"(median of {a.prefills}, then median (min-max) over the repeats): "
          f"host {f(prefill['host_us'])} us, forward {f(prefill['forward_us'])} us, step {f(prefill['step_us'])} us")
    print("  its parts (us, median of the repeats' medians): "
          + ", ".join(f"{k} {v:.0f}" for k, v in prefill["parts_us"].items()))
    print("  its torch operations (kernels/views/host tensors): "
          + ", ".join(f"{k} {v['kernels']}/{v['views']}/{v['host tensors']}" for k, v in ops.items()))
    print(f"per-request host functions of a steady decode step at {bb} rows, hot loops (us a call, median of the repeats): "
          + ", ".join(f"{k} {v:.1f}" for k, v in book.items()))
    if arr:
        am = {k: statistics.median(r[k] for r in arr) for k in ARRIVAL_KEYS}
        each = ", ".join(f"{r['arrival_us']:.0f}" for r in arr)
        print(f"one 60-token arrival into {bb - 1} decoding requests, one before every {arr[0]['every']}th iteration (its first token "
              f"ends it): {am['arrival_us']:.0f} us more than the batch alone "
              f"({each} over the repeats), whose decode iteration takes {am['iteration_us']:.0f} us; "
              f"the host's part (the forwards left out): {am['arrival_host_us']:.0f} us more, of an iteration's "
              f"{am['iteration_host_us']:.0f} us")
    if a.output:
        import mleagle

        tree = Path(mleagle.__file__).resolve().parent  # the tree measured (not necessarily this script's)
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip()
        out = {"command": "python scripts/engine_host_step.py " + " ".join(sys.argv[1:]), "commit": rev,
               "python": platform.python_version(), "torch": torch.__version__, "threads": a.threads,
               "config": a.config, "device": a.device, "draft": a.draft, "spec_policy": a.spec_policy if a.draft != "none" else None,
               "events": a.events, "emulate_graphs": a.emulate_graphs, "overlap": a.overlap, "set": a.set, "cache": a.cache, "pool_tokens": e.pool_usage()[0]["kv_total"], "rows": rows, "prefill_one": {"runs": pre, **prefill, "ops": ops},
               "bookkeeping_us": {"rows": bb, "runs": books, "median": book},
               "arrival_into_batch": {"runs": arr, **({k: statistics.median(r[k] for r in arr) for k in ARRIVAL_KEYS} if arr else {})}}
        Path(a.output).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
