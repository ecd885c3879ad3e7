"""The engine's ways of running one workload, each against the reference: the synchronous eager engine
without a prefix cache. Overlap scheduling, emulated graphs (prefill buckets, staged and fused mixed
steps), pages of 1, 2 and 4 tokens, chunked prompts, two forwards instead of a fused mixed step, and a
pool small enough to preempt, target-only and with three draft layers: every request's tokens equal the
reference's and its logprobs agree, and every pool comes back free. The workload is arrivals every
other step that share prefixes (so the prefix cache serves some), with seeded sampling, penalties,
min_new_tokens, logprobs and stop tokens among greedy rows; a plain greedy one, where each mixed
step is staged whole into its graph (one such step reading another's buffer was a bug); and one with
structured-output requests (greedy and sampled, every grammar kind) among free ones. Each way also
aborts six requests (queued, prefilling or decoding): their tokens stop at a prefix of the
reference's, and no other request's change."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from mleagle.engine.contract.sampling_params import SamplingParams, StructuredOutputs
from mleagle.engine.core.engine import Engine
from tests.engine.test_constrain_engine import CASES, constrained
from tests.spec_helpers import all_free, greedy, tiny_cfg, tiny_engine

GRAPHS = dict(graph_emulate=True, prefill_graph_max_tokens=64)
# name -> (overlap, engine options)
WAYS: dict[str, tuple[bool, dict[str, Any]]] = {
    "overlap": (True, {}),
    "graphs": (True, GRAPHS),
    "graphs-page4": (True, dict(GRAPHS, page_size=4)),
    "graphs-page4-chunked": (True, dict(GRAPHS, page_size=4, chunked_prefill_size=16)),
    "graphs-two-forwards-page2": (True, dict(GRAPHS, page_size=2, fuse_mixed_steps=False)),
    "sync-graphs-page4": (False, dict(GRAPHS, page_size=4)),
    "graphs-preempting": (True, dict(GRAPHS, page_size=2, max_total_tokens=200)),
}

Script = list[tuple[str, list[int], SamplingParams]]


def workload(seed: int, kind: str) -> Script:
    rng = random.Random(seed)
    # (below 255, the constrained vocabulary's stop token)
    stems = [[rng.randrange(1, 250) for _ in range(rng.randint(8, 40))] for _ in range(4)]
    grammars = [so for _, so in CASES if so]
    script: Script = []
    for i in range(24):
        p = rng.choice(stems) + [rng.randrange(1, 250) for _ in range(rng.randint(1, 12))]
        sp = greedy(rng.randint(4, 24))
        if kind == "plain-greedy":
            pass
        elif kind == "constrained":
            if i % 3 == 1:
                sp = SamplingParams(temperature=0, max_new_tokens=20,
                                    structured_outputs=StructuredOutputs(**rng.choice(grammars)))
            elif i % 5 == 2:
                sp = SamplingParams(temperature=0.8, seed=i, max_new_tokens=16,
                                    structured_outputs=StructuredOutputs(**rng.choice(grammars)))
        elif i % 6 == 1:
            sp = SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_new_tokens=rng.randint(4, 20))
        elif i % 7 == 3:
            sp = SamplingParams(temperature=0.7, top_k=20, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.3,
                                frequency_penalty=0.2, seed=100 + i, max_new_tokens=rng.randint(4, 20))
        elif i % 10 == 5:
            sp = greedy(12, min_new_tokens=8, stop_token_ids=[rng.randrange(1, 256) for _ in range(30)],
                        repetition_penalty=1.1)
        elif i % 11 == 2:
            sp = greedy(6, logprobs=2)
        elif i % 9 == 4:
            sp = greedy(24, stop_token_ids=[rng.randrange(1, 256) for _ in range(20)])
        script.append((f"r{i}", p, sp))
    return script


def drive(e: Engine, script: Script, aborts: Sequence[tuple[int, str]] = ()
          ) -> tuple[dict[str, list[int]], dict[str, list[tuple[int, float]]]]:
    """One arrival every other step, and right after the n-th arrival the abort of each request paired
    with n in `aborts` (one added a few arrivals before: queued, prefilling or decoding); each request's
    tokens and (token, logprob) pairs."""
    toks: dict[str, list[int]] = {}
    lps: dict[str, list[tuple[int, float]]] = {}
    n = 0
    while n < len(script) or e.has_work():
        if n < len(script) and e.scheduler.num_steps % 2 == 0:
            rid, p, sp = script[n]
            e.add_request(rid, p, sp)
            toks[rid], lps[rid] = [], []
            n += 1
            for at, victim in aborts:
                if at == n:
                    e.abort(victim)
        for o in e.step():
            toks[o.rid] += o.token_ids
            lps[o.rid] += [(lp.token_id, lp.logprob) for lp in (getattr(o, "logprobs", None) or [])]
    return toks, lps


def engine(draft: str, overlap: bool, grammar: bool, **over: Any) -> Engine:
    e = tiny_engine(draft, cfg=tiny_cfg(), **over)
    e.scheduler.overlap = overlap
    return constrained(e) if grammar else e


KINDS = ["mixed-params", "plain-greedy", "constrained"]


@pytest.mark.parametrize("draft", ["none", "random:3"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_way_of_running_equals_the_reference(draft: str, kind: str) -> None:
    script = workload(1 + KINDS.index(kind), kind)
    grammar = kind == "constrained"
    want_toks, want_lps = drive(engine(draft, False, grammar, enable_prefix_cache=False), script)
    assert kind != "mixed-params" or any(want_lps.values())
    # Every way also aborts six requests one to four arrivals after theirs: they stop where they were
    # (a prefix of the reference's tokens), and the others do not notice.
    rng = random.Random(7)
    aborts = [(i + 1 + rng.randint(1, 4), f"r{i}") for i in rng.sample(range(18), 6)]
    gone = {rid for _, rid in aborts}
    for name, (overlap, over) in WAYS.items():
        e = engine(draft, overlap, grammar, **over)
        toks, lps = drive(e, script, aborts)
        for rid in gone:
            got = toks.pop(rid)
            assert got == want_toks[rid][: len(got)], (name, rid)
        assert toks == {r: t for r, t in want_toks.items() if r not in gone}, \
            (name, [r for r in toks if toks[r] != want_toks[r]][:5])
        for rid, want in want_lps.items():
            if rid in gone:
                continue
            got = lps[rid]
            assert [t for t, _ in got] == [t for t, _ in want], (name, rid)
            assert all(abs(a - b) <= 1e-4 for (_, a), (_, b) in zip(got, want)), (name, rid)
        assert e.scheduler.inflight is None and all_free(e), name
        st = e.stats()
        # (With 16-token chunks the prompts queue for the prefill: all are admitted, and so matched,
        # before the first request ends and gives its prefix to the cache.)
        assert st["prefix_cache"]["hits"] > 0 or "chunked" in name, (name, st["prefix_cache"])
        if name == "graphs-preempting":
            assert e.scheduler.num_preemptions > 0, name
        if draft == "none" and kind == "plain-greedy" and over.get("fuse_mixed_steps", True) and overlap and over.get("graph_emulate"):
            assert st["graph_fused_steps"] > 0, (name, st["graph_fused_steps"])
