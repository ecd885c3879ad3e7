"""The speculation policy replayed offline on recorded acceptance: would `auto` beat a fixed depth?

A served batch-1 run shows only the outcome (on the H200 `auto` ran a 5-step draft at depth 3 for about
half its iterations and made 4 % fewer tokens a second than depth 5 every iteration); it cannot say
whether a different policy would have done better, and each try costs a GPU run. This script splits
the question in two.

`record` sends the first P prompts of a dataset one at a time through `Engine.generate` with the draft
at its full depth every iteration (greedy, natural EOS) and keeps each iteration's accepted drafts and
the position it started from. Greedy speculation is exact, so the answers, and where the draft is right,
do not depend on the machine beyond bf16 rounding: a CPU recording stands in for the GPU's.

`replay` runs `SpecPolicy` itself (the class the engine asks each iteration) over those answers at a
batch of 1 with the iteration costs a machine measured (`--cost DEPTH=MS,...`, e.g. the H200's warm-up
timings a served run reports under `beliefs.primed_ms`) and prints tokens per second for each fixed
depth and for `auto` with the engine's defaults and any `--variant`. An iteration of depth d that
starts at position p accepts min(d, what the recording allows from p): at a recorded iteration's start,
its accepted count; between two recorded starts (a shallower depth stopped inside a recorded chain)
two bounds, `low` (the draft is right up to the next recorded start and wrong there, as the recording
was) and `high` (right there too, and on along the next recorded chain). A switch to a deeper depth
than the draft layers are current to pays `--catch-up` ms, as the engine's catch-up does. The bounds
are wide (a few percent either side of a fixed depth); served on the H200, the depth-3 iterations of
`auto` made about 11 % fewer tokens a millisecond than its depth-5 ones, near the `low` bound
(results/gpu/round13, results/policy_replay).

    python scripts/policy_replay.py record --draft drafts/smollm2-135m-mtp5 --prompts 16 --out trace.json
    python scripts/policy_replay.py replay trace.json --cost 0=0.92,3=1.07,5=1.19 --catch-up 0.7 \\
        --variant acc_alpha=0.002 --variant margin=0.06
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def record(a: argparse.Namespace) -> int:
    from mleagle.engine.contract.config import data_dir
    from mleagle.engine.entrypoints.bench import read_first_turns
    from mleagle.engine.entrypoints.bench_gpu import encode_texts, engine_for, gen_once, machine

    e = engine_for(a.model, 1, a.max_new_tokens, 512, draft=a.draft, spec_policy="always")
    texts = read_first_turns(a.dataset, data_dir(None))[: a.prompts]
    prompts = encode_texts(e, texts)
    policy = e.worker.policy
    seen: list[int] = []
    observe = policy.observe

    def tap(bs: int, depth: int, accepted: list[int], seconds: float | None, constrained: bool = False) -> None:
        seen.extend(accepted)
        observe(bs, depth, accepted, seconds, constrained)

    policy.observe = tap  # type: ignore[method-assign]
    reqs = []
    for i, p in enumerate(prompts):
        seen.clear()
        _, toks, _ = gen_once(e, [p], a.max_new_tokens, ignore_eos=False)
        reqs.append({"prompt": i, "tokens": len(toks[0]), "accepted": list(seen)})
        print(f"prompt {i}: {len(toks[0])} tokens, {len(seen)} iterations, accept length "
              f"{(sum(seen) + len(seen)) / max(len(seen), 1):.2f}", flush=True)
    Path(a.out).write_text(json.dumps({"machine": machine(), "model": a.model, "draft": a.draft, "steps": e.worker.steps,
                                       "dataset": a.dataset, "max_new_tokens": a.max_new_tokens,
                                       "requests": reqs}, indent=1) + "\n")
    return 0


def potentials(req: dict[str, Any], steps: int, high: bool) -> list[int]:
    """Accepted drafts an iteration starting at each position could have (position 0: after the first
    token, where the first recorded iteration starts)."""
    starts, pos = {}, 0
    for acc in req["accepted"]:
        starts[pos] = acc
        pos += acc + 1
    n = req["tokens"]
    pot = [0] * (n + 1)
    nxt = None  # the next recorded start at or after p
    for p in range(n, -1, -1):
        if p in starts:
            pot[p], nxt = starts[p], p
        elif nxt is None:
            pot[p] = 0
        else:  # inside a recorded chain: right up to the next start's token, and there only if `high`
            pot[p] = min(steps, nxt - p - 1 + (1 + pot[nxt] if high else 0))
    return pot


def replay(trace: dict[str, Any], cost_ms: dict[int, float], catch_up_ms: float, fixed: int | None,
           high: bool, **kw: Any) -> dict[str, Any]:
    """Tokens a second over every recorded request served in turn at a batch of 1, by a fixed depth or
    (`fixed=None`) by `SpecPolicy("auto")` with `kw`, after a warm-up that timed each depth."""
    from mleagle.engine.spec.policy import SpecPolicy

    steps = trace["steps"]
    depths = sorted(cost_ms)
    pol = SpecPolicy("auto", steps, choices=depths, **kw)
    pol.priming = True  # what `Engine._prime_policy` leaves: each depth timed `window` times, then a reset
    pol.apply_published([(1, d, cost_ms[d] / 1e3) for _ in range(pol.window) for d in depths])
    pol.reset(keep_costs=True)
    t = tokens = 0.0
    rows = [0] * (steps + 1)
    for req in trace["requests"]:
        pot = potentials(req, steps, high)
        n, p, current = req["tokens"], 0, steps  # a new request's draft layers are current (its prefill)
        while p < n - 1:
            d = fixed if fixed is not None else pol.choose(1).depth
            sec = cost_ms[d] / 1e3
            if d > current:
                t += catch_up_ms / 1e3
                pol.observe_catch_up(catch_up_ms / 1e3)
                current = steps
            current = min(current, d)
            a = min(d, pot[p])
            made = min(a + 1, n - 1 - p)
            p += a + 1
            t += sec
            tokens += made
            rows[d] += 1
            pol.observe(1, d, [a], sec)
    return {"tok_s": tokens / t, "depth_share": [round(r / sum(rows), 3) for r in rows]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record each iteration's accepted drafts at the full depth")
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--draft", required=True)
    r.add_argument("--dataset", default="mt_bench")
    r.add_argument("--prompts", type=int, default=16)
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--out", required=True)
    p = sub.add_parser("replay", help="replay a recording through fixed depths and the policy")
    p.add_argument("trace")
    p.add_argument("--cost", required=True, help="DEPTH=MS per iteration at a batch of 1, comma-separated")
    p.add_argument("--catch-up", type=float, default=0.7, help="ms a switch up to a deeper depth costs")
    p.add_argument("--variant", action="append", default=[], help="KEY=VALUE[;KEY=VALUE] of SpecPolicy's options")
    p.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.cmd == "record":
        return record(a)
    trace = json.loads(Path(a.trace).read_text())
    cost = {int(k): float(v) for k, v in (x.split("=") for x in a.cost.split(","))}
    variants: dict[str, dict[str, Any]] = {"auto": {}}
    for v in a.variant:
        variants[f"auto {v}"] = {k: float(x) if "." in x else int(x) for k, x in (kv.split("=") for kv in v.split(";"))}
    base: dict[str, float] = {}
    print(f"{len(trace['requests'])} requests from {trace['dataset']} ({trace['draft']}, recorded on "
          f"{trace['machine'].get('gpu', 'cpu')}); costs {cost} ms, catch-up {a.catch_up} ms\n")
    print("| policy | tok/s (low) | vs best fixed | tok/s (high) | vs best fixed | depth share (low) |")
    print("|---|---:|---:|---:|---:|---|")
    rows = [(f"fixed {d}", d, {}) for d in sorted(cost)] + [(k, None, v) for k, v in variants.items()]
    out = {}
    for name, fixed, kw in rows:
        out[name] = {b: replay(trace, cost, a.catch_up, fixed, b == "high", **kw) for b in ("low", "high")}
    for b in ("low", "high"):
        base[b] = max(out[f"fixed {d}"][b]["tok_s"] for d in cost)
    for name, v in out.items():
        lo, hi = v["low"], v["high"]
        print(f"| {name} | {lo['tok_s']:.0f} | {lo['tok_s'] / base['low']:.3f} | {hi['tok_s']:.0f} | "
              f"{hi['tok_s'] / base['high']:.3f} | {lo['depth_share']} |")
    if a.out:
        res = {"trace": a.trace, "cost_ms": cost, "catch_up_ms": a.catch_up, "rows": out}
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
