"""Where a served iteration's device time goes against a static batch's, kernel family by family:
`python scripts/served_kernels.py [--concurrency 32] [--requests-per-concurrency 8] [--serve-flags
'--draft none'] [--output F.json]`.

One engine, built from `mleagle serve --config smollm2-135m` plus `--serve-flags` exactly as `bench
serve-matrix`'s offline replay builds it (and warmed up as a server's engine is), runs under
`torch.profiler` (CUDA kernels):

- `static`: `Engine.generate` over the first `concurrency` MT-Bench first turns, 256 tokens each
  (`bench gpu`'s static batch);
- `served`: the offline replay's closed loop at `concurrency` (`bench serve`'s prompts in its order,
  natural EOS, the next request added as soon as one finishes), after its warm-up requests.

Per phase: the kernels' own time per decode iteration (the engine's iteration count, fused mixed steps
included), by family (GEMMs, decode attention, extend attention, rotary + store, norms, activation,
sampling and the rest), the engine's own device-busy µs per iteration beside it, and the top kernels
by the difference. Kernel time is not the device's span (a graph's launch gaps are in neither), so
the families show what work the served iterations add, the busy figure what they take.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

FAMILIES = [("gemm", r"nvjet|gemm|cutlass|sm90_xmma|cublas|aten::mm|aten::addmm"), ("decode attention", r"_decode_kernel|_merge_kernel"),
            ("extend attention", r"_extend_kernel"), ("rotary + store", r"_rope_store"),
            ("norm", r"rmsnorm"), ("activation", r"silu"), ("sampling", r"argmax|ArgMax|softmax|topk|sort"),
            ("copies", r"[Mm]emcpy|copy_kernel|direct_copy"), ("index", r"index|gather|scatter")]


def family(name: str) -> str:
    for fam, pat in FAMILIES:
        if re.search(pat, name):
            return fam
    return "other"


def profiled(engine: Any, fn: Any) -> dict[str, Any]:
    """Run fn() under the profiler: kernel µs by name, the iterations it ran, device-busy seconds."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mleagle.engine.contract.stats import iteration_summary
    from mleagle.engine.entrypoints.bench_gpu import kernel_name

    cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    s0 = engine.stats()
    sync()
    t0 = time.perf_counter()
    # On the CPU the operators' own CPU time stands in (the plumbing, not a figure).
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as p:
        fn()
        sync()
    wall = time.perf_counter() - t0
    s1 = engine.stats()
    by: dict[str, float] = defaultdict(float)
    for ev in p.key_averages():
        own = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        if own > 0:
            by[kernel_name(ev.key)] += own
    its = iteration_summary(s0, s1, wall) or {}
    return {"iterations": s1["iterations"] - s0["iterations"], "rows": s1["iteration_rows"] - s0["iteration_rows"],
            "wall_s": wall, "fused_steps": s1.get("fused_mixed_steps", 0) - s0.get("fused_mixed_steps", 0),
            "device_busy_us_per_iteration": its.get("device_us_per_iteration"), "kernel_us": dict(by)}


def run(a: argparse.Namespace) -> dict[str, Any]:
    from mleagle.daemon.bench_matrix import build_parser, offline_spec, parse_arm
    from mleagle.engine.contract.config import MleagleConfig, data_dir
    from mleagle.engine.contract.sampling_params import SamplingParams
    from mleagle.engine.entrypoints.bench import read_first_turns
    from mleagle.engine.entrypoints.bench_gpu import machine
    from mleagle.engine.entrypoints.bench_replay import closed_loop
    from mleagle.engine.service.tp_driver import start_engine

    c = a.concurrency
    ma = build_parser().parse_args(["--config", a.config, "--concurrency", str(c), "--requests-per-concurrency",
                                    str(a.requests_per_concurrency), "--min-requests", "1", "--warmup", str(a.warmup),
                                    "--max-tokens", str(a.max_tokens)] + (["--data-dir", a.data_dir] if a.data_dir else []))
    arm = parse_arm(f"x={a.serve_flags}", ["--config", a.config])
    spec = offline_spec(ma, arm, [c])
    cfg = MleagleConfig.model_validate_json(spec["config"])
    params = SamplingParams.model_validate(spec["params"])
    engine = start_engine(cfg)
    try:
        engine.warm_up()
        enc = {p: engine.encode_prompt(p, True) for r in [spec["warmup"], *spec["runs"]] for p in r["prompts"]}
        texts = read_first_turns("mt_bench", data_dir(a.data_dir))[:c]
        static_prompts = [engine.encode_prompt(t, True) for t in texts]
        sp = SamplingParams(temperature=0, max_new_tokens=a.max_tokens, ignore_eos=True)

        def static() -> None:
            engine.generate(static_prompts, sp)

        def served() -> None:
            closed_loop(engine, [enc[p] for p in spec["runs"][0]["prompts"]], params, c, "s")

        static()  # warm every shape either phase times
        closed_loop(engine, [enc[p] for p in spec["warmup"]["prompts"]], params, spec["warmup"]["concurrency"], "w")
        served()
        res: dict[str, Any] = {"machine": machine(), "config": a.config, "serve_flags": a.serve_flags,
                               "concurrency": c, "served_requests": len(spec["runs"][0]["prompts"])}
        res["static"] = profiled(engine, static)
        res["served"] = profiled(engine, served)
        return res
    finally:
        engine.close()


def report(res: dict[str, Any]) -> str:
    ph = {k: res[k] for k in ("static", "served")}
    fam: dict[str, dict[str, float]] = {}
    per_it: dict[str, dict[str, float]] = {}
    for k, r in ph.items():
        n = max(r["iterations"], 1)
        per_it[k] = {name: us / n for name, us in r["kernel_us"].items()}
        f: dict[str, float] = defaultdict(float)
        for name, us in per_it[k].items():
            f[family(name)] += us
        fam[k] = dict(f)
    out = [f"{res['config']} {res['serve_flags'] or '(default config)'} at concurrency {res['concurrency']} on "
           f"{res['machine'].get('gpu', 'the CPU (operators, not kernels)')}: kernel µs per iteration",
           "", "| | static | served | served - static |", "|---|---:|---:|---:|"]
    for k in ("iterations", "fused_steps"):
        out.append(f"| {k} | {ph['static'][k]} | {ph['served'][k]} | |")
    out.append(f"| rows per iteration | {ph['static']['rows'] / max(ph['static']['iterations'], 1):.1f} | "
               f"{ph['served']['rows'] / max(ph['served']['iterations'], 1):.1f} | |")
    names = [f for f, _ in FAMILIES] + ["other"]
    for f in names:
        a, b = fam["static"].get(f, 0.0), fam["served"].get(f, 0.0)
        if a or b:
            out.append(f"| {f} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    ta, tb = sum(fam["static"].values()), sum(fam["served"].values())
    out.append(f"| **kernels, all** | {ta:.1f} | {tb:.1f} | {tb - ta:+.1f} |")
    da, db = ph["static"]["device_busy_us_per_iteration"], ph["served"]["device_busy_us_per_iteration"]
    if da and db:
        out.append(f"| engine device busy µs/iteration (span) | {da:.1f} | {db:.1f} | {db - da:+.1f} |")
    diffs = sorted({*per_it["static"], *per_it["served"]},
                   key=lambda n: -abs(per_it["served"].get(n, 0) - per_it["static"].get(n, 0)))[:8]
    out += ["", "kernels by difference (µs per iteration): static, served"]
    out += [f"  {per_it['static'].get(n, 0):8.1f} {per_it['served'].get(n, 0):8.1f}  {n}" for n in diffs]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="smollm2-135m")
    ap.add_argument("--serve-flags", default="--draft none", help="more `mleagle serve` flags, one string")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests-per-concurrency", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256, help="each request's most (the static batch's exact) tokens")
    ap.add_argument("--data-dir", default=None, help="where mt_bench.jsonl is (default: $MLEAGLE_DATA_DIR, else ../shared/data)")
    ap.add_argument("--output", default=None)
    a = ap.parse_args(argv)
    shlex.split(a.serve_flags)  # a malformed string fails here, before a model loads
    res = run(a)
    print(report(res))
    if a.output:
        Path(a.output).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {a.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
