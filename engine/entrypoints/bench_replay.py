"""The offline half of `mleagle bench serve-matrix`: the same prompts at the same concurrency, through the engine alone.

`python -m mleagle.engine.entrypoints.bench_replay --spec SPEC.json --out OUT.json` builds the engine
of one served configuration (the spec carries it as the JSON the daemon hands its engine process,
`MleagleConfig.for_engine()`), warms it up as the engine process does before it reports ready, then
runs the spec's warm-up prompts and each timed run as a closed loop: `concurrency` requests in flight
through `add_request`/`step`, the next prompt added as soon as one finishes, with the sampling
parameters the daemon derived from the benchmark's own request body. Prompts are tokenized before the
clock starts (as the daemon's chat endpoint does, `Engine.encode_prompt`), so what is timed is engine
scheduling and compute only: no HTTP, no IPC, no detokenization. It writes per request the time to
first token, the gaps between deltas that carried tokens (the daemon streams one chunk per such
delta), end-to-end time and token counts, for the matrix to summarize with `bench serve`'s own
definitions. It runs in its own process so that its device memory is gone before the next server
starts, and the benchmark client itself never imports torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mleagle.engine.contract.config import MleagleConfig
from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.errors import EngineInputError


def closed_loop(engine: Any, prompts: Sequence[list[int]], params: SamplingParams, conc: int,
                tag: str) -> dict[str, Any]:
    """Run `prompts` (token ids) keeping `conc` in flight, in order; returns the wall time and one
    record per request (the fields of `bench_serve.Result`)."""
    n = len(prompts)
    recs: list[dict[str, Any]] = [{"ok": False, "error": "", "ttft": 0.0, "e2e": 0.0, "itl": [],
                                   "prompt_tokens": len(p), "output_tokens": 0, "chunks": 0} for p in prompts]
    t_add = [0.0] * n
    last: list[float | None] = [None] * n
    live: dict[str, int] = {}
    nxt = 0
    st0 = engine.stats()
    t0 = time.perf_counter()
    while nxt < n or live:
        while nxt < n and len(live) < conc:
            rid = f"{tag}-{nxt}"
            t_add[nxt] = time.perf_counter()
            recs[nxt]["t_send"] = time.monotonic()
            try:
                engine.add_request(rid, prompts[nxt], params)
                live[rid] = nxt
            except EngineInputError as e:  # the server would answer 400: a failed request
                recs[nxt]["error"] = f"input: {e}"
            nxt += 1
        if not live:
            continue
        for out in engine.step():
            i = live.get(out.rid)
            if i is None:
                continue
            now = time.perf_counter()
            r = recs[i]
            if out.token_ids:
                prev = last[i]
                if prev is None:
                    r["ttft"] = now - t_add[i]
                    r["t_first"] = time.monotonic()
                else:
                    r["itl"].append(now - prev)
                last[i] = now
                r["chunks"] += 1
                r["output_tokens"] += len(out.token_ids)
            if out.finished:
                r["e2e"] = now - t_add[i]
                r["ok"] = out.error is None and out.finish_reason != "error"
                r["error"] = out.error or ""
                del live[out.rid]
    dur = time.perf_counter() - t0
    st = engine.stats()
    # Overlap scheduling launches a step past the last finish; collect it outside the clock (as
    # `Engine.stream` does), so the next run starts on an idle engine.
    while engine.has_work():
        engine.step()
    # (the iteration counters before and after, for `bench serve`'s `iteration_summary` of the run)
    keep = ("iterations", "iteration_rows", "device_busy_s", "device_busy_iterations")
    return {"concurrency": conc, "duration_s": dur, "requests": recs,
            "engine_before": {k: st0.get(k) for k in keep}, "engine_after": {k: st.get(k) for k in keep}}


def replay(spec: dict[str, Any]) -> dict[str, Any]:
    from mleagle.engine.entrypoints.bench_gpu import machine
    from mleagle.engine.service.tp_driver import start_engine

    cfg = MleagleConfig.model_validate_json(spec["config"])
    params = SamplingParams.model_validate(spec["params"])
    chat = bool(spec["chat"])
    t0 = time.perf_counter()
    engine = start_engine(cfg)
    try:
        load_s = time.perf_counter() - t0
        # The engine process warms up the same way before a server reports ready.
        warm_s = engine.warm_up() if cfg.server.warm_up else 0.0
        enc = {p: engine.encode_prompt(p, chat) for r in [spec["warmup"], *spec["runs"]] for p in r["prompts"]}
        out: dict[str, Any] = {"machine": machine(), "model": engine.model_name, "device": str(engine.device),
                               "dtype": str(engine.dtype).removeprefix("torch."), "draft": cfg.engine.draft,
                               "load_s": load_s, "engine_warm_up_s": warm_s, "runs": []}
        w = spec["warmup"]
        if w["prompts"]:
            print(f"bench_replay: warm-up, {len(w['prompts'])} requests", file=sys.stderr, flush=True)
            ws = closed_loop(engine, [enc[p] for p in w["prompts"]], params, w["concurrency"], "w")
            out["warmup"] = {"concurrency": ws["concurrency"], "duration_s": ws["duration_s"],
                             "completed": sum(r["ok"] for r in ws["requests"])}
        for k, run in enumerate(spec["runs"]):
            c = run["concurrency"]
            print(f"bench_replay: concurrency {c}, {len(run['prompts'])} requests", file=sys.stderr, flush=True)
            out["runs"].append(closed_loop(engine, [enc[p] for p in run["prompts"]], params, c, f"r{k}"))
        out["stats"] = json.loads(json.dumps(engine.stats(), default=str))
        return out
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mleagle.engine.entrypoints.bench_replay", description=__doc__)
    ap.add_argument("--spec", required=True, help="JSON: config, params, chat, warmup, runs")
    ap.add_argument("--out", required=True, help="where the results go (JSON)")
    a = ap.parse_args(argv)
    res = replay(json.loads(Path(a.spec).read_text()))
    Path(a.out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
