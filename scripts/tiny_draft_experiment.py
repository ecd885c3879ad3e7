"""Tiny, CPU-only draft-training experiments: what the loss mix, the init and a reduced vocabulary do.

A random-weight Llama (vocab 256, hidden 64, 2 layers, sharpened so greedy text depends on the
context, as tests/spec_helpers.py builds it) is the target. It answers 160 random prompts through the
engine (greedy for 3 in 4, T=0.7 otherwise); each configuration trains a fresh 3-layer draft on the
same sequences for the same steps, then reports teacher-forced held-out KL and top-1 agreement per
depth and the mean acceptance length through the engine (greedy, 24 held-out prompts, 32 tokens),
checking that speculative output equals target-only output, and at T = 0.7 (the same prompts, each
configuration in a fresh engine, so its own acceptance counts alone), beside the teacher-forced
sampled agreement Σ min(p, q) at 0.7. Weak evidence for a 135M target (a
random model's text is far less predictable than a chat model's), but it ranks choices cheaply.

    .venv/bin/python scripts/tiny_draft_experiment.py --out results/tiny_draft_experiment.json
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mleagle.engine.contract.config import EngineConfig, MleagleConfig, ModelArch, ModelSource
from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine
from mleagle.engine.spec import train as T
from mleagle.engine.spec import train_data as D
from mleagle.engine.spec.checkpoint import save_draft

ARCH = ModelArch(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)


def target(draft: str = "none") -> Engine:
    cfg = MleagleConfig(model=ModelSource(name="tiny", load_format="dummy", arch=ARCH),
                        engine=EngineConfig(max_total_tokens=4096, max_context_len=256))
    e = Engine(cfg, draft=draft, spec_policy="always")
    with torch.no_grad():  # sharpen attention and the head, so each token depends on the context
        for layer in e.model.layers:
            a = layer.self_attn
            a.qkv_proj.weight[: (a.hq + a.hk) * a.d] *= 8.0
        e.model.lm_head.weight *= 25.0
    if getattr(e, "draft_stack", None) is not None:
        e.draft_stack.head.refresh()
    return e


def generate(e: Engine, prompts: list[list[int]], n: int, temperature: float = 0.0) -> tuple[list[list[int]], float]:
    outs = e.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=n, seed=7))
    st = getattr(e.worker, "stats", None)
    return [o.token_ids for o in outs], (st.accept_len if st is not None else 1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0, help="prompts, data split and draft init")
    ap.add_argument("--only", default=None, help="comma list of configuration numbers (0-based) to run")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="tiny-draft-"))
    e = target()
    rng = random.Random(a.seed)
    jobs = [D.Job(i, [rng.randrange(1, 256) for _ in range(6 + i % 9)], 0.0 if i % 4 else 0.7) for i in range(160)]
    D.generate_data(e, jobs, work / "data", {"seed": 0}, max_new_tokens=48, shard_seqs=64)
    seqs = D.load_seqs(work / "data")
    train_s, held = D.split_holdout(seqs, 24, a.seed)
    counts = D.response_counts(train_s, 256)
    evalp = [[random.Random(1000 + i).randrange(1, 256) for _ in range(8)] for i in range(24)]
    ref, _ = generate(target(), evalp, 32)
    _, rand_len = generate(target("random:3"), evalp, 32)
    last, rand = {"init": "last"}, {"init": "random"}
    kl, mix, ce = {"kl_weight": 1.0, "ce_weight": 0.0}, {"kl_weight": 0.5, "ce_weight": 0.5}, {"kl_weight": 0.0, "ce_weight": 1.0}
    configs: list[tuple[str, dict[str, Any]]] = [  # every setting explicit: defaults may change
        ("KL 0.5 + CE 0.5, init last", mix | last),
        ("KL 1.0, init last", kl | last),
        ("CE 1.0, init last", ce | last),
        ("KL 0.8 + CE 0.2, init last", {"kl_weight": 0.8, "ce_weight": 0.2} | last),
        ("KL 0.5 + CE 0.5, init random", mix | rand),
        ("KL 1.0, init random (default)", kl | rand),
        ("default, equal depth weights", kl | rand | {"depth_weights": [1.0, 1.0, 1.0]}),
        ("default, draft vocab 192 ids", kl | rand | {"vocab": 192}),
        ("default, draft vocab 128 ids", kl | rand | {"vocab": 128}),
        # the total-variation term at T 0.7 (1 - TV is the sampled acceptance there)
        ("KL 1.0 + TV 0.5", kl | rand | {"tv_weight": 0.5}),
        ("KL 1.0 + TV 2.0", kl | rand | {"tv_weight": 2.0}),
        ("TV 1.0 alone", {"kl_weight": 0.0, "ce_weight": 0.0, "tv_weight": 1.0} | rand),
    ]
    if a.only:
        configs = [configs[int(i)] for i in a.only.split(",")]
    rows = []
    for name, over in configs:
        vocab = D.select_vocab(counts, over.pop("vocab")) if "vocab" in over else None
        init = over.pop("init")
        torch.manual_seed(a.seed)
        stack = T.init_stack(e.model, 3, init, a.seed, T.hidden_rms(e.model, train_s) if init == "last" else 1.0, vocab)
        cfg = T.TrainConfig(layers=3, steps=a.steps, epochs=1000, lr=3e-3, warmup=10, batch_tokens=1024,
                            chunk_rows=1024, log_every_s=1e9, init=init, seed=a.seed, **over)
        tr = T.Trainer(e.model, stack, train_s, cfg)
        t0 = time.perf_counter()
        res = tr.run()
        ev = tr.evaluate(held)
        save_draft(stack, work / "d", torch.bfloat16)
        out, acc_len = generate(target(str(work / "d")), evalp, 32)
        _, acc_t07 = generate(target(str(work / "d")), evalp, 32, temperature=0.7)
        rows.append({"config": name, "train_s": round(time.perf_counter() - t0, 1), "steps": res["steps"],
                     "heldout_kl": ev["kl"], "heldout_acc": ev["acc"], "heldout_smin_t07": ev["smin"],
                     "accept_len": round(acc_len, 3), "accept_len_t07": round(acc_t07, 3),
                     "coverage_heldout": round(D.coverage(D.response_counts(held, 256), vocab), 4),
                     "exact": out == ref})
        print(f"{name}: accept_len {acc_len:.3f} (T 0.7: {acc_t07:.3f}), held-out acc {ev['acc']} "
              f"smin {ev['smin']}, exact {out == ref}", flush=True)
    print(f"\nrandom:3 draft: accept_len {rand_len:.3f}; {len(train_s)} training sequences "
          f"({sum(len(s) for s in train_s)} tokens), {a.steps} steps each\n")
    print("| configuration | held-out agreement per depth | held-out Σmin(p, q) at T 0.7 | held-out KL per depth "
          "| vocab coverage | accept_len | accept_len T 0.7 | exact |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {' / '.join(f'{x:.3f}' for x in r['heldout_acc'])} | "
              f"{' / '.join(f'{x:.3f}' for x in r['heldout_smin_t07'])} | "
              f"{' / '.join(f'{x:.2f}' for x in r['heldout_kl'])} | {r['coverage_heldout']} | {r['accept_len']} | "
              f"{r['accept_len_t07']} | {r['exact']} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"random_draft_accept_len": rand_len, "steps": a.steps, "seed": a.seed,
                                           "train_seqs": len(train_s), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
