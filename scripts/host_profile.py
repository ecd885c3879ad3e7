"""Is a batch-1 decode loop bound by the host or by the GPU? Run on a CUDA machine, from the repository root:
`python scripts/host_profile.py DRAFT` (DRAFT: `none` for target-only, or a draft folder).

Times eight `Engine.generate` calls (the first eight MT-Bench first turns, 256 tokens each, greedy,
`ignore_eos`) and measures how long the host waits in each iteration's result sync: a wait of most of
the iteration means the GPU is the bound (host work is hidden by overlap scheduling); a wait near zero
means the host is. Then prints a cProfile of one more call (host functions by own and total time).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from typing import Any

from mleagle.engine.contract.config import data_dir
from mleagle.engine.entrypoints.bench import read_first_turns
from mleagle.engine.entrypoints.bench_gpu import encode_texts, engine_for, gen_once
from mleagle.engine.executor import worker as W


def main(draft: str) -> None:
    texts = read_first_turns("mt_bench", data_dir(None))[:8]
    e = engine_for("smollm2-135m", 1, 256, 512, draft=draft, spec_policy="always")
    prompts = encode_texts(e, texts)
    wait = [0.0, 0]
    orig = W.TargetWorker.finish

    def finish(self: W.TargetWorker, p: W.Pending) -> Any:
        if p.done is not None:
            t = time.perf_counter()
            p.done.synchronize()
            wait[0] += time.perf_counter() - t
            wait[1] += 1
        return orig(self, p)

    W.TargetWorker.finish = finish  # type: ignore[method-assign]
    gen_once(e, [prompts[0]], 32)
    wall, iters = 0.0, 0
    for p in prompts:
        w, t, o = gen_once(e, [p], 256)
        wall += w
        iters += o[0].spec.num_verify if o[0].spec else len(t[0])
    print(f"{draft}: wall {wall * 1e3:.1f} ms, {iters} iterations, {wall / iters * 1e3:.3f} ms/iter wall; "
          f"sync wait {wait[0] * 1e3:.1f} ms over {wait[1]} waits = {wait[0] / max(wait[1], 1) * 1e3:.3f} ms/wait")
    wait[:] = [0.0, 0]
    pr = cProfile.Profile()
    pr.enable()
    w, _, _ = gen_once(e, [prompts[0]], 256)
    pr.disable()
    print(f"under cProfile: wall {w * 1e3:.1f} ms; sync wait {wait[0] * 1e3:.1f} ms over {wait[1]}")
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumtime").print_stats(45)
    print(s.getvalue())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "none")
