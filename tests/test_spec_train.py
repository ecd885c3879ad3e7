"""Self-distillation on a tiny built model: the training loop lowers the draft's loss, and the saved
draft loads through `Engine(draft=PATH)` and serves exactly (speculative greedy == target-only greedy),
with better acceptance than the untrained (initial) stack."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from mleagle.engine.spec import train as T
from tests.spec_helpers import greedy, run, tiny_engine

PROMPTS = [[random.Random(i).randrange(1, 256) for _ in range(8 + i % 5)] for i in range(16)]


def _accept_len(e) -> float:
    return e.worker.stats.accept_len


def test_train_lowers_loss_and_serves_exactly(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    # Tiny matrices: one thread is many times faster than two on a loaded 2-core box (no OpenMP barrier spin).
    torch.set_num_threads(1)
    try:
        _check(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _check(tmp_path: Path) -> None:
    torch.manual_seed(0)
    e = tiny_engine()
    seqs = [T.Seq(p + c, len(p)) for p, c in zip(PROMPTS, run(e, PROMPTS, greedy(32)))]
    batches = T.make_batches(e.model, seqs, 512, bf16=False, hidden_dtype=torch.float32)
    # The teacher's dense forward is the engine's forward: its argmax reproduces the greedy tokens.
    b = batches[0]
    pred = e.model.compute_logits(b.hidden).argmax(-1)
    n, ln = int(b.n_prompt[0]), int(b.lens[0])
    assert torch.equal(pred[0, n - 1 : ln - 1], b.ids[0, n:ln])

    stack = T.init_stack(e.model, 2, "last", 0, T.hidden_rms(batches))
    init_dir = tmp_path / "init"
    T.save(stack, init_dir)
    before = T.evaluate(e.model, stack, batches, bf16=False)
    T.train(e.model, stack, batches, T.TrainConfig(steps=40, lr=3e-3, warmup=5, bf16=False, log_every=20))
    after = T.evaluate(e.model, stack, batches, bf16=False)
    for k in range(2):
        assert after["loss"][k] < 0.7 * before["loss"][k], (before, after)
        assert after["acc"][k] > before["acc"][k]

    out = tmp_path / "draft"
    T.save(stack, out)
    ref = run(tiny_engine(), PROMPTS[:8], greedy(24))
    spec = tiny_engine(str(out))
    assert run(spec, PROMPTS[:8], greedy(24)) == ref
    init = tiny_engine(str(init_dir))
    assert run(init, PROMPTS[:8], greedy(24)) == ref
    assert _accept_len(spec) > _accept_len(init)
