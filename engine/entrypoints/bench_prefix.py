"""`mleagle bench prefix`: what the prefix cache saves, cache on against cache off in the same run.

Two engines of the same model and settings live in one process, one with the prefix cache and one
without, and every workload runs on both, request by request in alternating order (so drift in the
machine's load hits both alike), through `Engine.stream`, the offline API users call. Workloads:
MT-Bench conversations (turn 1, then turn 2 resending turn 1's question and answer through the chat
template, as a chat client does), and a shared system prompt of `--system-tokens` tokens in front of
MT-Bench questions, sent one at a time and as one batch. Figures: time to first token, prompt tokens
the engine computed (prompt minus cached), and, with `--draft`, acceptance on the same requests with
and without the cache (every greedy output must match between the two engines; the run reports it).
`--tiny-acceptance` adds the acceptance measurement on a small built model with a draft trained here
by `mleagle.engine.spec.train` (SmolLM2 has no trained draft yet). Prints tables, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mleagle.engine.contract.cli_flags import DTYPES
from mleagle.engine.contract.config import data_dir


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mleagle bench prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="auto or a dtype (default float32)")
    p.add_argument("--data-dir", default=None, help="default: $MLEAGLE_DATA_DIR or ../shared/data from the repo root")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--conversations", type=int, default=12, help="MT-Bench conversations (two turns each)")
    p.add_argument("--turn1-tokens", type=int, default=64, help="answer length of turn 1 (the context turn 2 resends)")
    p.add_argument("--turn2-tokens", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=500, help="length of the shared system prompt")
    p.add_argument("--system-requests", type=int, default=12, help="requests behind the shared system prompt")
    p.add_argument("--system-batch", type=int, default=8, help="the batched shared-system-prompt run's size")
    p.add_argument("--system-new-tokens", type=int, default=8)
    p.add_argument("--draft", default=None, help="PATH | random:S | none: acceptance on hits vs misses")
    p.add_argument("--spec-steps", type=int, default=None)
    p.add_argument("--tiny-acceptance", action="store_true",
                   help="also train a draft for a small built model and measure its acceptance on hits vs misses")
    p.add_argument("--tiny-train-steps", type=int, default=400)
    p.add_argument("--out", default="results/bench_prefix_cache.json")
    return p


# --- inputs ----------------------------------------------------------------------------------------------
def mt_bench(ddir: Path) -> list[list[str]]:
    f = ddir / "mt_bench.jsonl"
    if not f.is_file():
        raise ValueError(f"{f} not found: pass --data-dir or set MLEAGLE_DATA_DIR")
    return [json.loads(x)["turns"] for x in f.read_text(encoding="utf-8").splitlines() if x.strip()]


def chat_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    return tok.encode_chat(messages)


def system_prompt(tok: Any, n: int, ddir: Path) -> str:
    """A support-desk style system prompt of exactly `n` tokens: instructions, then reference notes
    (AlpacaEval instructions, as stand-in documents), cut at a token boundary that re-encodes the same."""
    head = ("You are the assistant of a software company's support desk. Be accurate and brief, say when you "
            "do not know, and use the reference notes below when they apply.\n\nReference notes:\n")
    rows = [json.loads(x) for x in (ddir / "alpaca_eval.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]
    notes = "\n".join(f"- {r.get('prompt') or r.get('instruction')}" for r in rows[:200])
    ids = tok.encode(head + notes, add_special_tokens=False)
    for m in range(n, n - 32, -1):  # a cut whose text re-encodes to exactly m tokens
        text = tok.decode(ids[:m])
        if len(tok.encode(text, add_special_tokens=False)) == n:
            return text
    raise ValueError(f"could not cut a system prompt of {n} tokens")


# --- timing the offline API ----------------------------------------------------------------------------
def timed(engine: Any, prompts: list[list[int]], sp: Any) -> list[dict[str, Any]]:
    """Submit `prompts` together through `Engine.stream`; per request: time to first token (from the
    submission), end to end, its tokens, cached prompt tokens and speculative statistics."""
    t0 = time.perf_counter()
    recs: list[dict[str, Any]] = [{"prompt_tokens": len(p), "token_ids": []} for p in prompts]
    for i, o in engine.stream(prompts, sp):
        r = recs[i]
        if o.token_ids and "ttft_s" not in r:
            r["ttft_s"] = time.perf_counter() - t0
        r["token_ids"] += o.token_ids
        r["cached_tokens"] = o.num_cached_tokens
        if o.finished:
            r["e2e_s"] = time.perf_counter() - t0
            r["finish_reason"] = o.finish_reason
            r["spec"] = o.spec.summary() if o.spec is not None else None
    for r in recs:
        r["computed_tokens"] = r["prompt_tokens"] - r["cached_tokens"]
    return recs


def pair(engines: dict[str, Any], prompts: list[list[int]], sp: Any, flip: bool) -> dict[str, list[dict[str, Any]]]:
    """The same submission on both engines, in alternating order across calls."""
    order = ["off", "on"] if flip else ["on", "off"]
    return {k: timed(engines[k], prompts, sp) for k in order}


def summary(recs: list[dict[str, Any]]) -> dict[str, Any]:
    tt = [r["ttft_s"] for r in recs]
    out: dict[str, Any] = {
        "requests": len(recs), "ttft_mean_ms": 1000 * statistics.fmean(tt), "ttft_median_ms": 1000 * statistics.median(tt),
        "prompt_tokens": sum(r["prompt_tokens"] for r in recs), "cached_tokens": sum(r["cached_tokens"] for r in recs),
        "computed_tokens": sum(r["computed_tokens"] for r in recs),
    }
    specs = [r["spec"] for r in recs if r.get("spec")]
    if specs:
        nv = sum(s["num_verify"] for s in specs)
        depth = max(len(s["accepted_per_depth"]) for s in specs)
        per = [sum(s["accepted_per_depth"][d] for s in specs) for d in range(depth)]
        out["accept_len"] = (sum(s["num_accepted_tokens"] for s in specs) + nv) / max(nv, 1)
        out["accept_rate_per_depth"] = [x / max(nv, 1) for x in per]
        out["num_verify"] = nv
    return out


def compare(res: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    on, off = summary(res["on"]), summary(res["off"])
    mism = sum(a["token_ids"] != b["token_ids"] for a, b in zip(res["on"], res["off"]))
    return {"on": on, "off": off, "ttft_speedup": off["ttft_mean_ms"] / on["ttft_mean_ms"],
            "outputs_equal": len(res["on"]) - mism, "outputs": len(res["on"])}


# --- workloads -----------------------------------------------------------------------------------------
def multi_turn(engines: dict[str, Any], tok: Any, convs: list[list[str]], n1: int, n2: int,
               sp_cls: Any) -> dict[str, Any]:
    """Each conversation alone: turn 1, then turn 2 = [user q1, assistant a1, user q2] (the answer as
    text, re-encoded by the template, as an OpenAI client resends it)."""
    t1: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    t2: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    resent: list[int] = []
    for i, (q1, q2) in enumerate(convs):
        m1 = [{"role": "user", "content": q1}]
        r1 = pair(engines, [chat_ids(tok, m1)], sp_cls(temperature=0.0, max_new_tokens=n1), i % 2 == 1)
        for k in t1:
            t1[k] += r1[k]
        a1 = tok.decode(r1["on"][0]["token_ids"], skip_special_tokens=True)
        m2 = [*m1, {"role": "assistant", "content": a1}, {"role": "user", "content": q2}]
        p2 = chat_ids(tok, m2)
        r2 = pair(engines, [p2], sp_cls(temperature=0.0, max_new_tokens=n2), i % 2 == 0)
        for k in t2:
            t2[k] += r2[k]
        resent.append(len(chat_ids(tok, m1)) + len(r1["on"][0]["token_ids"]))
        print(f"  conversation {i}: turn 2 prompt {len(p2)} tokens, cached {r2['on'][0]['cached_tokens']}, "
              f"TTFT on {1000 * r2['on'][0]['ttft_s']:.0f} ms / off {1000 * r2['off'][0]['ttft_s']:.0f} ms", file=sys.stderr)
    return {"turn1": compare(t1), "turn2": compare(t2), "turn1_fill_tokens": resent,
            "records": {"turn1": t1, "turn2": t2}}


def shared_system(engines: dict[str, Any], tok: Any, system: str, questions: list[str], n: int, batch: int,
                  sp_cls: Any) -> dict[str, Any]:
    """Requests [system, user q]: one at a time (the first is the cache's cold start), then `batch`
    more at once with the system prompt cached."""
    sp = sp_cls(temperature=0.0, max_new_tokens=n)
    ids = [chat_ids(tok, [{"role": "system", "content": system}, {"role": "user", "content": q}]) for q in questions]
    seq: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    nseq = len(ids) - batch
    for i in range(nseq):
        r = pair(engines, [ids[i]], sp, i % 2 == 1)
        for k in seq:
            seq[k] += r[k]
    cold = {k: seq[k][:1] for k in seq}
    warm = {k: seq[k][1:] for k in seq}
    bat = pair(engines, ids[nseq:], sp, False)
    return {"first_request": compare(cold), "sequential": compare(warm), f"batch_{batch}": compare(bat),
            "system_prompt_tokens": len(tok.encode(system, add_special_tokens=False)),
            "records": {"sequential": seq, "batch": bat}}


# --- acceptance with a trained draft on a small built model -----------------------------------------------
def tiny_acceptance(steps: int, seed: int = 0) -> dict[str, Any]:
    """A 2-layer, 64-wide random Llama (vocab 256, attention and head sharpened so greedy text depends
    on the context), a 2-layer chain draft self-distilled from it by `engine.spec.train` here, then the
    same conversations (and a shared 200-token system prompt) on a cache-on and a cache-off engine."""
    import numpy as np
    import torch

    from mleagle.engine.contract.config import EngineConfig, MleagleConfig, ModelArch, ModelSource
    from mleagle.engine.contract.sampling_params import SamplingParams
    from mleagle.engine.core.engine import Engine
    from mleagle.engine.spec import train as T
    from mleagle.engine.spec.checkpoint import save_draft
    from mleagle.engine.spec.train_data import Seq

    arch = ModelArch(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=1024)
    cfg = MleagleConfig(model=ModelSource(name="tiny-chaotic", load_format="dummy", arch=arch),
                        engine=EngineConfig(max_total_tokens=32768, max_context_len=1024))

    def make(**over: Any) -> Engine:
        e = Engine(cfg, **over)
        with torch.no_grad():  # the sharpening of tests/spec_helpers.chaos
            for layer in e.model.layers:
                a = layer.self_attn
                a.qkv_proj.weight[: (a.hq + a.hk) * a.d] *= 8.0
            e.model.lm_head.weight.mul_(25.0)
        return e

    rng = random.Random(seed)
    g = SamplingParams(temperature=0.0, max_new_tokens=48)
    base = make(enable_prefix_cache=False)
    t0 = time.perf_counter()
    train_p = [[rng.randrange(1, 256) for _ in range(rng.randint(4, 24))] for _ in range(384)]
    outs = [c.token_ids for c in base.generate(train_p, g)]
    seqs = [Seq(np.array(p + o, dtype=np.int64), len(p)) for p, o in zip(train_p, outs)]
    stack = T.init_stack(base.model, 2, "last", 0, T.hidden_rms(base.model, seqs[:-16]))
    # Hard labels on the greedy tokens from the target's last layer, as this benchmark first measured.
    tr = T.Trainer(base.model, stack, seqs[:-16], T.TrainConfig(layers=2, steps=steps, epochs=1e9, lr=3e-3, warmup=20,
                                                                batch_tokens=2048, kl_weight=0.0, ce_weight=1.0,
                                                                init="last", log_every_s=1e9))
    tr.run()
    held = tr.evaluate(seqs[-16:])
    train_s = time.perf_counter() - t0
    res: dict[str, Any] = {"model": "tiny-chaotic (vocab 256, hidden 64, 2 layers, float32)",
                           "draft": "2-layer chain, self-distilled here", "train_steps": steps,
                           "train_s": round(train_s, 1), "held_out": held}
    with tempfile.TemporaryDirectory(prefix="mleagle-tiny-draft-") as d:
        save_draft(stack, d)
        engines = {"on": make(draft=d), "off": make(draft=d, enable_prefix_cache=False), "on_no_margin": make(draft=d)}
        # Ablation: hits that reuse the whole match, the draft KV of its last S positions included
        # (computed from the owner's continuation). Not a serving option, so swapped in here.
        w = engines["on_no_margin"].worker
        w.__class__ = type("NoMarginSpecWorker", (type(w),), {"prefix_margin": 0})
        convs = [[rng.randrange(1, 256) for _ in range(rng.randint(40, 90))] for _ in range(64)]
        sysp = [rng.randrange(1, 256) for _ in range(200)]
        qs = [sysp + [rng.randrange(1, 256) for _ in range(rng.randint(8, 32))] for _ in range(65)]
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {"turn1": {}, "turn2": {}, "system": {}}
        for k, e in engines.items():
            for i in range(0, len(convs), 8):
                t1 = timed(e, convs[i : i + 8], g)
                runs["turn1"].setdefault(k, []).extend(t1)
                p2 = [c + r["token_ids"] + [3, 1, 4] for c, r in zip(convs[i : i + 8], t1)]
                runs["turn2"].setdefault(k, []).extend(timed(e, p2, g))
            timed(e, qs[:1], g)  # the system prompt's first request: the cache's cold start
            for i in range(1, len(qs), 8):
                runs["system"].setdefault(k, []).extend(timed(e, qs[i : i + 8], g))
    for name, r in runs.items():
        c, c2 = compare(r), compare({"on": r["on_no_margin"], "off": r["off"]})
        keys = ("accept_len", "accept_rate_per_depth", "num_verify", "cached_tokens", "prompt_tokens")
        res[name] = {"outputs_equal": min(c["outputs_equal"], c2["outputs_equal"]), "outputs": c["outputs"],
                     "on": {x: c["on"][x] for x in keys}, "off": {x: c["off"][x] for x in keys},
                     "on_no_margin": {x: c2["on"][x] for x in keys}}
    return res


# --- report ------------------------------------------------------------------------------------------------
def table(rep: dict[str, Any]) -> str:
    lines = ["| workload | requests | cache | TTFT mean ms | TTFT median ms | prompt tokens | cached | computed "
             "| TTFT off/on | outputs equal | accept_len |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def rows(name: str, c: dict[str, Any]) -> None:
        for k in ("on", "off"):
            s = c[k]
            acc = f"{s['accept_len']:.3f}" if "accept_len" in s else "-"
            lines.append(f"| {name} | {s['requests']} | {k} | {s['ttft_mean_ms']:.1f} | {s['ttft_median_ms']:.1f} "
                         f"| {s['prompt_tokens']} | {s['cached_tokens']} | {s['computed_tokens']} "
                         f"| {c['ttft_speedup']:.2f}x | {c['outputs_equal']}/{c['outputs']} | {acc} |")

    mt = rep["mt_bench"]
    rows("MT-Bench turn 1", mt["turn1"])
    rows("MT-Bench turn 2", mt["turn2"])
    ss = rep["system_prompt"]
    rows("system prompt, first request", ss["first_request"])
    rows("system prompt, one at a time", ss["sequential"])
    b = next(k for k in ss if k.startswith("batch_"))
    rows(f"system prompt, batch of {b.split('_')[1]}", ss[b])
    out = "\n".join(lines)
    ta = rep.get("tiny_acceptance")
    if ta:
        out += ("\n\n| tiny model + trained draft | cache | cached / prompt tokens | accept_len | acceptance per depth "
                "| verifies | outputs equal |\n|---|---|---:|---:|---|---:|---:|")
        for w in ("turn1", "turn2", "system"):
            for k in ("on", "on_no_margin", "off"):
                s = ta[w][k]
                out += (f"\n| {w} | {k} | {s['cached_tokens']}/{s['prompt_tokens']} | {s['accept_len']:.3f} | "
                        f"{' / '.join(f'{x:.3f}' for x in s['accept_rate_per_depth'])} | {s['num_verify']} "
                        f"| {ta[w]['outputs_equal']}/{ta[w]['outputs']} |")
    return out


def strip_records(rep: dict[str, Any]) -> dict[str, Any]:
    """The JSON keeps per-request figures but not token ids (they only back the equality check)."""
    def clean(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if k != "token_ids"}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x
    return clean(rep)


def run(a: argparse.Namespace) -> int:
    import torch

    from mleagle.engine.contract.config import load_config
    from mleagle.engine.contract.sampling_params import SamplingParams
    from mleagle.engine.core.engine import Engine
    from mleagle.engine.entrypoints.bench import machine_info

    if a.threads:
        torch.set_num_threads(a.threads)
    ddir = data_dir(a.data_dir)
    convs = mt_bench(ddir)
    if a.conversations + a.system_requests > len(convs):
        raise ValueError(f"--conversations + --system-requests must be at most {len(convs)} (MT-Bench rows)")
    if a.system_requests < a.system_batch + 2:
        raise ValueError("--system-requests must be at least --system-batch + 2 (the rest run one at a time: "
                         "the cold first request and at least one warm one)")
    cfg = load_config(a.model)
    a.dtype = "float32" if a.dtype == "auto" else a.dtype  # this benchmark runs on the CPU
    over: dict[str, Any] = {"dtype": a.dtype, "max_running_requests": max(a.system_batch, 8)}
    if a.draft:
        over["draft"] = a.draft
    if a.spec_steps:
        over["spec_steps"] = a.spec_steps
    engines = {"on": Engine(cfg, **over), "off": Engine(cfg, enable_prefix_cache=False, **over)}
    tok = engines["on"].tokenizer
    if tok is None:
        raise ValueError(f"model {cfg.model.name!r} has no tokenizer: the benchmark needs chat prompts")
    rep: dict[str, Any] = {
        "machine": machine_info(torch.get_num_threads()), "model": cfg.model.name, "dtype": a.dtype, "device": "cpu",
        "draft": a.draft or "none", "temperature": 0.0, "engines": "cache on and cache off, same process, alternating",
        "command": "mleagle bench prefix " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "prefix"] else sys.argv[1:]),
        "kv_pool_tokens": engines["on"].allocator.capacity_tokens,
    }
    for e in engines.values():  # warm-up (first-call allocations), then empty caches
        e.generate([chat_ids(tok, [{"role": "user", "content": "Hello"}])], SamplingParams(temperature=0, max_new_tokens=2))
        e.reset_prefix_cache()
    print(f"MT-Bench, {a.conversations} conversations, turn 1 {a.turn1_tokens} + turn 2 {a.turn2_tokens} new tokens",
          file=sys.stderr)
    rep["mt_bench"] = multi_turn(engines, tok, convs[: a.conversations], a.turn1_tokens, a.turn2_tokens, SamplingParams)
    rep["mt_bench"]["settings"] = {"conversations": a.conversations, "turn1_tokens": a.turn1_tokens,
                                   "turn2_tokens": a.turn2_tokens, "batch_size": 1}
    for e in engines.values():
        e.reset_prefix_cache()
    print(f"shared system prompt of {a.system_tokens} tokens, {a.system_requests} requests", file=sys.stderr)
    qs = [c[0] for c in convs[a.conversations : a.conversations + a.system_requests]]
    rep["system_prompt"] = shared_system(engines, tok, system_prompt(tok, a.system_tokens, ddir), qs,
                                         a.system_new_tokens, a.system_batch, SamplingParams)
    rep["system_prompt"]["settings"] = {"requests": a.system_requests, "batch": a.system_batch,
                                        "new_tokens": a.system_new_tokens}
    rep["prefix_cache_stats"] = engines["on"].prefix_cache_stats()
    del engines
    if a.tiny_acceptance:
        print("tiny model: training a draft, then acceptance with the cache on and off", file=sys.stderr)
        rep["tiny_acceptance"] = tiny_acceptance(a.tiny_train_steps)
    rep["machine"]["loadavg_end"] = list(__import__("os").getloadavg())
    print(table(rep))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(strip_records(rep), indent=1) + "\n")
        print(f"wrote {a.out}", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    return run(build_parser().parse_args(argv))
