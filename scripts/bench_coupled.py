"""What drawing seeded requests from their own tape costs in acceptance: `python scripts/bench_coupled.py`.

Under speculation a request that brings its own seed takes its tokens from the target-only draws of
its (seed, position) tape and accepts a draft while it equals that draw (`SpecWorker._couple`), so it
is reproducible whatever the drafts, the batch and the prefix cache; a request without a seed keeps
Leviathan/Chen rejection sampling, which accepts more. This runs the same prompts both ways with the
same draft in one engine (the first turns of a prompt set, chat template), prints a table of accept
length per path and temperature, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from mleagle.engine.contract.config import data_dir
from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine
from mleagle.engine.entrypoints.bench import read_first_turns
from mleagle.engine.entrypoints.bench_gpu import encode_texts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="drafts/smollm2-135m-mtp3")
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0.8")
    ap.add_argument("--out", default="results/bench_coupled.json")
    a = ap.parse_args(argv)
    e = Engine(a.model, draft=a.draft, max_running_requests=a.prompts, enable_prefix_cache=False, spec_policy="always")
    prompts = encode_texts(e, read_first_turns(a.dataset, data_dir(None))[: a.prompts])
    rows = []
    for t in (float(x) for x in a.temperatures.split(",")):
        for path in ("coupled", "rejection"):
            sps = [SamplingParams(temperature=t, max_new_tokens=a.max_new_tokens, ignore_eos=True,
                                  seed=100 + i if path == "coupled" else None) for i in range(len(prompts))]
            t0 = time.perf_counter()
            out = e.generate(prompts, sps)
            dt = time.perf_counter() - t0
            v = sum(c.spec.num_verify for c in out if c.spec)
            acc = sum(c.spec.num_accepted_tokens for c in out if c.spec)
            depth = [sum(c.spec.accepted_per_depth[j] for c in out if c.spec) / v for j in range(e.worker.steps)]  # type: ignore[attr-defined]
            rows.append({"temperature": t, "path": path, "accept_len": round(1 + acc / v, 3),
                         "accept_per_depth": [round(x, 3) for x in depth], "tokens": sum(len(c.token_ids) for c in out),
                         "wall_s": round(dt, 2)})
            print(f"T {t}: {path:9s} accept length {rows[-1]['accept_len']:.3f} per depth {rows[-1]['accept_per_depth']}",
                  flush=True)
    res = {"machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine()},
           "model": a.model, "draft": a.draft, "dataset": a.dataset, "prompts": len(prompts),
           "max_new_tokens": a.max_new_tokens, "batch": len(prompts), "ignore_eos": True, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("\n| T | path | accept length | per depth |\n|---|---|---:|---|")
    for r in rows:
        print(f"| {r['temperature']} | {r['path']} | {r['accept_len']:.3f} | {' / '.join(map(str, r['accept_per_depth']))} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
