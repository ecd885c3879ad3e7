"""Where the engine spends a request's time to first token at concurrency 1. On a CUDA machine, from the
repository root: `python scripts/first_token_profile.py [--draft DRAFT] [--prompts N] [--out FILE]`.

The server's TTFT split (`bench serve`, "TTFT split in the server") says how long a request waits in
the engine's `prefill` phase: from its admission to its first tokens. This looks inside that phase:
one request at a time through `Engine.add_request`/`step` (SmolLM2-135M, the first N MT-Bench first
turns through the chat template, greedy, 16 new tokens each), twice over the prompts (the second pass
hits the prefix cache, as repeated prompts do in the served benchmark). Per pass it prints the time
from `add_request` to the step that returned the first token (median, p90) and how many steps that
took; then a third pass under cProfile, of only those steps: host functions by total and by own time. Every shape is
warmed first (`Engine.warm_up` and one pass that is not timed).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from typing import Any

from mleagle.engine.contract.config import data_dir
from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.entrypoints.bench import read_first_turns
from mleagle.engine.entrypoints.bench_gpu import encode_texts, engine_for


def one_pass(e: Any, prompts: list[list[int]], tag: str, prof: cProfile.Profile | None) -> dict[str, Any]:
    sp = SamplingParams(temperature=0, max_new_tokens=16)
    ttft, steps = [], []
    for i, p in enumerate(prompts):
        rid = f"{tag}-{i}"
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        e.add_request(rid, p, sp)
        n, first = 0, None
        while first is None:
            outs = e.step()
            n += 1
            if any(o.rid == rid and o.token_ids for o in outs):
                first = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
        ttft.append(first)
        steps.append(n)
        while e.has_work():  # the rest of the request, not timed
            e.step()
    s = sorted(ttft)
    return {"ttft_ms_p50": 1e3 * statistics.median(s), "ttft_ms_p90": 1e3 * s[int(0.9 * (len(s) - 1))],
            "ttft_ms_min": 1e3 * s[0], "steps_to_first_token": statistics.mean(steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="none", help="none, or a draft folder (its policy: auto)")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args()
    texts = read_first_turns("mt_bench", data_dir(None))[: a.prompts]
    e = engine_for("smollm2-135m", 8, 16, 512, draft=a.draft)
    e.warm_up()
    prompts = encode_texts(e, texts)
    one_pass(e, prompts, "warm", None)  # every prompt's shapes met once
    e.reset_prefix_cache()
    rep: dict[str, Any] = {"draft": a.draft, "prompts": len(prompts), "passes": {}}
    for tag in ("cold", "cached"):  # timed without the profiler
        rep["passes"][tag] = one_pass(e, prompts, tag, None)
        print(f"{tag}: {json.dumps(rep['passes'][tag])}", flush=True)
    prof = cProfile.Profile()
    rep["passes"]["profiled"] = one_pass(e, prompts, "profiled", prof)  # cached prefixes, under cProfile
    print(f"profiled (cached): {json.dumps(rep['passes']['profiled'])}", flush=True)
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(28)
        print(f"--- by {key} (over {len(prompts)} requests' steps to their first token)")
        print("\n".join(buf.getvalue().splitlines()[6:]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
