"""The engine against HF transformers on the real SmolLM2 (float32): logits for prefill, step-by-step
decode and chunked prefill; greedy generations token for token; logprobs and prompt logprobs; and
batch invariance (a request's greedy output alone equals its output inside a mixed batch, with
chunked prefill on and off).

The HF model is built in the test from the same dequantised tensors (tests/hf_ref.py). Engine logits
come from the engine's own worker and runner (`EngineProbe`), not from a re-implementation.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/hf_ref.py (pytest runs with --import-mode=importlib)
from hf_ref import EngineProbe, hf_greedy, hf_logits, hf_model, rel_err

from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine

CHAT = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue, step by step.",
    "List five uses of Python for data work and explain each.",
]
TOL = 1e-4


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine("smollm2-135m", max_total_tokens=4096, max_running_requests=16, threads=1, dtype="float32")


@pytest.fixture(scope="module")
def hf(engine: Engine):
    return hf_model(engine)


@pytest.fixture(scope="module")
def greedy_ref(engine: Engine, hf) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, HF's 64 greedy tokens) per chat prompt."""
    out = []
    for p in CHAT:
        ids = engine.encode_prompt(p, chat=True)
        out.append((ids, hf_greedy(hf, ids, 64)))
    return out


def test_weights_held_once(engine: Engine) -> None:
    m = engine.model
    assert m.lm_head.weight is m.embed_tokens.weight  # tied head: one parameter, not a copy
    assert all(p.dtype == torch.float32 for p in m.parameters())


def test_prefill_logits_match_hf(engine: Engine, hf) -> None:
    ids = engine.encode_prompt(CHAT[1], chat=True)
    ref = hf_logits(hf, ids)
    p = EngineProbe(engine, ids)
    try:
        got = p.prefill()
    finally:
        p.close()
    assert got.shape == ref.shape
    assert rel_err(got, ref) < TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_decode_and_chunked_prefill_logits_match_hf(engine: Engine, hf, greedy_ref) -> None:
    ids, gen = greedy_ref[0]
    full = ids + gen
    ref = hf_logits(hf, full)  # causal: row j is HF's full forward over the prefix full[:j+1]
    p = EngineProbe(engine, ids)
    try:
        assert rel_err(p.prefill(), ref[: len(ids)]) < TOL
        errs = [rel_err(p.decode(t), ref[len(ids) + j - 1 + 1]) for j, t in enumerate(gen[:-1])]
    finally:
        p.close()
    assert len(errs) == 63 and max(errs) < TOL
    for chunk in (7, 32):
        p = EngineProbe(engine, full)
        try:
            got = p.prefill(chunk)
        finally:
            p.close()
        assert rel_err(got, ref) < TOL, f"chunk {chunk}"


def test_greedy_64_tokens_equal_hf_generate(engine: Engine, greedy_ref) -> None:
    sp = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
    comps = engine.generate([ids for ids, _ in greedy_ref], sp)
    for (_ids, ref), c in zip(greedy_ref, comps):
        assert c.token_ids == ref
        assert c.finish_reason == "length"
    # The texts are real English, not noise (a wrong Q/K permutation still produces "text")
    assert "robot" in engine.tokenizer.decode(greedy_ref[0][1]).lower()


def test_logprobs_equal_hf_log_softmax(engine: Engine, hf, greedy_ref) -> None:
    ids, gen = greedy_ref[2]
    n = 16
    sp = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    c = engine.generate([ids], sp)[0]
    assert c.token_ids == gen[:n]
    ref = torch.log_softmax(hf_logits(hf, ids + gen[:n]), dim=-1)
    assert c.logprobs is not None and len(c.logprobs) == n
    for j, lp in enumerate(c.logprobs):
        row = ref[len(ids) - 1 + j]
        assert lp.token_id == gen[j]
        assert abs(lp.logprob - float(row[gen[j]])) < TOL
        assert len(lp.top) == 5
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        assert lp.top[0][0] == gen[j]  # greedy: the chosen token is the best one
        for t, v in lp.top:
            assert abs(v - float(row[t])) < TOL
        assert set(t for t, _ in lp.top) == set(row.topk(5).indices.tolist())
    pl = c.prompt_logprobs
    assert pl is not None and len(pl) == len(ids) and pl[0] is None
    for i in range(1, len(ids)):
        e = pl[i]
        assert e is not None and e.token_id == ids[i]
        assert abs(e.logprob - float(ref[i - 1, ids[i]])) < TOL
        assert len(e.top) == 3 and e.top[0][1] >= e.top[1][1] >= e.top[2][1]
    assert all(math.isfinite(lp.logprob) for lp in c.logprobs)


@pytest.mark.parametrize("chunk", [0, 7])
def test_batch_invariance(engine: Engine, greedy_ref, chunk: int) -> None:
    """Alone vs inside a batch of mixed prompt lengths, with chunked prefill off (0) and tiny (7)."""
    n = 24
    tok = engine.tokenizer
    assert tok is not None
    mixed = [
        tok.encode("Hi"),
        greedy_ref[0][0],
        engine.encode_prompt("Translate 'good morning' into French, Spanish and German.", chat=True),
        tok.encode("The quick brown fox jumps over the lazy dog. " * 9),
        greedy_ref[1][0][:11],
    ]
    sp = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    old = engine.scheduler.chunk_size
    engine.scheduler.chunk_size = chunk
    try:
        alone = [engine.generate([p], sp)[0].token_ids for p in mixed[:2]]
        batch = [c.token_ids for c in engine.generate(mixed, sp)]
    finally:
        engine.scheduler.chunk_size = old
    assert batch[1][:n] == greedy_ref[0][1][:n]  # and equal to HF's
    assert alone[0] == batch[0]
    assert alone[1] == batch[1]
