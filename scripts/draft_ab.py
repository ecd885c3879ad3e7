"""Drafts compared in one process: batch-1 requests through `Engine.generate`, interleaved.

`mleagle bench gpu` runs each draft in its own process, and on an H200 a speculative engine's batch-1
speed moves by about 5 % from one process to the next (target-only does not): four alternating runs
put one draft 6 % behind another that, served side by side in one process, is 3 % ahead of it. This
script builds one engine per draft (`none` = target-only) in one process, warms each up, then for R
rounds (the engine order reversed every other round) sends each of the first P prompts alone, once for
one token (the request's fixed cost: prefill, the draft layers' prefill, the first token) and once
for N tokens (greedy, ignore_eos). It prints per engine the median first-token wall, the mean wall per
request and per token after the first, the speculative iteration time and accept length, and the
speed-up over target-only by wall per request; `--out` writes every sample as JSON.

`--natural-eos` stops each answer at its end of sequence instead (at most N tokens), as a user's
request does: the tokens after an answer's end, which `ignore_eos` makes every engine generate, are
text no draft was trained on, and they pull the accept length down. Greedy speculation is exact, so
every engine makes the same answers; where bf16 rounding makes one end elsewhere, the speed-up by
output tokens per second (printed beside the one by wall) still compares like with like.

Each draft runs at its full depth every iteration (`always`), unless its entry names a policy:
`PATH@auto` serves it as a server does (the engine's warm-up first, so the policy's timing at start-up
runs too), and `PATH@auto=0/3/5` adds the depths `auto` chooses between (`spec_depths`).

    python scripts/draft_ab.py --drafts none,drafts/smollm2-135m-mtp3,OTHER --rounds 4 --out ab.json
    python scripts/draft_ab.py --drafts none,drafts/smollm2-135m-mtp5,drafts/smollm2-135m-mtp5@auto=0/3/5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def build(engine_for: Any, model: str, n: int, entry: str) -> Any:
    """The engine of one `--drafts` entry: `PATH` at its full depth every iteration (this compares
    drafts, not the speculation policy), or `PATH@POLICY[=D/D/...]`, warmed up as a server is."""
    path, _, spec = entry.partition("@")
    policy, _, depths = spec.partition("=")
    over: dict[str, Any] = {"spec_policy": policy or "always"}
    if depths:
        over["spec_depths"] = [int(x) for x in depths.split("/")]
    e = engine_for(model, 1, n, 512, draft=path, **over)
    if policy:
        e.warm_up()
    return e


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafts", required=True, help="comma list of draft folders; `none` is target-only")
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--prompts", type=int, default=8, help="the first P first turns")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--natural-eos", action="store_true",
                    help="stop each answer at its end of sequence (default: ignore_eos, N tokens each)")
    ap.add_argument("--out", default=None, help="JSON with every sample")
    a = ap.parse_args(argv)
    ignore = not a.natural_eos
    from mleagle.engine.contract.config import data_dir
    from mleagle.engine.entrypoints.bench import read_first_turns
    from mleagle.engine.entrypoints.bench_gpu import encode_texts, engine_for, gen_once, machine

    drafts = a.drafts.split(",")
    n = a.max_new_tokens
    if n < 2:
        ap.error("--max-new-tokens must be at least 2 (the first token is timed apart)")
    texts = read_first_turns(a.dataset, data_dir(None))[: a.prompts]
    engines = {d: build(engine_for, a.model, n, d) for d in drafts}
    prompts = encode_texts(next(iter(engines.values())), texts)
    samples: dict[str, list[dict[str, Any]]] = {d: [] for d in drafts}
    for e in engines.values():  # warm-up: Triton JIT, cuBLAS heuristics, graph capture
        for p in prompts[:2]:
            gen_once(e, [p], 16)
    for r in range(a.rounds):
        for d in drafts if r % 2 == 0 else drafts[::-1]:
            for i, p in enumerate(prompts):
                first = gen_once(engines[d], [p], 1)[0]
                wall, toks, outs = gen_once(engines[d], [p], n, ignore_eos=ignore)
                s = outs[0].spec
                row = {"round": r, "prompt": i, "first_s": first, "wall_s": wall, "tokens": len(toks[0])}
                if s is not None:
                    row |= {"verifies": s.num_verify, "accepted": s.num_accepted_tokens}
                samples[d].append(row)
    def tok_s(rows: list[dict[str, Any]]) -> float:
        return sum(x["tokens"] for x in rows) / sum(x["wall_s"] for x in rows)

    base = statistics.mean(x["wall_s"] for x in samples["none"]) if "none" in samples else None
    base_tps = tok_s(samples["none"]) if "none" in samples else None
    summary = {}
    stop = "natural EOS" if a.natural_eos else "ignore_eos"
    print(f"{machine().get('gpu', 'cpu')}; {a.model}; {a.dataset} first {len(prompts)} first turns, batch 1, "
          f"up to {n} new tokens, greedy, {stop}; {a.rounds} rounds, one process\n")
    print("| engine | first token ms (median) | tokens/request | wall/request ms | ms/token after the first | ms/iteration | "
          "accept length | vs target-only (wall) | vs target-only (tok/s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for d, rows in samples.items():
        wall = statistics.mean(x["wall_s"] for x in rows)
        steady = statistics.mean((x["wall_s"] - x["first_s"]) / (x["tokens"] - 1) for x in rows)
        s = {"first_token_ms": 1e3 * statistics.median(x["first_s"] for x in rows),
             "tokens_per_request": statistics.mean(x["tokens"] for x in rows), "wall_per_request_ms": 1e3 * wall,
             "ms_per_token_after_first": 1e3 * steady, "speedup": base / wall if base else None,
             "speedup_tok_s": tok_s(rows) / base_tps if base_tps else None}
        v = sum(x.get("verifies", 0) for x in rows)  # a request `auto` served without drafts has none
        if v:
            acc = sum(x.get("accepted", 0) for x in rows)
            s["accept_len"] = (acc + v) / v
            s["ms_per_iteration"] = 1e3 * sum(x["wall_s"] - x["first_s"] for x in rows) / v  # every verify follows the first token
        summary[d] = {k: round(x, 4) if isinstance(x, float) else x for k, x in s.items()}
        f = summary[d]
        up = f"{f['speedup']:.3f}x" if f["speedup"] else "-"
        up_t = f"{f['speedup_tok_s']:.3f}x" if f["speedup_tok_s"] else "-"
        print(f"| {d} | {f['first_token_ms']:.2f} | {f['tokens_per_request']:.1f} | {f['wall_per_request_ms']:.1f} | "
              f"{f['ms_per_token_after_first']:.4f} | {f.get('ms_per_iteration', '-')} | {f.get('accept_len', '-')} | {up} | {up_t} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"machine": machine(), "model": a.model, "dataset": a.dataset,
                                           "prompts": len(prompts), "max_new_tokens": n, "rounds": a.rounds,
                                           "ignore_eos": ignore,
                                           "summary": summary, "samples": samples}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
