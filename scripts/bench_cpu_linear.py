"""CPU GEMMs by row count: F.linear, (W @ x^T)^T and oneDNN's product with packed weights.

`engine/layers/linear.py` picks, by dtype and row count, between F.linear, (W @ x^T)^T (one row
going in twice) and, in float32 from 3 rows, oneDNN's product with the weight in its packed layout,
because the CPU BLAS is far from one formula's cost across row counts. This script times each over a
model's worth of distinct weights (so nothing stays in cache, as in a real forward), for the row counts
a decode (1..batch), a verify window (S+1 per request) and a prefill produce, and prints which one the
engine's rule picks, so the rule can be rechecked on another machine or torch build.

    python scripts/bench_cpu_linear.py [--threads 1] [--dtypes float32,bfloat16] [--out linear.json]

The default shape is SmolLM2-135M's (30 layers of 960×576 QKV, 576×576 O, 3072×576 gate/up, 576×1536
down, and the 49152×576 head).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def best_ms(fn: Any, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * min(ts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,16,32,64,128,512")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--qkv", type=int, default=960)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from mleagle.engine.layers.linear import (
        PACKED_AVAILABLE,
        PACKED_MIN_ROWS,
        SKINNY_MIN_ROWS,
        left_operand,
        packed,
    )

    torch.set_num_threads(a.threads)
    h, i = a.hidden, a.intermediate
    shapes = [(a.qkv, h), (h, h), (2 * i, h), (h, i)] * a.layers + [(a.vocab, h)]
    rows_out: list[dict[str, Any]] = []
    print(f"torch {torch.__version__}, {a.threads} thread(s); {a.layers} layers + head, hidden {h}\n")
    print("| dtype | rows | F.linear ms | (W @ x^T)^T ms | packed ms | the engine uses |")
    print("|---|---:|---:|---:|---:|---|")
    for name in a.dtypes.split(","):
        dt = getattr(torch, name)
        g = torch.Generator().manual_seed(0)
        ws = [torch.randn(o, k, generator=g).to(dt) for o, k in shapes]
        pw = [packed(w) for w in ws] if PACKED_AVAILABLE and dt == torch.float32 else None
        for m in (int(r) for r in a.rows.split(",")):
            xs = {k: torch.randn(m, k, generator=g).to(dt) for k in {k for _, k in shapes}}
            lin = best_ms(lambda xs=xs, ws=ws: [F.linear(xs[w.shape[1]], w) for w in ws], a.repeats)
            left = best_ms(lambda xs=xs, ws=ws: [left_operand(xs[w.shape[1]], w) for w in ws], a.repeats) if m <= 64 else None
            pk = best_ms(lambda xs=xs, ws=ws, pw=pw: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                                      for w, p in zip(ws, pw)], a.repeats) if pw is not None else None
            if pw is not None and m >= PACKED_MIN_ROWS:
                uses = "packed"
            else:
                uses = "(W @ x^T)^T" if SKINNY_MIN_ROWS.get(dt, 8) <= m <= 64 else "F.linear"
            rows_out.append({"dtype": name, "rows": m, "f_linear_ms": round(lin, 2),
                             "left_operand_ms": round(left, 2) if left is not None else None,
                             "packed_ms": round(pk, 2) if pk is not None else None, "engine_uses": uses})
            cell = [f"{v:.1f}" if v is not None else "-" for v in (lin, left, pk)]
            print(f"| {name} | {m} | {' | '.join(cell)} | {uses} |", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"torch": torch.__version__, "threads": a.threads, "rows": rows_out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
