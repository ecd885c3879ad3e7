"""Where an engine step's host time goes when arrivals come one by one, as they do through the server.

`python scripts/arrival_profile.py [--requests N] [--concurrency C] [--max-new-tokens T] [--out FILE]`
runs a closed loop through `Engine.add_request`/`step` on a SmolLM2-135M-shaped model with dummy
weights (a tiny one on the CPU): C requests in flight, each up to T new tokens (lengths drawn from
T/4..T, so that finishes come one by one as natural EOS makes them), the next prompt added `delay`
steps after a finish frees its slot (0 is what `bench serve-matrix --offline` replays; 1-2 steps is the server's
round trip). For target-only, the random 3-layer draft at full depth and the `auto` policy it prints
per delay: output tok/s, steps by mode (EXTEND, DECODE, MIXED) and their mean host time, the
speculative worker's host time in prefill, launch, finish, draft fill and catch-up, and, in the
delay-1 run, the Python lines at which CUDA synchronised (`torch.cuda.set_sync_debug_mode`), counted;
`--torch-profile STEPS` adds a torch.profiler table of the draft's steps (host functions by total
time, then kernels).
Shapes only: the dummy draft accepts next to nothing, so its tok/s say nothing about speculation.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import time
import warnings
from typing import Any

import torch

from mleagle.engine.contract.config import EngineConfig, MleagleConfig, ModelArch, ModelSource
from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine
from mleagle.engine.spec import worker as SW

ACC: collections.Counter[str] = collections.Counter()


def model_config(small: bool) -> MleagleConfig:
    if small:
        arch = ModelArch(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    else:
        arch = ModelArch(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True)
    return MleagleConfig(model=ModelSource(name="smollm2-135m-shape", load_format="dummy", arch=arch),
                         engine=EngineConfig(max_total_tokens=65536, max_context_len=2048))


def time_method(cls: type, name: str) -> None:
    f = getattr(cls, name)

    def w(self: Any, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        r = f(self, *a, **k)
        ACC[name] += time.perf_counter() - t0
        ACC[name + "_n"] += 1
        return r

    setattr(cls, name, w)


def run(e: Engine, prompts: list[list[int]], sps: list[SamplingParams], conc: int, delay: int,
        syncs: bool) -> dict[str, Any]:
    ACC.clear()
    n = len(prompts)
    nxt = steps = tok = 0
    pend: list[int] = []  # steps until each freed slot's next prompt arrives
    bym: collections.Counter[str] = collections.Counter()
    tby: collections.Counter[str] = collections.Counter()
    sync_at: collections.Counter[str] = collections.Counter()
    t0 = time.perf_counter()
    for _ in range(min(conc, n)):
        e.add_request(f"r{nxt}", prompts[nxt], sps[nxt])
        nxt += 1
    while e.has_work() or pend:
        if not e.has_work():  # only arrivals to wait for: no step to time
            pend = [0 for _ in pend]
        while 0 in pend and nxt < n:
            pend.remove(0)
            e.add_request(f"r{nxt}", prompts[nxt], sps[nxt])
            nxt += 1
        pend = [d for d in pend if d > 0 and nxt < n]
        debug = syncs and e.device.type == "cuda" and 20 < steps < 400
        if debug:
            torch.cuda.set_sync_debug_mode(1)
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            ts = time.perf_counter()
            outs = e.step()
            dt = time.perf_counter() - ts
        if debug:
            torch.cuda.set_sync_debug_mode(0)
        for w in ws:
            if "synchroniz" in str(w.message):
                sync_at[f"{os.path.basename(w.filename)}:{w.lineno}"] += 1
        m = e.scheduler.report.mode
        bym[m] += 1
        tby[m] += dt
        steps += 1
        tok += sum(len(o.token_ids) for o in outs)
        # A finish frees a slot: its next prompt arrives `delay` steps later (before the step after
        # next at delay 1), or before the very next step at delay 0.
        pend = [d - 1 for d in pend] + [delay for o in outs if o.finished and nxt < n]
    wall = time.perf_counter() - t0
    return {"delay": delay, "tok_s": round(tok / wall), "wall_s": round(wall, 3), "steps": steps, "by_mode": dict(bym),
            "ms_by_mode": {k: round(tby[k] / bym[k] * 1e3, 3) for k in bym},
            "worker_ms": {k: round(v * 1e3, 1) for k, v in ACC.items() if not k.endswith("_n")},
            "worker_calls": {k[:-2]: v for k, v in ACC.items() if k.endswith("_n")},
            "syncs": dict(sync_at.most_common(12))}


def profile_steps(e: Engine, prompts: list[list[int]], sps: list[SamplingParams], conc: int, steps: int) -> None:
    """torch.profiler over `steps` steps of a delay-1 closed loop, after 32 unprofiled ones."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if e.device.type == "cuda" else [])
    orig = e.step
    n = [0]
    prof = profile(activities=acts, record_shapes=False)

    def step() -> Any:
        n[0] += 1
        if n[0] == 32:
            prof.start()
        out = orig()
        if n[0] == 32 + steps:
            prof.stop()
        return out

    e.step = step  # type: ignore[method-assign]
    run(e, prompts, sps, conc, 1, False)
    e.step = orig  # type: ignore[method-assign]
    if n[0] >= 32 + steps:
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
        if e.device.type == "cuda":
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--out", default=None, help="JSON with every row")
    ap.add_argument("--torch-profile", type=int, default=0, metavar="STEPS",
                    help="also profile this many steps of the draft's delay-1 run with torch.profiler and print "
                         "the host functions and CUDA kernels by total time (prefill and mixed steps included)")
    ap.add_argument("--prefill-wait", default="0", metavar="N[,N...]",
                    help="engine prefill_wait_steps values to run each configuration with (default 0)")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = model_config(dev == "cpu")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49000) for _ in range(rng.randrange(30, 130))] for _ in range(a.requests)]
    # Lengths spread as natural EOS spreads them, so finishes (and arrivals) come one by one.
    sps = [SamplingParams(temperature=0, max_new_tokens=rng.randrange(a.max_new_tokens // 4, a.max_new_tokens + 1),
                          ignore_eos=True) for _ in prompts]
    for name in ("catch_up", "prefill", "launch", "finish", "_draft_fill"):
        time_method(SW.SpecWorker, name)
    rows = []
    waits = [int(x) for x in a.prefill_wait.split(",")]
    for (draft, policy), wait in [(c, w) for c in [("none", "always"), ("random:3", "always"), ("random:3", "auto")]
                                  for w in waits]:
        e = Engine(cfg, device=dev, draft=draft, spec_policy=policy, max_running_requests=a.concurrency, seed=0,
                   prefill_wait_steps=wait)
        run(e, prompts, sps, a.concurrency, 0, False)  # warms every shape
        for delay, syncs in ((0, False), (1, True), (2, False), (1, False)):
            r = run(e, prompts, sps, a.concurrency, delay, syncs)
            r.update(draft=draft, policy=policy, sync_debug=syncs, prefill_wait=wait)
            rows.append(r)
            print(json.dumps(r), flush=True)
        if a.torch_profile and draft != "none" and policy == "always" and wait == waits[-1]:
            profile_steps(e, prompts, sps, a.concurrency, a.torch_profile)
        del e
        if dev == "cuda":
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
