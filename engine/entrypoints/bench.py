"""`mleagle bench`: offline CPU decode throughput of this engine and of HF transformers, same run.

For each batch size, the same chat prompts (first turn of a benchmark set under the shared data
directory, chat template applied) go through the engine (continuous batching, `ignore_eos`, exactly
`--max-new-tokens` tokens per request) and through HF `LlamaForCausalLM.generate` built from the same
weights (left padding + attention mask, `use_cache=True`, `min_new_tokens = max_new_tokens`). Runs are
interleaved engine/HF per repeat so machine noise hits both alike; the best repeat is reported, every
repeat is kept in the JSON. Prefill and decode are timed apart: the engine by stepping its scheduler,
HF by a logits processor that timestamps every generation step. The report also holds the model load
time (cold: a fresh `MLEAGLE_CACHE_DIR`; warm: the same cache again, each in a subprocess), the weight
bytes over unique storages (a tied head counted once; any parameter not in the requested dtype
flagged), the KV pool bytes (allocated once: the pool tensors must be the same objects after the runs),
peak RSS and, with a draft, acceptance and draft/verify time from each request's spec statistics.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mleagle.engine.contract.cli_flags import add_device_args, add_tp_args, resolve_device, tp_overrides
from mleagle.engine.contract.config import data_dir

DATASETS = {"mt_bench": "mt_bench.jsonl", "gsm8k": "gsm8k_test.jsonl", "alpaca": "alpaca_eval.jsonl"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mleagle bench", description="CPU decode throughput: mleagle vs HF transformers.")
    p.add_argument("--model", default="smollm2-135m")
    add_device_args(p, "cpu", "float32")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--dataset", default="mt_bench", help="mt_bench | gsm8k | alpaca | FILE.jsonl")
    p.add_argument("--data-dir", default=None, help="default: $MLEAGLE_DATA_DIR or ../shared/data from the repo root")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per batch size (best is reported)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool tokens (default: fits the largest batch)")
    p.add_argument("--draft", default=None, help="PATH | random:S[:seed] | none")
    p.add_argument("--spec-steps", type=int, default=None)
    p.add_argument("--spec-policy", choices=["auto", "always", "off", "cycle"], default=None,
                   help="draft steps per iteration: auto (0..S, whatever pays; default), always (S), off (0)")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton", "flashinfer"], default=None,
                   help="auto: triton on CUDA, torch on the CPU")
    add_tp_args(p)
    p.add_argument("--disable-prefix-cache", action="store_true",
                   help="no prefix KV reuse (with it on, every timed run still starts with an empty cache)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-load", action="store_true", help="skip the cold/warm load subprocesses")
    p.add_argument("--out", default="results/bench_cpu.json")
    return p


# --- inputs and machine ------------------------------------------------------------------------
def dataset_rows(name: str, ddir: Path) -> list[dict[str, Any]]:
    """The rows of a known prompt set (in `ddir`) or of a JSONL file."""
    f = ddir / DATASETS[name] if name in DATASETS else Path(name)
    if not f.is_file():
        raise ValueError(f"dataset {name!r}: {f} not found (known: {', '.join(DATASETS)}, or a JSONL path)")
    return [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_first_turns(name: str, ddir: Path) -> list[str]:
    return [row["turns"][0] if "turns" in row else row["prompt"] for row in dataset_rows(name, ddir)]


def read_categories(name: str, ddir: Path) -> list[str | None]:
    """Each row's `category` (MT-Bench: writing, roleplay, ...), None where a row has none; rows in the
    order of `read_first_turns`."""
    return [row.get("category") for row in dataset_rows(name, ddir)]


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def machine_info(threads: int) -> dict[str, Any]:
    import torch

    cpu = cpu_name()
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "threads": threads,
            "python": platform.python_version(), "platform": platform.platform(),
            "loadavg_start": list(os.getloadavg())}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure_load(model: str, dtype: str, cache: str) -> dict[str, float]:
    """Load time in a fresh process with MLEAGLE_CACHE_DIR=cache (first call cold, second warm)."""
    code = (
        "import json,time,sys;t0=time.perf_counter();"
        "from mleagle.engine.core.engine import Engine;t1=time.perf_counter();"
        f"e=Engine({model!r},dtype={dtype!r},max_total_tokens=256,threads=1);t2=time.perf_counter();"
        "print(json.dumps({'import_s':t1-t0,'load_s':e.load_time_s,'engine_init_s':t2-t1}))"
    )
    env = {**os.environ, "MLEAGLE_CACHE_DIR": cache}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"load subprocess failed: {r.stderr.strip().splitlines()[-1:]}")
    return {k: round(v, 3) for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


def weight_report(engine: Any) -> dict[str, Any]:
    """Bytes over unique parameter storages: a tied head and shared tensors count once."""
    import torch

    seen: dict[int, int] = {}
    wrong = []
    for n, p in engine.model.named_parameters(remove_duplicate=False):
        st = p.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        if p.dtype != engine.dtype:
            wrong.append(f"{n}:{p.dtype}")
    naive = sum(p.numel() * p.element_size() for _, p in engine.model.named_parameters(remove_duplicate=False))
    bufs = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in engine.model.buffers()}
    m = engine.model
    return {
        "weights_bytes": sum(seen.values()),
        "weights_bytes_if_tied_copied": naive,
        "num_params": sum(p.numel() for p in m.parameters()),
        "tied_head_shared": bool(getattr(m.lm_head, "weight", None) is getattr(m.embed_tokens, "weight", None)),
        "params_not_in_dtype": wrong,
        "float32_params_in_bf16": engine.dtype != torch.float32 and any(":torch.float32" in w for w in wrong),
        "buffers_bytes": sum(bufs.values()),
    }


def kv_report(engine: Any) -> tuple[dict[str, Any], list[int]]:
    ptrs, total, slots = [], 0, []
    for r in engine.runners:
        pool = r.binding.kv_pool
        total += pool.nbytes
        slots.append(pool.num_slots)
        ptrs += [t.data_ptr() for t in pool.k + pool.v]
    return {"kv_pool_bytes": total, "kv_slots": slots, "runners": [r.name for r in engine.runners]}, ptrs


# --- the two runs ------------------------------------------------------------------------------
def run_engine(engine: Any, prompts: list[list[int]], n: int, temperature: float, seed: int) -> dict[str, Any]:
    from mleagle.engine.contract.outputs import SpecStats
    from mleagle.engine.contract.sampling_params import SamplingParams

    sp = SamplingParams(temperature=temperature, max_new_tokens=n, ignore_eos=True, seed=None)
    engine.reset_prefix_cache()  # repeats run the same prompts: each run starts cold, as HF does
    rids = [f"bench-{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    t0, c0 = time.perf_counter(), time.process_time()
    for i, (rid, ids) in enumerate(zip(rids, prompts)):
        engine.add_request(rid, ids, sp.model_copy(update={"seed": seed + i}) if temperature > 0 else sp)
    toks: dict[str, list[int]] = {r: [] for r in rids}
    specs: list[SpecStats] = []
    t_prefill = None
    steps = decode_steps = 0
    while engine.has_work():
        for o in engine.step():
            toks[o.rid] += o.token_ids
            if o.finished and o.spec is not None:
                specs.append(o.spec)
        steps += 1
        if t_prefill is None:
            if all(toks[r] for r in rids):
                t_prefill, c_prefill = time.perf_counter(), time.process_time()
        elif engine.scheduler.last_mode != "EXTEND":
            decode_steps += 1
    t1, c1 = time.perf_counter(), time.process_time()
    assert t_prefill is not None
    gen = sum(len(v) for v in toks.values())
    first = len(rids)  # first tokens come out of the prefill
    res = {
        "decode_cpu_s": c1 - c_prefill, "decode_tok_per_cpu_s": (gen - first) / max(c1 - c_prefill, 1e-9),
        "prefill_cpu_s": c_prefill - c0,
        "prefill_s": t_prefill - t0, "decode_s": t1 - t_prefill, "total_s": t1 - t0, "tokens": gen,
        "decode_tok_s": (gen - first) / max(t1 - t_prefill, 1e-9), "e2e_tok_s": gen / (t1 - t0),
        "ms_per_step": 1000 * (t1 - t_prefill) / max(decode_steps, 1), "steps": steps, "decode_steps": decode_steps,
        "token_ids": [toks[r] for r in rids],
    }
    if specs:
        nv = sum(s.num_verify for s in specs)
        depth = max(len(s.accepted_per_depth) for s in specs)
        per_depth = [sum(s.accepted_per_depth[d] for s in specs if d < len(s.accepted_per_depth)) for d in range(depth)]
        res["spec"] = {
            "accept_len": (sum(s.num_accepted_tokens for s in specs) + nv) / max(nv, 1),
            "accepted_per_depth": per_depth,
            "accept_rate_per_depth": [x / max(nv, 1) for x in per_depth],
            "num_verify": nv,
            "verify_ms_per_iter": 1000 * sum(s.verify_time_s for s in specs) / max(nv, 1),
            "draft_ms_per_iter": 1000 * sum(s.draft_time_s for s in specs) / max(nv, 1),
        }
    return res


def hf_build(engine: Any, dtype: Any = None) -> Any:
    """HF transformers' LlamaForCausalLM with the engine's own dequantised weights (the baseline of the
    benchmark and the reference of the exactness tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mleagle.engine.model_loader import load_model

    a = engine.arch
    eos = a.eos_ids[0] if a.eos_ids else 0
    # rope_theta: a parameter of transformers 4.x (which pyproject allows); 5.x takes it as a legacy keyword
    # (into rope_parameters) that its typed signature does not declare
    cfg = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
        rope_theta=a.rope_theta, max_position_embeddings=a.max_position_embeddings,
        tie_word_embeddings=a.tie_word_embeddings, attention_bias=a.attention_bias,
        bos_token_id=a.bos_token_id, eos_token_id=eos, pad_token_id=eos,
    )
    if a.rope_scaling is not None:
        cfg.rope_scaling = {**a.rope_scaling.model_dump(), "rope_theta": a.rope_theta}
    cfg._attn_implementation = "sdpa"
    dtype = dtype or engine.dtype
    m = LlamaForCausalLM(cfg).to(dtype).eval()
    w = load_model(engine.cfg.model, dtype).weights
    if a.tie_word_embeddings:
        w["lm_head.weight"] = w["model.embed_tokens.weight"]
    m.load_state_dict(w, strict=True)
    m.tie_weights()
    return m


def run_hf(model: Any, prompts: list[list[int]], n: int, temperature: float, seed: int, pad: int) -> dict[str, Any]:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []
    cpu: list[float] = []

    class Stamp(LogitsProcessor):
        """Called once per generation step, right after that step's forward."""

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
            return scores

    bs, lmax = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((bs, lmax), pad, dtype=torch.long)
    mask = torch.zeros((bs, lmax), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every row's last prompt token is at the same column
        ids[i, lmax - len(p):] = torch.tensor(p)
        mask[i, lmax - len(p):] = 1
    kw: dict[str, Any] = {"do_sample": temperature > 0}
    if temperature > 0:
        torch.manual_seed(seed)
        kw.update(temperature=temperature, top_k=0, top_p=1.0)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, use_cache=True,
                             pad_token_id=pad, logits_processor=LogitsProcessorList([Stamp()]), **kw)
    t1, c1 = time.perf_counter(), time.process_time()
    gen = out[:, lmax:]
    ntok = int(gen.numel())
    tp, tl = stamps[0], stamps[-1]
    return {
        "decode_cpu_s": c1 - cpu[0], "decode_tok_per_cpu_s": (ntok - bs) / max(c1 - cpu[0], 1e-9),
        "prefill_cpu_s": cpu[0] - c0,
        "prefill_s": tp - t0, "decode_s": t1 - tp, "total_s": t1 - t0, "tokens": ntok,
        "decode_tok_s": (ntok - bs) / max(t1 - tp, 1e-9), "e2e_tok_s": ntok / (t1 - t0),
        "ms_per_step": 1000 * (tl - tp) / max(len(stamps) - 1, 1), "steps": len(stamps),
        "token_ids": gen.tolist(),
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The best run (highest decode tok/s) plus the spread over repeats; token ids dropped."""
    best = dict(max(runs, key=lambda r: r["decode_tok_s"]))
    best.pop("token_ids", None)
    out = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in best.items()}
    out["decode_tok_s_all"] = [round(r["decode_tok_s"], 3) for r in runs]
    out["decode_tok_s_median"] = round(statistics.median(r["decode_tok_s"] for r in runs), 3)
    out["decode_tok_per_cpu_s"] = round(max(r["decode_tok_per_cpu_s"] for r in runs), 3)
    return out


def table(res: dict[str, Any]) -> str:
    hdr = ("| batch | engine decode tok/s | HF decode tok/s | ratio | engine e2e tok/s | HF e2e tok/s "
           "| engine ms/step | HF ms/step | engine prefill s | HF prefill s | engine tok/CPU-s | HF tok/CPU-s | CPU-time ratio |")
    lines = [hdr, "|" + "---:|" * 13]
    for row in res["results"]:
        e, h = row["engine"], row.get("hf")

        def f(d: dict[str, Any] | None, k: str, fmt: str = "{:.1f}") -> str:
            return fmt.format(d[k]) if d else "-"

        ratio = f"{e['decode_tok_s'] / h['decode_tok_s']:.2f}x" if h else "-"
        lines.append(f"| {row['batch_size']} | {f(e, 'decode_tok_s')} | {f(h, 'decode_tok_s')} | {ratio} "
                     f"| {f(e, 'e2e_tok_s')} | {f(h, 'e2e_tok_s')} | {f(e, 'ms_per_step')} | {f(h, 'ms_per_step')} "
                     f"| {f(e, 'prefill_s', '{:.3f}')} | {f(h, 'prefill_s', '{:.3f}')} "
                     f"| {f(e, 'decode_tok_per_cpu_s')} | {f(h, 'decode_tok_per_cpu_s')} "
                     f"| {str(row['speedup_decode_cpu_time']) + 'x' if h else '-'} |")
        if "spec" in e:
            s = e["spec"]
            lines.append(f"|   spec | accept_len {s['accept_len']:.2f} | per depth {s['accepted_per_depth']} | "
                         f"verify {s['verify_ms_per_iter']:.1f} ms | draft {s['draft_ms_per_iter']:.1f} ms ||||||||")
        if "target_only" in row:
            t = row["target_only"]
            lines.append(f"|   target-only | {t['decode_tok_s']:.1f} tok/s | {t['ms_per_step']:.1f} ms/step | "
                         f"spec/target {row['spec_speedup_decode']:.2f}x | greedy rows equal "
                         f"{row.get('rows_equal_target_only', '-')}/{row['batch_size']} ||||||||")
    return "\n".join(lines)


def run(a: argparse.Namespace) -> int:
    import torch

    from mleagle.engine.contract.config import load_config
    from mleagle.engine.core.engine import Engine

    a.device, a.dtype = resolve_device(a.device, a.dtype)
    sizes = [int(x) for x in a.batch_sizes.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError("--batch-sizes needs positive integers, e.g. 1,8,32")
    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    cfg = load_config(a.model)
    texts = read_first_turns(a.dataset, data_dir(a.data_dir))
    report: dict[str, Any] = {
        "machine": machine_info(threads), "model": cfg.model.name, "dtype": a.dtype, "device": a.device,
        "dataset": a.dataset, "batch_sizes": sizes, "max_new_tokens": a.max_new_tokens,
        "temperature": a.temperature, "repeats": a.repeats, "draft": a.draft, "spec_steps": a.spec_steps,
        "attention_backend": a.attention_backend or "auto",
        "prefix_cache": not a.disable_prefix_cache,
        "command": "mleagle bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
    }
    if not a.skip_load:
        with tempfile.TemporaryDirectory(prefix="mleagle-bench-cache-") as cache:
            cold = measure_load(a.model, a.dtype, cache)
            warm = measure_load(a.model, a.dtype, cache)
        report["load"] = {"cold": cold, "warm": warm}
        print(f"load: cold {cold['load_s']:.2f}s, warm {warm['load_s']:.2f}s (model + tokenizer)", file=sys.stderr)

    from mleagle.engine.contract.tokenizer import Tokenizer

    tok = Tokenizer.from_source(cfg.model)
    if tok is None:
        raise ValueError(f"model {cfg.model.name!r} has no tokenizer: the benchmark needs chat prompts")
    prompts_all = [tok.encode_chat([{"role": "user", "content": t}])
                   for t in texts]
    # The KV pool is sized to the largest batch (prompts + new tokens + slack) unless given.
    need = sum(sorted((len(p) for p in prompts_all), reverse=True)[: max(sizes)]) + max(sizes) * (a.max_new_tokens + 16)
    over: dict[str, Any] = {"dtype": a.dtype, "device": a.device, "max_total_tokens": a.max_total_tokens or need + 64,
                            "max_running_requests": max(max(sizes), cfg.engine.max_running_requests)}
    for k in ("draft", "spec_steps", "spec_policy", "threads", "attention_backend"):
        if getattr(a, k) is not None:
            over[k] = getattr(a, k)
    if a.disable_prefix_cache:
        over["enable_prefix_cache"] = False
    over.update(tp_overrides(a))
    tp = int(over.get("tp_size", 1))
    if tp > 1 and not a.skip_hf:
        # HF would read this rank's shards; and one tensor-parallel engine runs per process.
        print("mleagle bench: --tp > 1 skips HF and the target-only baseline (one TP engine per process)",
              file=sys.stderr)
        a.skip_hf = True
    report["tp_size"] = tp
    from mleagle.engine.service.tp_driver import start_engine

    engine = start_engine(cfg, **over)
    # With a draft, the target-only engine runs beside it in the same process: the speculative
    # figure's baseline (and a greedy-exactness check) comes from the same run.
    target = None
    # as given (no machine path); the model's default only where it loaded (default_draft_devices)
    report["draft"] = a.draft if a.draft is not None else (
        cfg.model.default_draft if engine.cfg.engine.draft not in ("", "none") else "none")
    if engine.cfg.engine.draft not in ("", "none") and tp == 1:
        target = Engine(cfg, **{k: v for k, v in over.items() if k not in ("draft", "spec_steps", "spec_policy")},
                        draft="none")
    report["engine_load_s"] = round(engine.load_time_s, 3)
    report["weights"] = weight_report(engine)
    kv, kv_ptrs = kv_report(engine)
    report["kv"] = kv
    report["machine"]["threads"] = torch.get_num_threads()

    def batch(bs: int) -> list[list[int]]:
        return [prompts_all[i % len(prompts_all)] for i in range(bs)]

    # Warm up the engine at every batch size (short), then record the engine-only memory peak.
    for bs in sizes:
        run_engine(engine, batch(bs), 4, a.temperature, a.seed)
        if target is not None:
            run_engine(target, batch(bs), 4, a.temperature, a.seed)
    report["peak_rss_mb_engine"] = round(peak_rss_mb(), 1)
    hf = None
    if not a.skip_hf:
        t0 = time.perf_counter()
        hf = hf_build(engine)
        report["hf_build_s"] = round(time.perf_counter() - t0, 3)
        pad = engine.arch.eos_ids[0] if engine.arch.eos_ids else 0
        for bs in sizes:
            run_hf(hf, batch(bs), 4, a.temperature, a.seed, pad)
    results = []
    for bs in sizes:
        er, hr, tr = [], [], []
        for _ in range(a.repeats):
            er.append(run_engine(engine, batch(bs), a.max_new_tokens, a.temperature, a.seed))
            if target is not None:
                tr.append(run_engine(target, batch(bs), a.max_new_tokens, a.temperature, a.seed))
            if hf is not None:
                hr.append(run_hf(hf, batch(bs), a.max_new_tokens, a.temperature, a.seed, pad))
        row: dict[str, Any] = {"batch_size": bs, "prompt_tokens": [len(p) for p in batch(bs)],
                               "engine": summarise(er)}
        if target is not None:
            row["target_only"] = summarise(tr)
            row["spec_speedup_decode"] = round(row["engine"]["decode_tok_s"] / row["target_only"]["decode_tok_s"], 3)
            if a.temperature == 0:
                row["rows_equal_target_only"] = sum(x == y for x, y in zip(er[-1]["token_ids"], tr[-1]["token_ids"]))
        if hf is not None:
            row["hf"] = summarise(hr)
            row["speedup_decode"] = round(row["engine"]["decode_tok_s"] / row["hf"]["decode_tok_s"], 3)
            row["speedup_e2e"] = round(row["engine"]["e2e_tok_s"] / row["hf"]["e2e_tok_s"], 3)
            # per CPU second: robust to other processes taking the cores (exact with --threads 1)
            row["speedup_decode_cpu_time"] = round(max(r["decode_tok_per_cpu_s"] for r in er)
                                                   / max(r["decode_tok_per_cpu_s"] for r in hr), 3)
            if a.temperature == 0:  # greedy: how many rows came out token for token equal to HF's
                row["rows_equal_hf"] = sum(x == y for x, y in zip(er[-1]["token_ids"], hr[-1]["token_ids"]))
        results.append(row)
        print(f"batch {bs}: engine {row['engine']['decode_tok_s']:.1f} tok/s"
              + (f", HF {row['hf']['decode_tok_s']:.1f} tok/s" if hf is not None else ""), file=sys.stderr)
    report["results"] = results
    report["peak_rss_mb_total"] = round(peak_rss_mb(), 1)
    engine.close()
    _, ptrs_after = kv_report(engine)
    report["kv"]["allocated_once"] = ptrs_after == kv_ptrs
    report["machine"]["loadavg_end"] = list(os.getloadavg())
    print(table(report))
    w = report["weights"]
    print(f"\nweights {w['weights_bytes'] / 2**20:.1f} MiB (tied head shared: {w['tied_head_shared']}, "
          f"params not in {a.dtype}: {len(w['params_not_in_dtype'])}), KV pool {kv['kv_pool_bytes'] / 2**20:.1f} MiB "
          f"(allocated once: {report['kv']['allocated_once']}), peak RSS engine-only {report['peak_rss_mb_engine']} MB, "
          f"{'with HF' if hf is not None else 'at the end'} {report['peak_rss_mb_total']} MB")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {a.out}", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    try:
        return run(a)
    except (ValueError, FileNotFoundError, ImportError, RuntimeError) as e:
        print(f"mleagle bench: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
