"""`mleagle train-draft`: make a chain MTP draft for a target from the target's own outputs.

Phases, each resumable from its output folder (`--out`):
  generate  prompts → chat template → the target's responses through this engine (batched, a greedy /
            sampled mix), written as token-id shards under OUT/data (see `engine/spec/train_data.py`);
  train     the draft trained as the chain unrolls when serving, the target's hidden states and
            distribution recomputed per batch (`engine/spec/train.py`); the draft is saved to
            OUT/draft (size-capped bf16 shards), resume state to --ckpt-dir (default OUT/ckpt);
  eval      acceptance per depth and mean acceptance length through the real engine (draft loaded
            from OUT/draft), greedy and sampled, on MT-Bench first turns and GSM8K test (never
            trained on), written to OUT/eval.json;
  all       the three in one process with one time budget (`--time-budget-s`), so that one GPU
            command does everything: generation stops at its share of the budget, training fills
            what is left after generation minus the evaluation's reserve; then a summary table, and
            OUT/summary.json and OUT/draft/README.md (the model card's figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mleagle.engine.contract.cli_flags import DEVICES, DTYPES

T_START = time.perf_counter()
EVAL_PROMPTS = "eval_prompts.jsonl"  # under OUT: the prompts held out of --prompts for eval
REPEAT_NGRAM = 16  # eval: a token repeats when it completes a 17-gram seen earlier in its response


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- options -------------------------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("common")
    g.add_argument("--out", required=True, help="output folder (data/, draft/, logs, eval.json, summary.json)")
    g.add_argument("--model", default="smollm2-135m", help="bundled config name, .toml, .gguf or HF dir")
    g.add_argument("--device", choices=DEVICES, default="auto")
    g.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="engine dtype (auto: bfloat16 on CUDA, float32 on the CPU)")
    g.add_argument("--data-dir", default=None, help="prompt data (default: $MLEAGLE_DATA_DIR or ../shared/data)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _gen(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generate")
    g.add_argument("--max-prompts", type=int, default=None, help="use at most N prompts (after dedupe/shuffle)")
    g.add_argument("--max-new-tokens", type=int, default=512)
    g.add_argument("--max-prompt-tokens", type=int, default=512, help="longer (templated) prompts are skipped")
    g.add_argument("--temperature-mix", default="0=0.75,0.7=0.25", help="T=WEIGHT pairs: share of prompts per temperature")
    g.add_argument("--gsm8k-train", action="store_true", help="add GSM8K train questions (most are in prompts.jsonl)")
    g.add_argument("--extra-prompts", action="append", default=[], help="more prompt JSONL files")
    g.add_argument("--prompts", action="append", default=[],
                   help="your own prompt JSONL (rows with `prompt`, or `turns`), instead of the shared corpus "
                        "(repeatable); the first --eval-holdout of them (after the shuffle) are kept for eval")
    g.add_argument("--eval-holdout", type=int, default=80,
                   help="with --prompts: prompts held out of training, written to OUT/eval_prompts.jsonl, which "
                        "eval then measures by default")
    g.add_argument("--sources", default=None, help="comma list: keep only these `source` labels")
    g.add_argument("--samples-per-prompt", type=int, default=1,
                   help="answers per prompt; the ones after the first use only the mix's temperatures above 0")
    g.add_argument("--skip-greedy-in", default=None,
                   help="comma list of data folders/.npz: greedy jobs whose prompt already has a greedy answer "
                        "there are skipped (it would come out the same)")
    g.add_argument("--gen-batch", type=int, default=None, help="max running requests (default 256 CUDA, 32 CPU)")
    g.add_argument("--gen-prefill-chunk", type=int, default=None, help="engine chunked_prefill_size for generation")
    g.add_argument("--shard-seqs", type=int, default=1024, help="sequences per shard")
    g.add_argument("--max-gen-tokens", type=int, default=12_000_000, help="stop once the folder holds this many")
    g.add_argument("--gen-time-budget-s", type=float, default=None)


def _train(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("train")
    g.add_argument("--layers", type=int, default=3)
    g.add_argument("--blocks", type=int, default=1, help="decoder blocks per draft step (more depth per step)")
    g.add_argument("--aux-layers", default="",
                   help="comma list of target layers whose output streams draft layer 0 also reads (fused features, "
                        "as EAGLE-3; e.g. 2,15 for a 30-layer target); default none")
    g.add_argument("--tie-blocks", default="",
                   help="comma list k:j: layer k runs layer j's decoder blocks (one set of weights trained at both "
                        "depths; layer k keeps its own input projection and norms), so a deeper draft costs "
                        "little storage; e.g. 3:1,4:2 for a 5-layer draft")
    g.add_argument("--epochs", type=float, default=4.0, help="at most this many passes over the data")
    g.add_argument("--steps", type=int, default=None)
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--warmup", type=int, default=50)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--batch-tokens", type=int, default=None, help="padded tokens per step (default 16384 CUDA, 2048 CPU)")
    g.add_argument("--max-len", type=int, default=2048)
    g.add_argument("--kl-weight", type=float, default=1.0, help="weight of KL(target ‖ draft)")
    g.add_argument("--ce-weight", type=float, default=0.0, help="weight of CE on greedily generated tokens")
    g.add_argument("--tv-weight", type=float, default=0.0,
                   help="weight of the total variation between target and draft at --tv-temperature (1 - TV is "
                        "the sampled acceptance there); 0: off")
    g.add_argument("--tv-temperature", type=float, default=0.7,
                   help="the temperature of the TV term and of the held-out sampled agreement (default 0.7)")
    g.add_argument("--depth-weights", default=None, help="comma list, one per layer (default 0.8**k)")
    g.add_argument("--prompt-weight", type=float, default=0.0, help="KL weight at prompt positions")
    g.add_argument("--init", choices=["random", "last"], default="random",
                   help="random (as EAGLE), or blocks copied from the target's last layer")
    g.add_argument("--draft-vocab", type=int, default=0, help="reduced draft vocabulary size (0: the target's)")
    g.add_argument("--draft-vocab-coverage", type=float, default=None,
                   help="instead of a size: the smallest multiple of 1024 ids covering this share of response tokens")
    g.add_argument("--data", default=None,
                   help="train on these data folders or exported data.npz files (comma list; default OUT/data); "
                        "`all` then skips generate")
    g.add_argument("--init-draft", default=None,
                   help="start from this saved draft (its draft vocabulary is kept; --layers may add layers, each a copy "
                        "of its --tie-blocks source or of the last saved layer)")
    g.add_argument("--widen-vocab", action="store_true",
                   help="with --init-draft: drop its reduced draft vocabulary, train and serve over the target's")
    g.add_argument("--holdout-seqs", type=int, default=64)
    g.add_argument("--train-time-budget-s", type=float, default=None)
    g.add_argument("--resume", action="store_true", help="continue from --ckpt-dir's train_state.pt")
    g.add_argument("--ckpt-dir", default=None, help="resume state (default OUT/ckpt; ~12 bytes per draft weight)")
    g.add_argument("--ckpt-every-s", type=float, default=120.0)
    g.add_argument("--no-amp", action="store_true", help="no bf16 autocast on CUDA")
    g.add_argument("--chunk-rows", type=int, default=4096)
    g.add_argument("--log-every-s", type=float, default=10.0)
    g.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    g.add_argument("--max-shard-mb", type=float, default=16.0, help="largest draft weight file (MiB)")


def _eval(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("eval")
    g.add_argument("--draft", default=None, help="draft folder to evaluate (default OUT/draft)")
    g.add_argument("--eval-datasets", default=None,
                   help="comma list of mt_bench, gsm8k, alpaca or JSONL files (default: OUT/eval_prompts.jsonl "
                        "when generate held prompts out of --prompts, else mt_bench,gsm8k)")
    g.add_argument("--eval-prompts", type=int, default=80, help="first N prompts of each dataset")
    g.add_argument("--eval-max-new-tokens", type=int, default=256)
    g.add_argument("--eval-temperatures", default="0,0.7")
    g.add_argument("--eval-batch", type=int, default=None, help="max running requests (default 64 CUDA, 8 CPU)")
    g.add_argument("--eval-time-budget-s", type=float, default=None)
    g.add_argument("--eval-baseline", action="store_true", help="also run target-only (tokens/s ratio, greedy exactness)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mleagle train-draft", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="phase", required=True)
    for name, parts, help_ in (("generate", (_gen,), "generate training data"), ("train", (_train,), "train the draft"),
                               ("eval", (_eval,), "measure acceptance through the engine"),
                               ("all", (_gen, _train, _eval), "generate → train → eval under one time budget")):
        sp = sub.add_parser(name, help=help_)
        _common(sp)
        for f in parts:
            f(sp)
        if name == "all":
            sp.add_argument("--time-budget-s", type=float, default=None, help="for the whole run (from process start)")
            sp.add_argument("--plan-epochs", type=float, default=3.0,
                            help="passes over the data the budget plans for: generation stops once that many "
                                 "would fill the training time left (training may run up to --epochs on time)")
            sp.add_argument("--gen-frac", type=float, default=0.8,
                            help="most of (budget - eval reserve) that generation may use; it stops earlier once "
                                 "the data would take all the training time left (measured rates)")
            sp.add_argument("--eval-budget-s", type=float, default=None, help="reserve for eval (default 15%% of the budget)")
            sp.add_argument("--export", default=None,
                            help="also write the deliverables here, in at most 8 files of < 16 MiB: draft/ (weights, "
                                 "config, card), data.npz (all token ids), summary.json")
    return p


def resolve_device(a: argparse.Namespace) -> None:
    import torch

    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.dtype == "auto":
        a.dtype = "bfloat16" if a.device == "cuda" else "float32"
    cuda = a.device == "cuda"
    for k, gpu, cpu in (("gen_batch", 256, 32), ("batch_tokens", 16384, 2048), ("eval_batch", 64, 8)):
        if getattr(a, k, 0) is None:
            setattr(a, k, gpu if cuda else cpu)
    if a.threads:
        torch.set_num_threads(a.threads)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True


def check_inputs(a: argparse.Namespace) -> None:
    """Inputs named on the command line exist, and counts and layer lists are sane: before a phase runs,
    not after minutes of generation."""
    for f in getattr(a, "prompts", None) or []:
        if not Path(f).is_file():
            raise FileNotFoundError(f"--prompts {f}: no such file")
    if getattr(a, "eval_holdout", 0) < 0:
        raise ValueError(f"--eval-holdout must be >= 0, not {a.eval_holdout}")
    if getattr(a, "samples_per_prompt", 1) < 1:
        raise ValueError(f"--samples-per-prompt must be >= 1, not {a.samples_per_prompt}")
    for opt in ("data", "skip_greedy_in"):
        for p in filter(None, (getattr(a, opt, None) or "").split(",")):
            if not Path(p).exists():
                raise FileNotFoundError(f"--{opt.replace('_', '-')} {p}: no such data folder or file")
    if getattr(a, "tv_weight", 0.0) < 0 or getattr(a, "tv_temperature", 0.7) <= 0:
        raise ValueError(f"--tv-weight must be >= 0 and --tv-temperature > 0 (got {a.tv_weight}, {a.tv_temperature})")
    if getattr(a, "blocks", 1) < 1:
        raise ValueError(f"--blocks must be >= 1, not {a.blocks}")
    if hasattr(a, "aux_layers"):
        aux_layers(a)
    if hasattr(a, "tie_blocks"):
        tied_blocks(a)
    init = getattr(a, "init_draft", None)
    if init and not Path(init).is_dir():
        raise FileNotFoundError(f"--init-draft {init}: no such draft folder")
    if getattr(a, "widen_vocab", False) and not init:
        raise ValueError("--widen-vocab widens the vocabulary of --init-draft; give the draft to start from")


def hardware(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    from mleagle.engine.entrypoints.bench import cpu_name

    return f"{cpu_name() or 'CPU'}, {torch.get_num_threads()} threads (torch {torch.__version__})"


def make_engine(a: argparse.Namespace, draft: str = "none", batch: int = 1, kv_tokens: int = 256,
                prefill_chunk: int | None = None) -> Any:
    from mleagle.engine.core.engine import Engine

    # tp_size 1 whatever a config file says: training reads the target's weights whole (one rank).
    # spec_policy "always": the evaluation measures the draft at its full depth, every iteration.
    over: dict[str, Any] = {"device": a.device, "dtype": a.dtype, "draft": draft, "max_running_requests": batch,
                            "max_total_tokens": max(kv_tokens, 64), "tp_size": 1, "spec_policy": "always"}
    if prefill_chunk:
        over["chunked_prefill_size"] = prefill_chunk
    if a.threads:
        over["threads"] = a.threads
    return Engine(a.model, **over)


def free() -> None:
    """Collect what the caller just dropped (an engine's KV pools: the engine holds reference cycles)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- phases ----------------------------------------------------------------------------------------------
def phase_generate(a: argparse.Namespace, engine: Any, deadline: float | None,
                   stop: Any = None) -> dict[str, Any]:
    from mleagle.engine.contract.config import data_dir
    from mleagle.engine.spec.train_data import (
        generate_data,
        make_jobs,
        parse_mix,
        prompts_fingerprint,
        training_prompts,
    )

    ddir = data_dir(a.data_dir)
    mix = parse_mix(a.temperature_mix)
    prompts = training_prompts(ddir, gsm8k_train=a.gsm8k_train, extra=a.extra_prompts,
                               sources=a.sources.split(",") if a.sources else None, seed=a.seed,
                               own=a.prompts)
    held = 0
    if a.prompts and a.eval_holdout > 0:  # your own prompts: the first of the shuffle are eval's, never trained on
        held = min(a.eval_holdout, len(prompts) // 2)
        keep = Path(a.out) / EVAL_PROMPTS
        keep.parent.mkdir(parents=True, exist_ok=True)
        keep.write_text("".join(json.dumps({"prompt": p.text, "source": p.source}) + "\n" for p in prompts[:held]))
        prompts = prompts[held:]
        log(f"generate: {held} of your prompts held out for eval in {keep}")
    prompts = prompts[: a.max_prompts] if a.max_prompts else prompts
    t0 = time.perf_counter()
    jobs, skipped = make_jobs(prompts, lambda t: engine.encode_prompt(t, chat=True), mix, a.max_prompt_tokens, a.seed,
                              a.samples_per_prompt)
    log(f"generate: {len(prompts)} prompts ({skipped} over {a.max_prompt_tokens} tokens skipped), "
        f"templated and encoded in {time.perf_counter() - t0:.1f}s")
    n_dup = 0
    if a.skip_greedy_in:
        from mleagle.engine.spec.train_data import load_seqs

        have = {tuple(s.ids[: s.n_prompt].tolist()) for d in a.skip_greedy_in.split(",") for s in load_seqs(d)
                if s.temperature == 0}
        kept = [j for j in jobs if not (j.temperature == 0 and tuple(j.ids) in have)]
        n_dup, jobs = len(jobs) - len(kept), kept
        log(f"generate: {n_dup} greedy jobs skipped (answered greedily in {a.skip_greedy_in})")
    settings = {"model": engine.model_name, "vocab_size": engine.arch.vocab_size, "dtype": a.dtype,
                "max_new_tokens": a.max_new_tokens, "max_prompt_tokens": a.max_prompt_tokens,
                "temperature_mix": [list(x) for x in mix], "seed": a.seed, "gsm8k_train": a.gsm8k_train,
                "extra_prompts": [Path(x).name for x in a.extra_prompts], "sources": a.sources,
                "max_prompts": a.max_prompts, "prompts": len(prompts), "prompts_sha": prompts_fingerprint(prompts),
                "excluded": ["mt_bench.jsonl (all turns)", "gsm8k_test.jsonl"]}
    if a.prompts:  # absent otherwise, so folders made before the option still resume
        settings["own_prompts"] = [Path(x).name for x in a.prompts]
        settings["eval_holdout"] = held
    if a.samples_per_prompt != 1:  # absent at 1, so folders made before the option still resume
        settings["samples_per_prompt"] = a.samples_per_prompt
    if a.skip_greedy_in:
        settings["skip_greedy_in"] = [Path(x).name for x in a.skip_greedy_in.split(",")]
    run = generate_data(engine, jobs, Path(a.out) / "data", settings, max_new_tokens=a.max_new_tokens,
                        shard_seqs=a.shard_seqs, deadline=deadline, max_gen_tokens=a.max_gen_tokens, stop=stop)
    from mleagle.engine.spec.train_data import read_manifest

    man = read_manifest(Path(a.out) / "data") or {}
    return {"run": run, "jobs": len(jobs), "skipped_long_prompts": skipped, "skipped_greedy_repeats": n_dup,
            "totals": man.get("totals"),
            "settings": settings, "device": a.device, "batch": a.gen_batch}


def pick_vocab(a: argparse.Namespace, seqs: Any, vocab_size: int, eos: list[int]) -> Any:
    import numpy as np

    from mleagle.engine.spec.train_data import response_counts, select_vocab

    if not a.draft_vocab and a.draft_vocab_coverage is None:
        return None, None
    counts = response_counts(seqs, vocab_size)
    if a.draft_vocab_coverage is not None:
        c = np.sort(counts)[::-1].cumsum() / max(counts.sum(), 1)
        n = int(np.searchsorted(c, a.draft_vocab_coverage) + 1)
        size = min(vocab_size, -(-n // 1024) * 1024)
    else:
        size = a.draft_vocab
    if size >= vocab_size:
        return None, counts
    return select_vocab(counts, size, always=eos), counts


def aux_layers(a: argparse.Namespace) -> list[int]:
    try:
        return [int(x) for x in a.aux_layers.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--aux-layers {a.aux_layers!r}: expected a comma list of target layer indices") from None


def tied_blocks(a: argparse.Namespace) -> dict[int, int]:
    from mleagle.engine.spec.draft_model import check_ties

    try:
        tied = {int(k): int(j) for k, j in (x.split(":") for x in a.tie_blocks.split(",") if x.strip())}
    except ValueError:
        raise ValueError(f"--tie-blocks {a.tie_blocks!r}: expected a comma list of k:j layer pairs") from None
    check_ties(tied, a.layers)
    return tied


def train_config(a: argparse.Namespace) -> Any:
    from mleagle.engine.spec.train import TrainConfig

    dw = [float(x) for x in a.depth_weights.split(",")] if a.depth_weights else []
    return TrainConfig(layers=a.layers, blocks=a.blocks, aux_layers=aux_layers(a), tied=tied_blocks(a),
                       epochs=a.epochs, steps=a.steps,
                       lr=a.lr, warmup=a.warmup, weight_decay=a.weight_decay, batch_tokens=a.batch_tokens, max_len=a.max_len,
                       kl_weight=a.kl_weight, ce_weight=a.ce_weight, tv_weight=a.tv_weight,
                       tv_temperature=a.tv_temperature, depth_weights=dw, prompt_weight=a.prompt_weight,
                       init=a.init, amp=not a.no_amp, chunk_rows=a.chunk_rows, seed=a.seed,
                       log_every_s=a.log_every_s, ckpt_every_s=a.ckpt_every_s)


def phase_train(a: argparse.Namespace, model: Any, eos: list[int], deadline: float | None) -> dict[str, Any]:
    import torch

    from mleagle.engine.spec.checkpoint import save_draft
    from mleagle.engine.spec.train import Trainer, hidden_rms, init_stack, seed_all
    from mleagle.engine.spec.train_data import coverage, load_seqs, response_counts, split_holdout

    out = Path(a.out)
    seed_all(a.seed)
    t0 = time.perf_counter()
    seqs = [s for d in (a.data.split(",") if a.data else [out / "data"]) for s in load_seqs(d)]
    train_s, held = split_holdout(seqs, a.holdout_seqs, a.seed)
    start = None
    if a.init_draft:
        from mleagle.engine.spec.checkpoint import load_draft

        start = load_draft(a.init_draft, model.arch)
        if len(start.layers) > a.layers:
            raise ValueError(f"--init-draft {a.init_draft} has {len(start.layers)} layers, --layers is {a.layers}")
        ties = tied_blocks(a)
        if any(ties.get(k) != j for k, j in start.tied.items()) or \
                any(k < len(start.layers) and k not in start.tied for k in ties):
            raise ValueError(f"--init-draft {a.init_draft} ties blocks {start.tied}, --tie-blocks gives {ties}: "
                             "keep its ties (a run may add ties for new layers)")
        if start.blocks > a.blocks or (start.aux_layers and list(start.aux_layers) != aux_layers(a)):
            raise ValueError(f"--init-draft {a.init_draft} has {start.blocks} block(s) per step and aux layers "
                             f"{list(start.aux_layers)}; a run may add blocks and fused features, not drop them "
                             f"(--blocks {a.blocks}, --aux-layers {aux_layers(a)})")
        vocab_ids = None if a.widen_vocab else start.vocab_ids  # the head is the target's: only its rows differ
        counts = response_counts(train_s, model.arch.vocab_size) if vocab_ids is not None else None
        log(f"train: starting from {a.init_draft} (its draft vocabulary: "
            f"{'full' if start.vocab_ids is None else len(start.vocab_ids)}"
            f"{'; widened to the full vocabulary' if a.widen_vocab and start.vocab_ids is not None else ''})")
    else:
        vocab_ids, counts = pick_vocab(a, train_s, model.arch.vocab_size, eos)
    cov = None
    if vocab_ids is not None:
        assert counts is not None  # counted wherever a vocabulary is picked or kept
        cov = {"train": round(coverage(counts, vocab_ids), 5),
               "heldout": round(coverage(response_counts(held, model.arch.vocab_size), vocab_ids), 5) if held else None}
        log(f"train: draft vocabulary {len(vocab_ids)} ids, response-token coverage {cov}")
    n_tok = sum(len(s) for s in train_s)
    log(f"train: {len(train_s)} sequences ({n_tok} tokens), {len(held)} held out")
    rms = hidden_rms(model, train_s) if a.init == "last" else 1.0
    stack = init_stack(model, a.layers, a.init, a.seed, rms, vocab_ids, a.blocks, aux_layers(a), tied_blocks(a))
    if start is not None:  # grown: what the start draft lacks starts neutral (`load_layer`)
        from mleagle.engine.spec.checkpoint import load_layer

        n0 = len(start.layers)
        for k, m in enumerate(stack.layers):  # a layer past the source's starts as its tie source, or the last
            w = start.layers[k if k < n0 else stack.tied.get(k, n0 - 1)]
            load_layer(m, {n: v.float() for n, v in w.items()}, grow=True)
        if a.layers > n0:
            log(f"train: layers {n0}..{a.layers - 1} added, each a copy of "
                + ", ".join(f"{k}←{stack.tied.get(k, n0 - 1)}" for k in range(n0, a.layers))
                + (f"; tied blocks {stack.tied}" if stack.tied else ""))
    cfg = train_config(a)
    ckpt = Path(a.ckpt_dir) if a.ckpt_dir else out / "ckpt"
    log_file = out / "train_log.jsonl"
    tr = Trainer(model, stack, train_s, cfg, ckpt, log_file)
    resumed = tr.load_state() if a.resume else False
    if not resumed and log_file.exists():
        log_file.unlink()
    t1 = time.perf_counter()
    before = tr.evaluate(held) if held and not resumed else None
    t_eval = time.perf_counter() - t1
    budget = a.train_time_budget_s
    if deadline is not None:
        left = deadline - time.perf_counter() - t_eval - 5.0  # the held-out pass after training and the save
        budget = min(budget, left) if budget else left
        if budget <= 0:
            raise RuntimeError(f"no time left to train ({budget:.0f}s): raise --time-budget-s or lower --gen-frac")
    tr.cfg.time_budget_s = budget
    log(f"train: {tr.total_steps} planned steps ({tr.per_epoch}/epoch, {a.epochs} epochs"
        + (f", time budget {budget:.0f}s" if budget else "") + f"), {a.layers} layers, depth weights {cfg.weights()}")
    res = tr.run()
    after = tr.evaluate(held) if held else None
    # A draft trained on from one that names its `auto` depths keeps them (they fit: it has as many layers or more).
    depths = start.auto_depths if start is not None else None
    by_device = {k: list(v) for k, v in start.auto_depths_by_device.items()} if start is not None else None
    files = save_draft(stack, out / "draft", torch.bfloat16 if a.save_dtype == "bfloat16" else torch.float32,
                       int(a.max_shard_mb * 2**20), auto_depths=list(depths) if depths is not None else None,
                       auto_depths_by_device=by_device)
    hist = tr.state.history
    summary = {"result": res, "config": {k: v for k, v in vars(cfg).items() if k != "log_every_s"},
               "hidden_rms": rms, "train_seqs": len(train_s), "train_tokens": n_tok, "heldout_seqs": len(held),
               "draft_vocab": None if vocab_ids is None else len(vocab_ids), "vocab_coverage": cov,
               "heldout_before": before, "heldout_after": after, "resumed": resumed, "init_draft": a.init_draft,
               "data": a.data,
               "autocast": a.dtype if a.dtype != "float32" else "bfloat16" if cfg.amp and a.device == "cuda" else None,
               "model_dtype": a.dtype,
               "draft_files": {f.name: f.stat().st_size for f in files}, "time_s": round(time.perf_counter() - t0, 2),
               "history": hist}
    (out / "train.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"train: saved {out / 'draft'} ({', '.join(f'{f.name} {f.stat().st_size / 2**20:.1f} MiB' for f in files)}); "
        f"held-out agreement per depth {after['acc'] if after else '-'}")
    return summary


def read_first_turns(name: str, ddir: Path) -> list[str]:
    from mleagle.engine.entrypoints.bench import read_first_turns as rft

    return rft(name, ddir)


def read_categories(name: str, ddir: Path) -> list[str | None]:
    from mleagle.engine.entrypoints.bench import read_categories as rc

    return rc(name, ddir)


def run_acceptance(engine: Any, prompts: list[list[int]], temperature: float, max_new: int, seed: int,
                   deadline: float | None, categories: Sequence[str | None] | None = None) -> dict[str, Any]:
    """All prompts through the engine (continuous batching); spec statistics summed over finished requests,
    and per group: by how each request ended (EOS or the cap) and, given `categories`, by its prompt's."""
    from mleagle.engine.contract.sampling_params import SamplingParams

    t0 = time.perf_counter()
    rids = []
    for i, ids in enumerate(prompts):
        rid = f"eval-{time.perf_counter_ns()}-{i}"
        engine.add_request(rid, ids, SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=seed + i))
        rids.append(rid)
    left = set(rids)
    toks: dict[str, list[int]] = {r: [] for r in rids}
    spec: dict[str, Any] = {}
    finish: dict[str, str] = {}
    cut = False
    while left:
        if deadline is not None and time.perf_counter() >= deadline:
            cut = True
            break
        for o in engine.step():
            if o.rid in toks:
                toks[o.rid] += o.token_ids
                if o.finished:
                    left.discard(o.rid)
                    finish[o.rid] = str(o.finish_reason)
                    if o.spec is not None:
                        spec[o.rid] = o.spec
    from mleagle.engine.spec.train_data import drain

    drain(engine, list(left))
    dt = time.perf_counter() - t0
    done = [r for r in rids if r not in left]
    n_tok = sum(len(toks[r]) for r in done)
    res: dict[str, Any] = {"prompts": len(done), "of": len(prompts), "cut_by_budget": cut, "tokens": n_tok,
                           "time_s": round(dt, 2), "tok_s": round(n_tok / dt, 1) if dt > 0 else None,
                           "token_ids": [toks[r] for r in rids]}
    if spec:
        s = len(next(iter(spec.values())).accepted_per_depth)
        ver = sum(x.num_verify for x in spec.values())
        acc = [sum(x.accepted_per_depth[j] for x in spec.values()) for j in range(s)]
        res.update({"accept_len": round((sum(acc) + ver) / max(ver, 1), 4), "num_verify": ver,
                    "accepted_per_depth": acc, "accept_rate_per_depth": [round(x / max(ver, 1), 4) for x in acc],
                    "conditional_accept_per_depth": [round(acc[j] / max(acc[j - 1] if j else ver, 1), 4) for j in range(s)]})
    # Long answers of a small target can fall into loops that any draft predicts; say how much of the
    # text repeats itself and what requests that ended on their own (EOS) accept against capped ones.
    res["by_finish"] = group_stats(done, lambda r: finish.get(r, "?"), toks, spec)
    if categories is not None:
        cat = dict(zip(rids, categories))
        res["by_category"] = group_stats(done, lambda r: cat.get(r) or "?", toks, spec)
    res["repeat_frac"] = round(repeat_frac([toks[r] for r in done]), 4)
    return res


def group_stats(rids: Sequence[str], key: Callable[[str], str], toks: dict[str, list[int]],
                spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Requests grouped by `key`: count, tokens, repeated-n-gram share and accept length per group."""
    groups: dict[str, list[str]] = {}
    for r in rids:
        groups.setdefault(key(r), []).append(r)
    out = {}
    for name, rs in sorted(groups.items()):
        g: dict[str, Any] = {"requests": len(rs), "tokens": sum(len(toks[r]) for r in rs),
                             "repeat_frac": round(repeat_frac([toks[r] for r in rs]), 4)}
        sp = [spec[r] for r in rs if r in spec]
        if sp:
            ver = sum(x.num_verify for x in sp)
            g["accept_len"] = round((sum(x.num_accepted_tokens for x in sp) + ver) / max(ver, 1), 4)
        out[name] = g
    return out


def repeat_frac(seqs: Sequence[Sequence[int]], n: int = REPEAT_NGRAM) -> float:
    """Share of tokens (from the n-th of each sequence on) that complete an (n+1)-gram already seen
    earlier in the same sequence: near 0 for ordinary prose, near 1 inside a loop."""
    hit = tot = 0
    for t in seqs:
        seen: set[tuple[int, ...]] = set()
        for i in range(n, len(t)):
            g = tuple(t[i - n : i + 1])
            hit += g in seen
            seen.add(g)
            tot += 1
    return hit / tot if tot else 0.0


def eval_datasets(a: argparse.Namespace) -> str:
    """--eval-datasets, or by default the prompts generate held out of the user's own (if it did)."""
    if a.eval_datasets:
        return str(a.eval_datasets)
    held = Path(a.out) / EVAL_PROMPTS
    return str(held) if held.is_file() else "mt_bench,gsm8k"


def phase_eval(a: argparse.Namespace, deadline: float | None) -> dict[str, Any]:
    from mleagle.engine.contract.config import data_dir

    out = Path(a.out)
    draft = a.draft or str(out / "draft")
    if not Path(draft).is_dir():
        raise FileNotFoundError(f"no draft at {draft}: run `mleagle train-draft train --out {a.out}` first")
    ddir = data_dir(a.data_dir)
    temps = [float(x) for x in a.eval_temperatures.split(",") if x.strip()]
    datasets = [x.strip() for x in eval_datasets(a).split(",") if x.strip()]
    kv = a.eval_batch * (a.max_prompt_tokens + a.eval_max_new_tokens + 32) if hasattr(a, "max_prompt_tokens") \
        else a.eval_batch * (1024 + a.eval_max_new_tokens)
    t0 = time.perf_counter()
    engine = make_engine(a, draft=draft, batch=a.eval_batch, kv_tokens=kv)
    base = make_engine(a, batch=a.eval_batch, kv_tokens=kv) if a.eval_baseline else None
    t_load = time.perf_counter() - t0
    runs = []
    jobs = [(d, t) for d in datasets for t in temps]
    for n, (ds, temp) in enumerate(jobs):
        texts = read_first_turns(ds, ddir)[: a.eval_prompts]
        cats = read_categories(ds, ddir)[: a.eval_prompts]
        fits = [(p, c) for p, c in zip((engine.encode_prompt(t, chat=True) for t in texts), cats)
                if len(p) + a.eval_max_new_tokens < engine.max_context_len]
        prompts, cats = [p for p, _ in fits], [c for _, c in fits]
        dl = None
        if deadline is not None:  # an even share of what is left for each remaining run
            dl = time.perf_counter() + (deadline - time.perf_counter()) / ((len(jobs) - n) * (2 if base else 1))
        r = run_acceptance(engine, prompts, temp, a.eval_max_new_tokens, a.seed, dl, cats)
        r.update({"dataset": ds, "temperature": temp})
        if base is not None:
            dl = time.perf_counter() + (deadline - time.perf_counter()) / ((len(jobs) - n) * 2 - 1) if deadline else None
            b = run_acceptance(base, prompts[: r["prompts"]], temp, a.eval_max_new_tokens, a.seed, dl)
            r["target_only_tok_s"] = b["tok_s"]
            r["speedup"] = round(r["tok_s"] / b["tok_s"], 3) if b["tok_s"] and r["tok_s"] else None
            if temp == 0 and not b["cut_by_budget"]:
                r["rows_equal_target_only"] = sum(x == y for x, y in zip(r["token_ids"], b["token_ids"]))
        r.pop("token_ids")
        fin = "; ".join(f"{k} {g['requests']} ({g['tokens']} tok, accept_len {g.get('accept_len')}, "
                        f"repeat {g['repeat_frac']})" for k, g in r["by_finish"].items())
        log(f"eval: {ds} T={temp}: {r['prompts']}/{r['of']} prompts, accept_len {r.get('accept_len')}, "
            f"per depth {r.get('accept_rate_per_depth')}, {r['tok_s']} tok/s" + (" (cut by budget)" if r["cut_by_budget"] else "")
            + f"\n      by finish: {fin}"
            + ("\n      by category: " + ", ".join(f"{k} {g.get('accept_len')} ({g['requests']})" for k, g in r["by_category"].items())
               if len(r.get("by_category", {})) > 1 else ""))
        runs.append(r)
    res = {"draft": draft, "device": a.device, "dtype": a.dtype, "batch": a.eval_batch,
           "max_new_tokens": a.eval_max_new_tokens, "load_s": round(t_load, 2), "runs": runs,
           "time_s": round(time.perf_counter() - t0, 2), "hardware": hardware(a.device)}
    (out / "eval.json").write_text(json.dumps(res, indent=1) + "\n")
    engine = base = None
    free()
    return res


# --- report ------------------------------------------------------------------------------------------------
def table(summary: dict[str, Any]) -> str:
    lines = ["", "| phase | seconds | result |", "|---|---|---|"]
    ph = summary.get("phases", {})
    g = summary.get("generate")
    if g:
        r, t = g["run"], g.get("totals") or {}
        lines.append(f"| generate | {ph.get('generate', 0):.0f} | {r['seqs']} seqs, {r['gen_tokens']} tokens at "
                     f"{r['tok_s']} tok/s (stop: {r['stop']}); folder: {t.get('seqs')} seqs, {t.get('gen_tokens')} "
                     f"generated / {t.get('tokens')} tokens |")
    tr = summary.get("train")
    if tr:
        r = tr["result"]
        lines.append(f"| train | {ph.get('train', 0):.0f} | {r['steps']} steps, {r['epochs']} epochs, {r['tok_s']} tok/s "
                     f"(stop: {r['stop']}); vocab {tr['draft_vocab'] or 'full'} {tr['vocab_coverage'] or ''} |")
    ev = summary.get("eval")
    if ev:
        lines.append(f"| eval | {ph.get('eval', 0):.0f} | {len(ev['runs'])} runs on {ev['hardware']} |")
    lines.append(f"| total | {summary.get('total_s', 0):.0f} | |")
    if tr and tr.get("heldout_after"):
        b, aft = tr.get("heldout_before") or {}, tr["heldout_after"]
        lines += ["", "| held-out (teacher-forced) | " + " | ".join(f"depth {k + 1}" for k in range(len(aft["acc"]))) + " |",
                  "|---|" + "---|" * len(aft["acc"])]
        if b:
            lines.append("| top-1 agreement before | " + " | ".join(f"{x:.3f}" for x in b["acc"]) + " |")
        lines.append("| top-1 agreement after | " + " | ".join(f"{x:.3f}" for x in aft["acc"]) + " |")
        lines.append("| KL after | " + " | ".join(f"{x:.3f}" for x in aft["kl"]) + " |")
        if "smin" in aft:  # Σ min(p, q) at the TV temperature: the sampled acceptance, teacher-forced
            tau = tr.get("config", {}).get("tv_temperature", 0.7)
            if b.get("smin"):
                lines.append(f"| sampled agreement at T {tau:g} before | " + " | ".join(f"{x:.3f}" for x in b["smin"]) + " |")
            lines.append(f"| sampled agreement at T {tau:g} after | " + " | ".join(f"{x:.3f}" for x in aft["smin"]) + " |")
    if ev and ev["runs"]:
        s = max(len(r.get("accept_rate_per_depth") or []) for r in ev["runs"])
        lines += ["", "| dataset | T | prompts | accept_len | " + " | ".join(f"depth {k + 1}" for k in range(s))
                  + " | tok/s |", "|---|---|---|---|" + "---|" * s + "---|"]
        for r in ev["runs"]:
            rates = r.get("accept_rate_per_depth") or ["-"] * s
            lines.append(f"| {r['dataset']} | {r['temperature']} | {r['prompts']}/{r['of']} | {r.get('accept_len', '-')} | "
                         + " | ".join(str(x) for x in rates) + f" | {r['tok_s']} |")
    return "\n".join(lines)


def card(summary: dict[str, Any]) -> str:
    """The model card's text (OUT/draft/README.md), figures from this run."""
    tr, g, ev = summary.get("train") or {}, summary.get("generate") or {}, summary.get("eval") or {}
    c = tr.get("config", {})
    t = (g.get("totals") or {})
    st = g.get("settings") or {}
    lines = [f"# {summary.get('name', 'MTP draft')}", "",
             f"A {c.get('layers', '?')}-layer chain MTP draft for `{summary.get('model')}`"
             + (f" ({c['blocks']} decoder blocks per step)" if c.get("blocks", 1) > 1 else "")
             + (f", layer 0 also reading the target's streams after layers {c['aux_layers']} (fused features)"
                if c.get("aux_layers") else "")
             + (", layers " + ", ".join(f"{k} and {j}" for k, j in sorted(c["tied"].items()))
                + " running the same decoder blocks (stored once)" if c.get("tied") else "")
             + ", trained by `mleagle train-draft` on the target's own responses. mleagle format (`draft_config.json` "
             "+ bf16 safetensors shards); load with `--draft PATH`.", "",
             "## Data", ""]
    if g:
        where = (f"your own prompts ({', '.join(f'`{x}`' for x in st['own_prompts'])}; deduplicated, "
                 f"{st.get('eval_holdout', 0)} held out for the evaluation below)" if st.get("own_prompts") else
                 "`prompts.jsonl` of the shared data folder (dedupe, MT-Bench and GSM8K test turns removed)")
        lines += [f"- prompts: {where}, {st.get('prompts')} prompts, shuffled with seed {st.get('seed')}; by source: "
                  f"{t.get('by_source')}",
                  f"- responses: generated by mleagle's engine ({g.get('device')}, {st.get('dtype')}, batch "
                  f"{g.get('batch')}), temperature mix {st.get('temperature_mix')}, max {st.get('max_new_tokens')} "
                  "new tokens",
                  f"- {t.get('seqs')} sequences, {t.get('gen_tokens')} generated tokens ({t.get('tokens')} with "
                  f"prompts), {t.get('cut')} cut by the time budget", ""]
    else:  # trained on data made earlier (--data): what it read
        lines += [f"- data made earlier: `{tr.get('data')}`: {tr.get('train_seqs', 0) + tr.get('heldout_seqs', 0)} "
                  f"sequences, {tr.get('train_tokens')} training tokens (prompts included), "
                  f"{tr.get('heldout_seqs')} held out", ""]
    if tr.get("init_draft"):
        lines += [f"- started from the draft `{tr['init_draft']}` (its weights and draft vocabulary)", ""]
    lines += [
             "## Training", "",
             f"- {tr.get('result', {}).get('steps')} steps, {tr.get('result', {}).get('epochs')} epochs, "
             f"{c.get('batch_tokens')} padded tokens per step, {tr.get('result', {}).get('train_s')} s "
             f"on {summary.get('hardware')}",
             f"- loss: {c.get('kl_weight')}·KL(target ‖ draft) + {c.get('ce_weight')}·CE(greedy token), depth weights "
             f"{c.get('depth_weights') or 'default 0.8^k'}, AdamW lr {c.get('lr')} (warm-up {c.get('warmup')}, cosine to "
             f"{c.get('min_lr_frac')}×), weight decay {c.get('weight_decay')}, clip {c.get('grad_clip')}, init "
             f"`{c.get('init')}`, seed {c.get('seed')}, target in {tr.get('model_dtype')}, autocast "
             f"{tr.get('autocast') or 'none'} (float32 master weights)",
             f"- draft vocabulary: {tr.get('draft_vocab') or 'the target’s'}; response-token coverage {tr.get('vocab_coverage')}",
             f"- held-out teacher-forced top-1 agreement per depth: {(tr.get('heldout_after') or {}).get('acc')}", "",
             "## Acceptance (this run's eval through the engine)", "",
             f"{ev.get('hardware', '')}, {ev.get('dtype', '')}, batch {ev.get('batch')}, up to {ev.get('max_new_tokens')} new "
             "tokens; accept_len counts the bonus token (S+1 at most).", ""]
    runs = ev.get("runs") or []
    if runs:
        s = max(len(r.get("accept_rate_per_depth") or []) for r in runs)
        lines += ["| dataset | temperature | prompts | accept_len | " + " | ".join(f"depth {k + 1}" for k in range(s)) + " |",
                  "|---|---|---|---|" + "---|" * s]
        for r in runs:
            lines.append(f"| {r['dataset']} | {r['temperature']} | {r['prompts']} | {r.get('accept_len')} | "
                         + " | ".join(str(x) for x in (r.get("accept_rate_per_depth") or [])) + " |")
    lines += ["", "## Reproduce", "", "```", summary.get("command", ""), "```", ""]
    return "\n".join(lines)


# --- main ------------------------------------------------------------------------------------------------
def run(a: argparse.Namespace) -> int:
    resolve_device(a)
    if a.phase in ("train", "all"):
        train_config(a).weights()  # bad training settings fail now, not after generation
    check_inputs(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "mleagle train-draft " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["train-draft"] else sys.argv[1:])
    summary: dict[str, Any] = {"command": cmd, "model": a.model, "phase": a.phase, "hardware": hardware(a.device),
                               "phases": {}, "name": f"{Path(a.model).stem}-mtp{getattr(a, 'layers', '')}"}
    budget = getattr(a, "time_budget_s", None)
    eval_reserve = 0.0
    if budget:
        eval_reserve = a.eval_budget_s if a.eval_budget_s is not None else 0.15 * budget
    end = T_START + budget if budget else None

    try:
        run_phases(a, summary, end, eval_reserve)
    except BaseException as err:
        # Keep what exists (the generated data above all: a second run can train from data.npz
        # without generating again), then fail loudly.
        summary["error"] = f"{type(err).__name__}: {err}"
        finish(a, out, summary)
        raise
    finish(a, out, summary)
    return 0


def run_phases(a: argparse.Namespace, summary: dict[str, Any], end: float | None, eval_reserve: float) -> None:
    phases: dict[str, float] = summary["phases"]
    budget = getattr(a, "time_budget_s", None)
    engine = None
    if a.phase == "generate" or (a.phase == "all" and not a.data):
        t0 = time.perf_counter()
        kv = a.gen_batch * (a.max_prompt_tokens + a.max_new_tokens + 32)
        engine = make_engine(a, batch=a.gen_batch, kv_tokens=kv, prefill_chunk=a.gen_prefill_chunk)
        phases["load"] = round(time.perf_counter() - t0, 2)
        dl = time.perf_counter() + a.gen_time_budget_s if a.gen_time_budget_s else None
        stop = None
        if end is not None and budget:
            share = T_START + a.gen_frac * (budget - eval_reserve)
            dl = min(dl, share) if dl else share
            stop = plan_generation(a, engine, end - eval_reserve, summary)
        t0 = time.perf_counter()
        summary["generate"] = phase_generate(a, engine, dl, stop)
        phases["generate"] = round(time.perf_counter() - t0, 2)
    if a.phase in ("train", "all"):
        t0 = time.perf_counter()
        if engine is None:
            engine = make_engine(a)
            phases["load"] = round(time.perf_counter() - t0, 2)
        model, eos = engine.model, sorted(engine.eos_ids)
        summary["model_name"] = engine.model_name
        engine = None
        free()  # the engine's KV pools; the model stays (the frozen teacher)
        t0 = time.perf_counter()
        dl = end - eval_reserve if end is not None else None
        summary["train"] = phase_train(a, model, eos, dl)
        phases["train"] = round(time.perf_counter() - t0, 2)
        model = None
    engine = None
    free()
    if a.phase in ("eval", "all"):
        t0 = time.perf_counter()
        dls = [x for x in (end - 3.0 if end is not None else None,
                           time.perf_counter() + a.eval_time_budget_s if a.eval_time_budget_s else None) if x]
        summary["eval"] = phase_eval(a, min(dls) if dls else None)
        phases["eval"] = round(time.perf_counter() - t0, 2)


def finish(a: argparse.Namespace, out: Path, summary: dict[str, Any]) -> None:
    """summary.json, the model card, the export (when asked) and the table: also after a failure."""
    from mleagle.engine.spec.train_data import read_manifest, shard_files

    summary["data_manifest"] = read_manifest(out / "data")
    summary["total_s"] = round(time.perf_counter() - T_START, 2)
    name = "summary.json" if a.phase == "all" else f"summary_{a.phase}.json"
    (out / name).write_text(json.dumps(summary, indent=1) + "\n")
    if a.phase == "all" and (out / "draft").is_dir() and "train" in summary:
        (out / "draft" / "README.md").write_text(card(summary))
    if a.phase == "all" and a.export:
        try:
            export(out, Path(a.export), summary, with_data=bool(shard_files(out / "data")) and not a.data)
        except Exception as err:  # never hide the original error behind an export failure
            log(f"export failed: {type(err).__name__}: {err}")
    print(table(summary))
    log(f"wrote {out / name}" + (f" and {out / 'draft' / 'README.md'}" if a.phase == "all" else "")
        + (f"; deliverables in {a.export}" if a.phase == "all" and a.export else "")
        + (f"; stopped by {summary['error']}" if "error" in summary else ""))


def plan_generation(a: argparse.Namespace, engine: Any, train_end: float, summary: dict[str, Any]) -> Any:
    """Measure a training step's throughput, then return the rule that stops generation once training on
    the data so far for `epochs` epochs would take all the time left before `train_end`."""
    from mleagle.engine.spec.train import train_throughput

    t0 = time.perf_counter()
    n = a.draft_vocab or None
    if a.draft_vocab_coverage is not None:
        n = None  # unknown before the data exists: the whole vocabulary (slower, so the plan errs safe)
    rate = train_throughput(engine.model, train_config(a), n)
    free()
    pad = 1.15  # length-bucketed batches pad ~5-15%
    margin = 15.0  # held-out passes, the save
    summary["plan"] = {"train_tok_s_probe": round(rate, 1), "probe_s": round(time.perf_counter() - t0, 2),
                       "plan_epochs": a.plan_epochs, "pad": pad}
    log(f"plan: training runs ~{rate:.0f} padded tok/s (probe {time.perf_counter() - t0:.1f}s): generation stops "
        f"once {a.plan_epochs} epochs of its data would fill the training time left")

    def stop(tokens: int) -> bool:
        return a.plan_epochs * tokens * pad / rate >= train_end - time.perf_counter() - margin

    return stop


def export(out: Path, dest: Path, summary: dict[str, Any], with_data: bool = True) -> None:
    """The deliverables in at most 8 files below 16 MiB: draft/{draft_config.json, draft*.safetensors,
    README.md}, data.npz (every sequence, shard format, compressed) and summary.json."""
    import shutil

    from mleagle.engine.spec.train_data import export_data

    dest.mkdir(parents=True, exist_ok=True)
    if (out / "draft").is_dir():
        (dest / "draft").mkdir(exist_ok=True)
        for f in sorted((out / "draft").iterdir()):
            if f.is_file():
                shutil.copy2(f, dest / "draft" / f.name)
    summary["export"] = {"data": export_data(out / "data", dest / "data.npz") if with_data else None}
    (dest / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    files = [p for p in dest.rglob("*") if p.is_file()]
    big = [f"{p.name} {p.stat().st_size / 2**20:.1f} MiB" for p in files if p.stat().st_size >= 16 * 2**20]
    if len(files) > 8 or big:
        log(f"export: WARNING {len(files)} files{', too big: ' + ', '.join(big) if big else ''} "
            "(one GPU run returns at most 8 files of 16 MiB)")


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    try:
        return run(a)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        if os.environ.get("MLEAGLE_DEBUG"):
            raise
        print(f"mleagle train-draft: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
