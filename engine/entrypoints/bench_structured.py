"""`mleagle bench structured`: what a JSON-schema constraint costs, with and without the draft.

One process holds two engines of the same model, target-only and speculative (`--draft`), and runs
the same prompts on each, unconstrained and under one JSON schema (nested object, enum, bounded
integers and strings, an array), greedy, at each `--batch`: generated tokens per second, the
acceptance length (spec), and the grammar's host cost per step (mask fills, matcher accepts and
rollbacks, from `ConstrainRuntime.host_s` over its steps). Time to first token of a single request
is measured unconstrained, with a schema never seen before (a unique property name, so it compiles),
and with the same schema again (the compile cache serves it), the prefix cache emptied before each. The prompts are synthetic ("Describe
<topic> as a JSON object.", `TOPICS`), built in; the chat template applies. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from mleagle.engine.contract.cli_flags import add_device_args, resolve_device
from mleagle.engine.entrypoints.bench import cpu_name

TOPICS = ["a person", "a city", "a book", "a car", "a movie", "a restaurant", "a laptop", "a football team",
          "a planet", "a song", "a dog", "a hotel"]


def schema(tag: str = "") -> dict[str, Any]:
    """The benchmark's schema; `tag` adds a property of that name (a new schema, so a new compile)."""
    props: dict[str, Any] = {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["person", "place", "thing", "other"]},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "rating": {"type": "integer", "minimum": 1, "maximum": 10},
        "details": {"type": "object", "properties": {
            "summary": {"type": "string", "maxLength": 60},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
            "required": ["summary", "tags"]},
    }
    if tag:
        props[tag] = {"type": "boolean"}
    return {"type": "object", "properties": props, "required": list(props)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mleagle bench structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft", default="drafts/smollm2-135m-mtp3")
    p.add_argument("--policies", default="auto", help="comma-separated speculation policies, a spec engine each")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_device_args(p, "cpu", "float32")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--batch", default="1,4", help="comma-separated batch sizes")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ttft-reps", type=int, default=10)
    p.add_argument("--out", default="results/bench_structured_cpu.json")
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from mleagle.engine.contract.sampling_params import SamplingParams, StructuredOutputs
    from mleagle.engine.core.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = resolve_device(args.device, args.dtype)
    engines = {"target-only": Engine(args.model, draft="none", device=device, dtype=dtype)}
    for pol in args.policies.split(","):
        engines["spec" if pol == "auto" else f"spec-{pol}"] = Engine(args.model, draft=args.draft, device=device,
                                                                     dtype=dtype, spec_policy=pol)
    tok = engines["target-only"].tokenizer
    assert tok is not None
    prompts = [tok.encode_chat([{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as a JSON object."}])
               for i in range(args.prompts)]
    so = StructuredOutputs.model_validate({"json": schema()})
    modes = {"free": SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens),
             "json_schema": SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens, structured_outputs=so)}
    for e in engines.values():  # warm-up: first-call costs, xgrammar's import, the schema's compile
        e.generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=4))
        e.generate(prompts[:1], modes["json_schema"].model_copy(update={"max_new_tokens": 4}))
    outputs: dict[str, list[list[int]]] = {}
    runs: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    # Rounds, each running every configuration once, so a shared machine's drift hits all of them alike;
    # a configuration's figure is its median round.
    for rnd in range(args.rounds):
        for bs in [int(x) for x in args.batch.split(",")]:
            for mode, sp in modes.items():
                for name, e in engines.items():
                    w = e.worker
                    rt = w.constrain
                    h0, s0 = rt.host_s, rt.host_steps
                    st = getattr(w, "stats", None)
                    v0, a0 = (st.num_verify, st.num_accepted_tokens) if st is not None else (0, 0)
                    m0 = _masked(e)
                    toks, outs = 0, []
                    t0 = time.perf_counter()
                    for i in range(0, len(prompts), bs):
                        for c in e.generate(prompts[i : i + bs], sp):
                            toks += len(c.token_ids)
                            outs.append(c.token_ids)
                    dt = time.perf_counter() - t0
                    outputs[f"{name}/{mode}/bs{bs}"] = outs
                    steps = rt.host_steps - s0
                    run_ = {"tokens": toks, "seconds": dt, "host_s": rt.host_s - h0, "steps": steps,
                            "masked_replays": {d: n - m0.get(d, 0) for d, n in _masked(e).items()}}
                    if st is not None:
                        run_["verify"], run_["accepted"] = st.num_verify - v0, st.num_accepted_tokens - a0
                    runs.setdefault((bs, mode, name), []).append(run_)
                    print(f"  round {rnd} bs {bs} {mode:11s} {name:11s} {toks / dt:7.1f} tok/s  {toks} tokens", flush=True)
    rows: list[dict[str, Any]] = []
    for (bs, mode, name), rs in runs.items():
        tps = sorted(r["tokens"] / r["seconds"] for r in rs)
        steps = sum(r["steps"] for r in rs)
        row = {"batch": bs, "mode": mode, "engine": name, "tokens": rs[0]["tokens"],
               "tok_s": round(statistics.median(tps), 2), "tok_s_rounds": [round(x, 2) for x in tps],
               "grammar_host_ms_per_step": round(1e3 * sum(r["host_s"] for r in rs) / steps, 3) if steps else None,
               "grammar_steps": steps // len(rs),
               # Iterations on the grammar-masked graphs by depth (0: decode steps; S: the masked chain), a round.
               "masked_replays": rs[0]["masked_replays"]}
        if "verify" in rs[0]:
            nv, na = sum(r["verify"] for r in rs), sum(r["accepted"] for r in rs)
            row["accept_len"] = round((na + nv) / nv, 3) if nv else None
        rows.append(row)
    # Greedy: the speculative engine must emit what target-only does, constrained or not.
    same = {f"{name}/{k.split('/', 1)[1]}": outputs[k] == outputs[f"{name}/" + k.split("/", 1)[1]]
            for k in outputs if k.startswith("target-only/") for name in engines if name != "target-only"}
    # TTFT of one request (target-only engine): free, a new schema (compiled now), the same schema cached.
    e = engines["target-only"]
    one = SamplingParams(temperature=0, max_new_tokens=1)
    ttft: dict[str, list[float]] = {"free": [], "new_schema": [], "cached_schema": []}
    for r in range(args.ttft_reps):
        new = StructuredOutputs.model_validate({"json": schema(f"extra_{time.time_ns()}_{r}")})
        cases = [("free", one), ("new_schema", one.model_copy(update={"structured_outputs": new})),
                 ("cached_schema", one.model_copy(update={"structured_outputs": new}))]
        if r % 2:  # the cached schema needs the new one first; free goes first or last in turn
            cases = cases[1:] + cases[:1]
        for key, p in cases:
            e.reset_prefix_cache()  # every request computes its whole prompt: only the schema differs
            t0 = time.perf_counter()
            for _i, d in e.stream([prompts[r % len(prompts)]], p):
                if d.token_ids:
                    break
            ttft[key].append(time.perf_counter() - t0)
    g = e.worker.constrain.grammars
    result: dict[str, Any] = {
        "machine": {"cpu": (cpu_name() or "unknown"), "cores": torch.get_num_threads(), "torch": torch.__version__,
                    "platform": platform.platform(),
                    "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None},
        "model": args.model, "draft": args.draft, "dtype": dtype, "device": device,
        "data": f"{args.prompts} synthetic prompts 'Describe <topic> as a JSON object.' (bench_structured.TOPICS), chat template",
        "max_new_tokens": args.max_new_tokens, "greedy": True, "rounds": args.rounds, "schema": schema(),
        "rows": rows, "spec_equals_target_only": same,
        "ttft_ms_median": {k: round(1e3 * statistics.median(v), 2) for k, v in ttft.items()},
        "ttft_ms_all": {k: [round(1e3 * x, 2) for x in v] for k, v in ttft.items()},
        "compile_ms_mean": round(1e3 * g.compile_s / g.misses, 2) if g.misses else None,
        "compile_cache": {"hits": g.hits, "misses": g.misses},
    }
    print(f"\n{'batch':>5} {'mode':11} {'engine':11} {'tok/s':>8} {'accept':>7} {'host ms/step':>13}  masked by depth")
    for row in rows:
        acc = f"{row['accept_len']:.2f}" if row.get("accept_len") else "-"
        host = f"{row['grammar_host_ms_per_step']:.3f}" if row["grammar_host_ms_per_step"] is not None else "-"
        print(f"{row['batch']:>5} {row['mode']:11} {row['engine']:11} {row['tok_s']:>8.1f} {acc:>7} {host:>13}  "
              f"{row['masked_replays'] or '-'}")
    print(f"\nTTFT median (ms): {result['ttft_ms_median']}; compile {result['compile_ms_mean']} ms per new schema")
    print(f"spec output equals target-only (greedy): {same}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _masked(e: Any) -> dict[int, int]:
    """Iterations the engine ran on its grammar-masked graphs so far, by depth."""
    return dict(e.graph_counts().get("masked", {}).get("by_depth", {}))


def main(argv: list[str]) -> int:
    return run(build_parser().parse_args(argv))
