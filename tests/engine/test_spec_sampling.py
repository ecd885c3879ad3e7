"""Lossless speculative sampling: samples follow the target's distribution exactly (issue 3).

A 12-token vocabulary model and a random (so quite different) draft. For one prompt the exact
target distribution of the 2nd and 3rd generated tokens (o1, o2) is computed from target-only
logits of every prefix (o0 and o0 o1), with the request's temperature and filters applied; thousands
of speculative requests are then compared with it by a chi-square test, for several temperatures,
top-p values, and top-k with min-p, on both acceptance paths: requests that bring their own seed
(coupled: the target-only draw of the seed's tape, a draft accepted while it equals it) and requests
that do not (Leviathan/Chen rejection sampling with the draft's distributions). Each path, broken to
accept every draft, must be rejected by the same test, so the test can fail. Seeded requests also give
exactly the target-only tokens, with any draft, alone or batched, on a prefix-cache miss or hit.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine
from mleagle.engine.sampling.processor import probs_from_logits, rows_from_params
from mleagle.engine.spec.worker import SpecWorker
from tests.spec_helpers import chaos, tiny_cfg

V = 12
PROMPT = [1, 2, 3]
N = 2000


def _engine(draft: str, policy: str = "always") -> Engine:
    cfg = tiny_cfg("v12", vocab=V, hidden=32, layers=2, heads=4, kv=2, inter=64, seed=3)
    e = Engine(cfg, draft=draft, max_running_requests=256, max_total_tokens=8192, spec_policy=policy)
    chaos(e, head=12.0)
    return e


@functools.cache
def _raw() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw target log-probs after the prompt [V], after prompt+o0 [V, V], after prompt+o0+o1 [V, V, V]."""
    e = _engine("none")
    prefixes = [PROMPT] + [PROMPT + [a] for a in range(V)] + [PROMPT + [a, b] for a in range(V) for b in range(V)]
    out = e.generate(prefixes, SamplingParams(temperature=0.0, max_new_tokens=1, logprobs=V))
    rows = torch.empty(len(prefixes), V)
    for i, c in enumerate(out):
        assert c.logprobs is not None
        for t, lp in c.logprobs[0].top:
            rows[i, t] = lp
    return rows[0], rows[1 : 1 + V], rows[1 + V :].view(V, V, V)


def _expected(sp: SamplingParams) -> torch.Tensor:
    """Exact joint distribution of (o1, o2) under the request's temperature and filters: [V, V]."""
    r0, r1, r2 = _raw()

    def probs(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return probs_from_logits(x, rows_from_params([sp] * n, [0] * n, [0] * n, V))

    p0 = probs(r0.view(1, V))[0]
    p1 = probs(r1)  # [o0, o1]
    p2 = probs(r2.view(V * V, V)).view(V, V, V)  # [o0, o1, o2]
    return torch.einsum("a,ab,abc->bc", p0, p1, p2)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    n = counts.sum()
    exp = probs.flatten() * n
    obs = counts.flatten().double()
    small = exp < 5
    if int(((exp == 0) & (obs > 0)).sum()):
        return 0.0  # a sample the target can never produce
    e_cells = torch.cat([exp[~small], exp[small].sum().view(1)])
    o_cells = torch.cat([obs[~small], obs[small].sum().view(1)])
    keep = e_cells > 0
    e_cells, o_cells = e_cells[keep], o_cells[keep]
    stat = float(((o_cells - e_cells) ** 2 / e_cells).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def _sample(draft: str, sp: SamplingParams, seeded: bool = True, policy: str = "always") -> tuple[torch.Tensor, Engine]:
    """N requests of the prompt; `seeded`: each brings its own seed (the coupled path), else the engine
    seeds them (the rejection-sampling path)."""
    e = _engine(draft, policy)
    params = [sp.model_copy(update={"seed": 1000 + i if seeded else None, "max_new_tokens": 3}) for i in range(N)]
    out = e.generate([PROMPT] * N, params)
    counts = torch.zeros(V, V, dtype=torch.int64)
    for c in out:
        assert len(c.token_ids) == 3
        counts[c.token_ids[1], c.token_ids[2]] += 1
    return counts, e


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.5, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=5, min_p=0.05),
]


# Rejection sampling over every case; the coupled path over two (its tokens are the target-only draws,
# which `test_seeded_samples_equal_target_only_whatever_the_drafts` shows and the target-only test covers).
PATHS = [(sp, False) for sp in CASES] + [(CASES[1], True), (CASES[3], True)]


@pytest.mark.parametrize(("sp", "seeded"), PATHS,
                         ids=["t1", "t0.7-p0.9", "t1.5-p0.8", "t1-k5-minp", "coupled-t0.7-p0.9", "coupled-t1-k5-minp"])
def test_speculative_samples_match_target_distribution(sp: SamplingParams, seeded: bool) -> None:
    counts, e = _sample("random:2:4", sp, seeded)
    st = e.worker.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens  # both accept and reject paths ran
    assert _chi2_pvalue(counts, _expected(sp)) > 1e-3


@pytest.mark.parametrize(("sp", "seeded"), [(CASES[1], False), (CASES[3], True)], ids=["t0.7-p0.9", "coupled-t1-k5-minp"])
def test_samples_match_through_depth_switches(sp: SamplingParams, seeded: bool) -> None:
    """The speculation policy forced to switch depth every iteration (0, 1, 2, 0, ...: plain decode
    steps, shallow verifies and draft catch-ups in turn), prefix cache on: still the target's
    distribution, and every pool free afterwards."""
    counts, e = _sample("random:2:4", sp, seeded, policy="cycle")
    by_depth = e.worker.policy.stats.iterations_by_depth
    assert all(n > 0 for n in by_depth) and e.worker.policy.stats.catch_ups > 0
    assert e.mem.cache is not None and not e.mem.idle_problems()
    assert _chi2_pvalue(counts, _expected(sp)) > 1e-3


def test_target_only_sampling_matches_too() -> None:
    """The reference itself: target-only samples pass the same test (the expected table is right)."""
    sp = CASES[1]
    counts, _ = _sample("none", sp)
    assert _chi2_pvalue(counts, _expected(sp)) > 1e-3


def test_always_accept_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break rejection sampling (accept every draft the target could produce): the test must notice."""
    monkeypatch.setattr(SpecWorker, "_accept_uniform", staticmethod(lambda rows, bs, w: torch.zeros(bs, w - 1)))
    sp = CASES[0]
    counts, e = _sample("random:2:4", sp, seeded=False)
    assert e.worker.stats.num_accepted_tokens > 0
    assert _chi2_pvalue(counts, _expected(sp)) < 1e-6


def test_coupled_always_accept_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break the coupled path (every draft accepted, whatever the tape drew): the test must notice."""
    real = SpecWorker._couple

    def broken(p, rows, drafts, n, final, bs, w):  # type: ignore[no-untyped-def]
        nc, fc = real(p, rows, drafts, n, final, bs, w)
        full = torch.full_like(nc, w - 1)
        return full, fc

    monkeypatch.setattr(SpecWorker, "_couple", staticmethod(broken))
    sp = CASES[0]
    counts, e = _sample("random:2:4", sp, seeded=True)
    assert e.worker.stats.num_accepted_tokens == e.worker.stats.num_draft_tokens
    assert _chi2_pvalue(counts, _expected(sp)) < 1e-6


@pytest.mark.parametrize(("draft", "policy"), [("random:2:4", "always"), ("random:3:1:nochain", "always"),
                                               ("random:3:1:nochain", "cycle")])
def test_seeded_samples_equal_target_only_whatever_the_drafts(draft: str, policy: str) -> None:
    """A seeded sampled request gives the target-only tokens exactly: with a draft or without, alone or
    in a batch with other (seeded, unseeded, greedy) requests, on a prefix-cache miss and a hit, and
    whatever depth each iteration runs (policy `cycle`: plain decode steps included)."""
    cfg = tiny_cfg()
    sps = [SamplingParams(temperature=0.8, seed=7, max_new_tokens=24),
           SamplingParams(temperature=1.2, top_p=0.9, top_k=20, seed=11, max_new_tokens=20, repetition_penalty=1.1)]
    prompts = [list(range(30, 50)), list(range(30, 44)) + [3, 4]]  # a shared 14-token prefix
    ref = Engine(cfg, draft="none", enable_prefix_cache=False)
    chaos(ref)
    want = [c.token_ids for c in ref.generate(prompts, sps)]
    e = Engine(cfg, draft=draft, spec_policy=policy)
    chaos(e)
    alone = [e.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, sps)]  # the second one hits the cache
    assert e.scheduler.prefix_hits > 0
    again = [e.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, sps)]  # both hit now
    mixed = e.generate([prompts[1], [5, 6, 7], prompts[0], [9, 9, 1]],
                       [sps[1], SamplingParams(temperature=0.9, max_new_tokens=30), sps[0],
                        SamplingParams(temperature=0.0, max_new_tokens=12)])
    assert alone == want and again == want
    assert [mixed[2].token_ids, mixed[0].token_ids] == want
    assert e.worker.stats.num_accepted_tokens > 0
