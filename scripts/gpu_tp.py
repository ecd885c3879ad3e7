"""Tensor parallelism on two GPUs (NCCL): TP=2 against TP=1 on a Llama-3-8B-shaped dummy model, one run.

    python scripts/gpu_tp.py [--out PATH] [--layouts all_reduce,scattered]     # 2 GPUs, ~3-4 minutes
    python scripts/gpu_tp.py --iteration-graph both                             # + per-forward graphs
    python scripts/gpu_tp.py --dry-run                                          # CPU, gloo, tiny model

One process is rank 0 of every engine (TP=1 on GPU 0; TP=2 with rank 1 on GPU 1, started by the engine),
all with CUDA graphs for decode (greedy decode steps replay whole-iteration graphs, collectives inside),
bfloat16. For TP=1 and for TP=2 in each layout:
- logits: teacher-forced over random prompts (`prompt_logprobs`: every prompt position's logprob of the
  next prompt token, top-5), the largest |Δ logprob| against TP=1, against a bfloat16 tolerance;
- greedy tokens over a short horizon against TP=1: equal, or a first divergence only where TP=1's own
  top-2 margin is below the tie margin (random weights make near-ties common: bfloat16 rounding of a
  different reduction order may flip them; a real bug diverges at wide margins);
- decode step time at batch 1 and 32 with graphs: the difference of two generate lengths (prefill and
  fixed costs cancel), against the HBM floor (this rank's weight bytes over the measured copy bandwidth).
Prints a table and writes JSON to --out (default $OUT/gpu_tp.json, else results/gpu_tp.json).
`--dry-run` runs the same code on the CPU (gloo, float32, tiny-dummy, emulated graphs, small sizes).
The NVLink-multicast switches (NCCL_NVLS_ENABLE=0 ...) pass to the rank processes with the environment.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine
from mleagle.engine.service.tp_driver import start_engine


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gen(e: Engine, prompts: list[list[int]], n: int, **kw: Any) -> tuple[float, list[Any]]:
    sp = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True, **kw)
    sync()
    t0 = time.perf_counter()
    out = e.generate(prompts, sp)
    sync()
    return time.perf_counter() - t0, out


def weight_bytes(e: Engine) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in e.model.parameters()}.values())


def copy_bandwidth() -> float:
    if not torch.cuda.is_available():
        return 0.0
    from mleagle.engine.entrypoints.bench_gpu import copy_bandwidth as bw

    return bw()


def measure(e: Engine, a: argparse.Namespace, probe: list[list[int]], timing: list[list[int]]) -> dict[str, Any]:
    """Teacher-forced logprobs, greedy tokens, decode step times of one engine."""
    _, outs = gen(e, probe, a.horizon, prompt_logprobs=5, logprobs=5)
    res: dict[str, Any] = {
        "tokens": [o.token_ids for o in outs],
        # per prompt position: (logprob of the actual next token, top-5 [(id, logprob)])
        "prompt_lp": [[(p.logprob, p.top) for p in o.prompt_logprobs[1:]] for o in outs],
        "gen_lp": [[(t.logprob, t.top) for t in o.logprobs] for o in outs],
        "weight_bytes_rank0": weight_bytes(e), "graph_report": e.graph_report, "steps": [],
    }
    for bs in a.batch_sizes:
        ps = timing[:bs]
        gen(e, ps, 8)  # warm-up at this batch size
        fwd0, it0 = replays(e)
        w1, _ = gen(e, ps, a.steps)
        w2, _ = gen(e, ps, 2 * a.steps)
        fwd, it = replays(e)
        step = (w2 - w1) / a.steps
        res["steps"].append({"bs": bs, "ms_per_step": round(1000 * step, 3), "tok_s": round(bs / step, 1),
                             "graph_replays": fwd - fwd0, "iteration_replays": it - it0})
    return res


def replays(e: Engine) -> tuple[int, int]:
    """(per-forward graph replays, whole-iteration graph replays) so far."""
    fwd = sum(sum(r.graphs.stats.replays.values()) for r in e.runners if r.graphs is not None)
    it = e.worker.iter_graph
    return fwd, sum(it.stats.replays.values()) if it is not None else 0


def compare(ref: dict[str, Any], got: dict[str, Any], tie: float) -> dict[str, Any]:
    # Teacher-forced: the same inputs at every position, so every logprob is comparable.
    d = [abs(x[0] - y[0]) for pr, pg in zip(ref["prompt_lp"], got["prompt_lp"]) for x, y in zip(pr, pg)]
    top_same = [int(x[1][0][0] == y[1][0][0]) for pr, pg in zip(ref["prompt_lp"], got["prompt_lp"]) for x, y in zip(pr, pg)]
    rows = []
    ok = True
    for i, (tr, tg) in enumerate(zip(ref["tokens"], got["tokens"])):
        n = next((j for j, (x, y) in enumerate(zip(tr, tg)) if x != y), None)
        row: dict[str, Any] = {"prompt": i, "equal": n is None, "equal_prefix": len(tr) if n is None else n}
        if n is not None:
            top = ref["gen_lp"][i][n][1]
            margin = top[0][1] - top[1][1] if len(top) > 1 else float("inf")
            row.update(tp1_margin=round(margin, 4), near_tie=margin < tie)
            ok = ok and margin < tie
        rows.append(row)
    return {"teacher_forced_max_abs_dlogprob": float(f"{max(d):.3g}") if d else None,
            "teacher_forced_mean_abs_dlogprob": float(f"{sum(d) / len(d):.3g}") if d else None,
            "teacher_forced_top1_agree": f"{sum(top_same)}/{len(top_same)}", "greedy": rows,
            "greedy_ok": ok}


def free(e: Engine | None) -> None:
    if e is not None:
        e.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny-dummy: the same code, small sizes")
    ap.add_argument("--layouts", default="all_reduce,scattered")
    ap.add_argument("--iteration-graph", choices=["on", "off", "both"], default="on",
                    help="whole-iteration graphs for the TP=2 runs (off: per-forward graphs only; both: each "
                         "layout twice, keys ending /per_forward for off). TP=1 runs with on unless off")
    ap.add_argument("--out", default=None)
    ap.add_argument("--horizon", type=int, default=None, help="greedy tokens compared (default 16; dry run 8)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed (difference of n and 2n)")
    ap.add_argument("--tie-margin", type=float, default=0.125,
                    help="a greedy divergence at a TP=1 top-2 margin below this (nats) counts as a near-tie")
    ap.add_argument("--dlogprob-tol", type=float, default=None,
                    help="teacher-forced |Δ logprob| tolerance (default 0.15 bf16; 1e-4 float32 dry run)")
    a = ap.parse_args(argv)
    dry = a.dry_run
    if not dry and torch.cuda.device_count() < 2:
        print("gpu_tp.py needs 2 GPUs (or --dry-run on the CPU)", file=sys.stderr)
        return 2
    model = "tiny-dummy" if dry else "llama3-8b-dummy"
    a.horizon = a.horizon or (8 if dry else 16)
    a.steps = a.steps or (8 if dry else 64)
    a.batch_sizes = [1, 4] if dry else [1, 32]
    tol = a.dlogprob_tol if a.dlogprob_tol is not None else (1e-4 if dry else 0.15)
    plen = 24 if dry else 256
    vocab = 512 if dry else 128000
    over: dict[str, Any] = {"max_running_requests": max(a.batch_sizes)}
    if dry:
        over.update(device="cpu", dtype="float32", graph_emulate=True, threads=1, max_total_tokens=4096)
    else:
        over.update(device="cuda", dtype="bfloat16", max_total_tokens=max(a.batch_sizes) * (plen + 2 * a.steps + 64) + 1024)
    g = torch.Generator().manual_seed(0)
    probe = [torch.randint(0, vocab, (plen // 4 + 7 * i,), generator=g).tolist() for i in range(4)]
    timing = [torch.randint(0, vocab, (plen,), generator=g).tolist() for _ in range(max(a.batch_sizes))]
    res: dict[str, Any] = {"model": model, "dry_run": dry, "torch": torch.__version__, "settings": {
        "horizon": a.horizon, "steps": a.steps, "batch_sizes": a.batch_sizes, "prompt_len": plen,
        "tie_margin": a.tie_margin, "dlogprob_tol": tol, **{k: v for k, v in over.items()}},
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")},
        "runs": {}}
    if torch.cuda.is_available() and not dry:
        res["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        res["copy_bw_bytes_s"] = round(copy_bandwidth())
    t_all = time.perf_counter()
    ref = None
    modes = {"on": [True], "off": [False], "both": [True, False]}[a.iteration_graph]
    plan = [(1, "all_reduce", modes[0])] + [(2, x, ig) for ig in modes for x in a.layouts.split(",") if x]
    for tp, layout, ig in plan:
        key = "tp1" if tp == 1 else f"tp2/{layout}" + ("" if ig else "/per_forward")
        t0 = time.perf_counter()
        e = start_engine(model, tp_size=tp, tp_layout=layout, iteration_graph=ig, **over)
        load_s = time.perf_counter() - t0
        try:
            r = measure(e, a, probe, timing)
        finally:
            free(e)
            del e
        r["load_s"] = round(load_s, 1)
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        if res.get("copy_bw_bytes_s"):
            floor = r["weight_bytes_rank0"] / res["copy_bw_bytes_s"]
            r["hbm_floor_ms_per_step"] = round(1000 * floor, 3)
            for s in r["steps"]:
                s["over_hbm_floor"] = round(s["ms_per_step"] / 1000 / floor, 3)
        if ref is None:
            ref = r
        else:
            r["vs_tp1"] = compare(ref, r, a.tie_margin)
            c = r["vs_tp1"]
            c["logits_ok"] = c["teacher_forced_max_abs_dlogprob"] is not None and c["teacher_forced_max_abs_dlogprob"] < tol
        res["runs"][key] = r
        print(f"{key}: built in {load_s:.1f}s, measured in {r['wall_s'] - load_s:.1f}s", file=sys.stderr, flush=True)
    res["total_s"] = round(time.perf_counter() - t_all, 1)
    res["settings"]["iteration_graph"] = a.iteration_graph
    res["ok"] = all(r["vs_tp1"]["logits_ok"] and r["vs_tp1"]["greedy_ok"] for k, r in res["runs"].items() if k != "tp1")
    print(table(res))
    out = Path(a.out or os.path.join(os.environ.get("OUT", "results"), "gpu_tp_dry.json" if dry else "gpu_tp.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    slim = json.loads(json.dumps(res))
    for r in slim["runs"].values():  # the raw logprobs are for comparing, not for the file
        for k in ("prompt_lp", "gen_lp"):
            r.pop(k, None)
    out.write_text(json.dumps(slim, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0 if res["ok"] else 1


def table(res: dict[str, Any]) -> str:
    s = res["settings"]
    lines = [f"model {res['model']} ({'dry run: CPU, gloo' if res['dry_run'] else ', '.join(res.get('gpus', []))}), "
             f"{s.get('dtype')}, graphs {'emulated' if res['dry_run'] else 'on'}; greedy horizon {s['horizon']}, "
             f"decode step = (t(2n) - t(n))/n, n = {s['steps']}, prompt {s['prompt_len']} tokens", "",
             "| run | bs | ms/step | tok/s | x HBM floor | graph replays (forward / iteration) | teacher-forced max abs dlogprob | top-1 agree | greedy vs TP=1 |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for key, r in res["runs"].items():
        c = r.get("vs_tp1")
        for st in r["steps"]:
            g = "-" if c is None else ("equal" if all(x["equal"] for x in c["greedy"]) else
                                       "; ".join(f"p{x['prompt']}: {x['equal_prefix']} equal"
                                                 + ("" if x["equal"] else f", margin {x['tp1_margin']}"
                                                    + (" (near-tie)" if x["near_tie"] else " (NOT a tie)"))
                                                 for x in c["greedy"]))
            lines.append(f"| {key} | {st['bs']} | {st['ms_per_step']} | {st['tok_s']} | {st.get('over_hbm_floor', '-')} | "
                         f"{st['graph_replays']} / {st['iteration_replays']} | {c['teacher_forced_max_abs_dlogprob'] if c else '-'} | "
                         f"{c['teacher_forced_top1_agree'] if c else '-'} | {g} |")
    lines.append(f"\nok: {res['ok']} (total {res['total_s']} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
