"""GPU smoke check of the eager engine (the CUDA-graph and kernel work is the next wave).

Runs the tiny built model on CUDA in float32 and bfloat16: target-only vs speculative greedy output
(exactness on the device), seeded sampling reproducibility, pools free afterwards, and float32 CUDA
logits against the CPU reference. Prints a short table; writes JSON to $OUT (or ./gpu_smoke.json).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine

PROMPTS = [[3, 9, 27, 81, 5, 15, 45, 135], [7, 1, 4], list(range(10, 60))]


def main() -> int:
    assert torch.cuda.is_available(), "needs CUDA"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    res: dict[str, object] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    greedy = SamplingParams(max_new_tokens=32, temperature=0)
    for dtype in ("float32", "bfloat16"):
        t0 = time.perf_counter()
        base = Engine("tiny-dummy", device="cuda", dtype=dtype)
        want = [c.token_ids for c in base.generate(PROMPTS, greedy)]
        for draft in ("random:1", "random:3", "random:3:1:nochain"):
            e = Engine("tiny-dummy", device="cuda", dtype=dtype, draft=draft)
            got = [c.token_ids for c in e.generate(PROMPTS, greedy)]
            free = not e.mem.idle_problems()  # free, or held only by the prefix cache (unlocked)
            res[f"{dtype}/{draft}/exact"] = got == want
            res[f"{dtype}/{draft}/pools_free"] = free
        sp = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7)
        a = base.generate([PROMPTS[0]], sp)[0].token_ids
        b = base.generate([PROMPTS[1], PROMPTS[0]], sp)[1].token_ids
        res[f"{dtype}/seeded_batch_invariant"] = a == b
        res[f"{dtype}/seconds"] = round(time.perf_counter() - t0, 2)
    # float32 CUDA logits vs the CPU reference on the same weights (dummy weights are seeded).
    cpu, gpu = Engine("tiny-dummy"), Engine("tiny-dummy", device="cuda")
    outs = []
    for e in (cpu, gpu):
        e.add_request("r", PROMPTS[2], SamplingParams(max_new_tokens=2, temperature=0))
        req = e.scheduler.reqs["r"]
        assert e.mem.ensure(req, len(PROMPTS[2]))  # the slots a scheduled prefill would hold
        b = e.worker.prefill_batch([req], [len(PROMPTS[2])])
        outs.append(e.target.forward(b).logits.cpu())
    rel = float((outs[0] - outs[1]).norm() / outs[0].norm())
    res["float32/cuda_vs_cpu_logits_rel_err"] = rel
    ok = all(v for k, v in res.items() if isinstance(v, bool)) and rel < 1e-4
    for k, v in res.items():
        print(f"{k:45s} {v}")
    out = os.path.join(os.environ.get("OUT", "."), "gpu_smoke.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
