"""Does a reduced draft vocabulary pay? Draft-step time at SmolLM2's shape, full head against subsets.

SmolLM2-135M's shape with random weights (`load_format = dummy`), float32 on the CPU, a 3-layer chain
draft (random weights: every draft is rejected, which does not change the cost of an iteration), and
the same prompts for every configuration in one process: target-only decode, then speculation with
the draft head over the whole vocabulary (49152) and over the first Vd ids (the ids do not matter for
time). Per configuration it reports ms per decode step (target-only) or per iteration (verify, and the
S draft-extend forwards), from the engine's own timers, and the speed-up speculation would reach at a
few mean acceptance lengths L: L · t_decode / (t_verify + t_draft). Prints a table, writes JSON.

    .venv/bin/python scripts/bench_draft_vocab.py --threads 1 --out results/bench_draft_vocab.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from mleagle.engine.contract.config import EngineConfig, MleagleConfig, ModelArch, ModelSource
from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine

SMOL = ModelArch(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                 max_position_embeddings=8192, tie_word_embeddings=True, eos_token_id=2)


def run(e: Engine, bs: int, new: int, prompt_len: int) -> dict[str, float]:
    prompts = [[(7 * i + 13 * j) % 49000 + 100 for j in range(prompt_len)] for i in range(bs)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    e.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))  # warm-up
    w = e.worker
    st = getattr(w, "stats", None)
    v0, d0, n0 = (st.verify_time_s, st.draft_time_s, st.num_verify) if st else (0.0, 0.0, 0)
    steps0 = e.scheduler.num_steps
    t0 = time.perf_counter()
    e.generate(prompts, sp)
    dt = time.perf_counter() - t0
    if st is None:
        return {"wall_s": dt, "decode_ms": 1e3 * dt / max(e.scheduler.num_steps - steps0, 1)}
    iters = (st.num_verify - n0) / bs
    return {"wall_s": dt, "verify_ms": 1e3 * (st.verify_time_s - v0) / iters,
            "draft_ms": 1e3 * (st.draft_time_s - d0) / iters}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", default="49152,32768,16384,8192")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = MleagleConfig(model=ModelSource(name="smollm2-135m-dummy", load_format="dummy", arch=SMOL),
                        engine=EngineConfig(max_total_tokens=8192, max_context_len=1024, max_running_requests=16))
    base = Engine(cfg, draft="none")
    spec = Engine(cfg, draft=f"random:{a.layers}", spec_policy="always")
    rows = []
    for bs in [int(x) for x in a.batch_sizes.split(",")]:
        t = run(base, bs, a.new_tokens, a.prompt_len)
        row = {"batch_size": bs, "decode_ms": round(t["decode_ms"], 2), "vocab": {}}
        for v in [int(x) for x in a.vocab.split(",")]:
            spec.draft_stack.set_vocab(None if v >= SMOL.vocab_size else torch.arange(v))
            r = run(spec, bs, a.new_tokens, a.prompt_len)
            it = r["verify_ms"] + r["draft_ms"]
            row["vocab"][v] = {"verify_ms": round(r["verify_ms"], 2), "draft_ms": round(r["draft_ms"], 2),
                               "draft_ms_per_layer": round(r["draft_ms"] / a.layers, 2),
                               "speedup_at": {L: round(L * t["decode_ms"] / it, 3) for L in (2.0, 2.5, 3.0)}}
        rows.append(row)
    res = {"machine": {"cpu": _cpu(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "loadavg": list(os.getloadavg())},
           "model": "SmolLM2-135M shape, dummy weights, float32", "layers": a.layers, "new_tokens": a.new_tokens,
           "prompt_len": a.prompt_len, "results": rows}
    print(f"| bs | decode ms | Vd | verify ms | draft ms ({a.layers} layers) | speed-up at L=2 / 2.5 / 3 |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        for v, r in row["vocab"].items():
            s = r["speedup_at"]
            print(f"| {row['batch_size']} | {row['decode_ms']} | {v} | {r['verify_ms']} | {r['draft_ms']} | "
                  f"{s[2.0]} / {s[2.5]} / {s[3.0]} |")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {a.out}", file=sys.stderr)
    return 0


def _cpu() -> str:
    from mleagle.engine.entrypoints.bench import cpu_name

    return cpu_name() or "CPU"


if __name__ == "__main__":
    raise SystemExit(main())
