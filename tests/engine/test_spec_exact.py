"""Greedy speculative output equals target-only output token for token (issue 3, exactness).

Random drafts (chain and non-chain, S = 1..4, several seeds) accept almost nothing, so they test the
rejection path; the oracle draft (acceptance 1.0) and a noisy oracle target (mixed acceptance) make
EOS/stop-id, stop-string and max-token cuts land inside runs of accepted drafts. Every comparison is
against the target alone with the same batch composition, float32, chunked prefill on and off.
"""

from __future__ import annotations

import functools

import pytest

from mleagle.engine.contract.config import smollm2_gguf_path
from mleagle.engine.contract.sampling_params import SamplingParams
from tests.spec_helpers import greedy, oracle_engine, run, smol, tiny_engine

PROMPTS = [[1, 2, 3], list(range(5, 16)), [100], [7, 7, 7, 7, 7], list(range(30, 47)), [200, 3, 9, 41, 5, 6, 77, 8, 90]]


@functools.cache
def _tiny_plain() -> list[list[int]]:
    return run(tiny_engine(), PROMPTS, greedy(16))


def _cut_params(plain: list[list[int]], n: int = 16) -> list[SamplingParams]:
    """Per prompt: a full run, short max-token cuts, and stop ids that first occur mid-output."""
    ps = []
    for i, out in enumerate(plain):
        if i % 3 == 0:
            ps.append(greedy(n - i))
        elif i % 3 == 1:
            ps.append(greedy(n, stop_token_ids=[out[min(2 + i, len(out) - 1)]]))
        else:
            ps.append(greedy(1 + i))
    return ps


@functools.cache
def _tiny_ref(chunk: int) -> list[list[int]]:
    return run(tiny_engine(chunked_prefill_size=chunk), PROMPTS, _cut_params(_tiny_plain()))


@pytest.mark.parametrize("chunk", [5, 0])
@pytest.mark.parametrize("draft", ["random:1", "random:2:1:nochain", "random:3:2", "random:4:3:nochain",
                                   "random:3:5:nochain", "random:4:6"])
def test_random_draft_exact_tiny(draft: str, chunk: int) -> None:
    ref = _tiny_ref(chunk)
    assert len({len(o) for o in ref}) > 2  # the cuts really differ per request
    e = tiny_engine(draft, chunked_prefill_size=chunk)
    assert run(e, PROMPTS, _cut_params(_tiny_plain())) == ref
    assert e.worker.stats.num_verify > 0


O_PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11], list(range(20, 33)), [40]]


def _oracle_params(plain: list[list[int]], s: int) -> list[SamplingParams]:
    # max-token cuts at every offset inside a window of S+1, and stop ids first met at offsets 1..S+2.
    ps = [greedy(1 + (i % (s + 2)) + 2 * i) for i in range(len(plain))]
    ps[1] = greedy(20, stop_token_ids=[plain[1][s + 1]])
    ps[3] = greedy(20, stop_token_ids=[plain[3][2 * s]])
    return ps


@pytest.mark.parametrize("noise", [0.0, 0.12])
@pytest.mark.parametrize(("s", "chunk"), [(1, 0), (2, 5), (3, 0), (4, 5), (3, 4)])
def test_oracle_cuts_inside_accepted_runs(s: int, chunk: int, noise: float) -> None:
    plain = run(oracle_engine(noise=noise), O_PROMPTS, greedy(24))
    ps = _oracle_params(plain, s)
    ref = run(oracle_engine(noise=noise, chunked_prefill_size=chunk), O_PROMPTS, ps)
    e = oracle_engine(f"random:{s}:0:{'chain' if s % 2 else 'nochain'}", noise=noise, chunked_prefill_size=chunk)
    out = e.generate(O_PROMPTS, ps)
    assert [c.token_ids for c in out] == ref
    assert out[1].finish_reason == "stop" and out[1].matched_stop == plain[1][s + 1]
    st = e.worker.stats
    if noise == 0.0:
        # Acceptance 1.0, so every cut above fell inside a run of accepted drafts.
        assert st.accepted_per_depth == [st.num_verify] * s
    else:
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens


def test_oracle_stop_strings_inside_accepted_runs() -> None:
    """A full-vocabulary oracle with SmolLM2's tokenizer: stop strings cut inside accepted runs."""
    tok = smollm2_gguf_path()
    kw = {"vocab": 49152, "tokenizer": tok}
    ref_e = oracle_engine(**kw)
    prompts = [[1000, 2000, 3000], [4321], list(range(5000, 5011))]
    plain = ref_e.generate(prompts, greedy(16))
    assert ref_e.tokenizer is not None
    params = []
    for j, c in enumerate(plain):
        k = 3 + 2 * j
        before = ref_e.tokenizer.decode(c.token_ids[:k])
        upto = ref_e.tokenizer.decode(c.token_ids[: k + 1])
        assert upto.startswith(before) and len(upto) > len(before)
        params.append(greedy(16, stop=[upto[len(before):][:3]]))
    ref = ref_e.generate(prompts, params)
    assert any(r.finish_reason == "stop" and len(r.token_ids) < 16 for r in ref)
    for s in (2, 3):
        e = oracle_engine(f"random:{s}", **kw)
        out = e.generate(prompts, params)
        assert [(c.token_ids, c.text, c.finish_reason, c.matched_stop) for c in out] == \
            [(c.token_ids, c.text, c.finish_reason, c.matched_stop) for c in ref]
        assert e.worker.stats.accepted_per_depth == [e.worker.stats.num_verify] * s


# --- the real model ---------------------------------------------------------------------------------
SMOL_PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3,"]


@pytest.mark.parametrize(("draft", "chunk"), [("random:2", 5), ("random:3:1:nochain", 0)])
def test_smollm2_exact(draft: str, chunk: int) -> None:
    ref_e = smol("none")
    ref_e.scheduler.chunk_size = 0
    plain = ref_e.generate(SMOL_PROMPTS, greedy(10))
    # A stop string taken from the middle of one output, an EOS-like stop id, and a short max-token cut.
    mid = plain[0].text[len(plain[0].text) // 2 :][:4]
    params = [greedy(10, stop=[mid]), greedy(10, stop_token_ids=[plain[1].token_ids[5]]), greedy(3)]
    for e in (ref_e, smol(draft)):
        e.scheduler.chunk_size = chunk
    ref = ref_e.generate(SMOL_PROMPTS, params)
    assert ref[0].finish_reason == "stop" and ref[1].finish_reason == "stop"
    out = smol(draft).generate(SMOL_PROMPTS, params)
    assert [(c.token_ids, c.text, c.finish_reason) for c in out] == [(c.token_ids, c.text, c.finish_reason) for c in ref]
