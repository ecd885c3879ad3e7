"""Measure a trained draft on MT-Bench first turns: acceptance per depth and tokens/s for target-only,
the serving boundary-KV policy ('stale') and the reference one ('recompute'), plus greedy exactness.

Every configuration runs the same prompts in the same fixed batches (one `generate` per batch, so the
batch composition is identical across configurations), float32, greedy. Writes a JSON file.
Example: `.venv/bin/python scripts/bench_trained_draft.py --draft drafts/smollm2-135m-mtp3`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from mleagle.engine.contract.config import data_dir
from mleagle.engine.contract.outputs import SpecStats
from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine
from mleagle.engine.spec.reference import RecomputeSpecWorker


def prompts(path: str, n: int) -> list[str]:
    rows = [json.loads(line) for line in Path(path).read_text().split("\n") if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


def run(draft: str, boundary_kv: str, texts: list[str], bs: int, n_new: int) -> dict:
    # recompute needs the prefix cache off; the other runs keep it off too, so all see the same prefills
    ref = {"spec_worker": RecomputeSpecWorker} if boundary_kv == "recompute" else {}
    e = Engine(draft=draft, max_running_requests=bs, enable_prefix_cache=False, spec_policy="always", **ref)
    sp = SamplingParams(temperature=0.0, max_new_tokens=n_new)
    e.generate([texts[0]], SamplingParams(temperature=0.0, max_new_tokens=4), chat=True)  # warm-up
    if draft != "none":
        e.worker.stats = SpecStats(accepted_per_depth=[0] * e.worker.steps)
        e.worker.boundary_kv_stale_positions = 0
    toks: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(texts), bs):
        toks += [c.token_ids for c in e.generate(texts[i : i + bs], sp, chat=True)]
    dt = time.perf_counter() - t0
    n = sum(len(t) for t in toks)
    out = {"draft": draft, "boundary_kv": boundary_kv if draft != "none" else None, "tokens": n, "wall_s": round(dt, 3),
           "tok_s": round(n / dt, 3), "token_ids": toks}
    if draft != "none":
        st: SpecStats = e.worker.stats
        out |= {"spec": st.summary(), "accept_len": round(st.accept_len, 4),
                "accept_rate_per_depth": [round(a / st.num_verify, 4) for a in st.accepted_per_depth],
                "boundary_kv_stale_positions": e.worker.boundary_kv_stale_positions}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="drafts/smollm2-135m-mtp3")
    ap.add_argument("--data", default=None, help="default: mt_bench.jsonl in $MLEAGLE_DATA_DIR or ../shared/data")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default="results/tmp/bench_trained_draft.json")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    given = a.data
    a.data = a.data or str(data_dir() / "mt_bench.jsonl")
    texts = prompts(a.data, a.num_prompts)
    runs = [run("none", "stale", texts, a.batch_size, a.max_new_tokens),
            run(a.draft, "stale", texts, a.batch_size, a.max_new_tokens),
            run(a.draft, "recompute", texts, a.batch_size, a.max_new_tokens)]
    ref = runs[0]["token_ids"]
    for r in runs[1:]:
        bad = [i for i, (x, y) in enumerate(zip(r["token_ids"], ref)) if x != y]
        r["exact"] = not bad
        r["mismatched_prompts"] = bad
        r["first_mismatch"] = [next((j for j, (p, q) in enumerate(zip(r["token_ids"][i], ref[i])) if p != q),
                                    min(len(r["token_ids"][i]), len(ref[i]))) for i in bad]
    from mleagle.engine.entrypoints.bench import cpu_name

    res = {"machine": {"cpu": cpu_name() or platform.machine(), "cores": os.cpu_count(),
                       "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "loadavg": os.getloadavg()},
           "model": "smollm2-135m (SmolLM2-135M-Instruct GGUF, float32)", "data": f"{Path(a.data).name} first turns, first {len(texts)}",
           "batch_size": a.batch_size, "max_new_tokens": a.max_new_tokens, "temperature": 0.0,
           "command": "scripts/bench_trained_draft.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "data" or given),
           "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    for r in runs:
        print(json.dumps({k: v for k, v in r.items() if k != "token_ids"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
