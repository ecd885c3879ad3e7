"""Overlap scheduling (launch step N+1, then finish step N), forced on here so the CPU runs the same
bookkeeping the GPU does: outputs equal the synchronous schedule's, requests that stop or are aborted
while a step is in flight end exactly where they should, and every pool comes back free."""

from __future__ import annotations

import random

import pytest

from mleagle.engine.contract.sampling_params import SamplingParams
from tests.spec_helpers import all_free, greedy, run, tiny_cfg, tiny_engine

PROMPTS = [[5, 17, 30, 2], [9, 9, 1], list(range(40, 52)), [3], [100, 7, 7, 7, 8], [1, 2, 3, 4, 5, 6, 7]]


def _pair(draft: str, **over):
    cfg = tiny_cfg()
    sync = tiny_engine(draft, cfg=cfg, **over)
    ov = tiny_engine(draft, cfg=cfg, **over)
    ov.scheduler.overlap = True
    return sync, ov


@pytest.mark.parametrize("draft", ["none", "random:3"])
def test_overlap_outputs_equal_synchronous(draft: str) -> None:
    sync, ov = _pair(draft)
    sps = [greedy(n) for n in (30, 1, 17, 25, 2, 40)]
    sps[2] = greedy(17, stop_token_ids=[7, 9])
    sps[4] = SamplingParams(temperature=0.8, seed=5, max_new_tokens=19, logprobs=2)
    a = sync.generate(PROMPTS, sps)
    b = ov.generate(PROMPTS, sps)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    assert [[lp.token_id for lp in c.logprobs or []] for c in a] == [[lp.token_id for lp in c.logprobs or []] for c in b]
    assert ov.scheduler.inflight is None and all_free(ov)


def test_overlap_aborts_and_arrivals_leave_nothing_behind() -> None:
    _, ov = _pair("random:2", max_total_tokens=600)
    rng = random.Random(0)
    live: set[str] = set()
    n = 0
    for _ in range(300):
        if rng.random() < 0.3 and n < 60:
            rid = f"r{n}"
            n += 1
            p = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
            ov.add_request(rid, p, greedy(rng.randint(1, 40)))
            live.add(rid)
        if live and rng.random() < 0.1:
            ov.abort(rng.choice(sorted(live)))
        for o in ov.step():
            if o.finished:
                live.discard(o.rid)
    while ov.has_work():
        for o in ov.step():
            if o.finished:
                live.discard(o.rid)
    assert not live and all_free(ov) and ov.scheduler.inflight is None


def test_overlap_with_graph_emulation_equals_eager() -> None:
    cfg = tiny_cfg()
    ref = tiny_engine("none", cfg=cfg)
    e = tiny_engine("random:3", cfg=cfg, graph_emulate=True)
    e.scheduler.overlap = True
    sps = [greedy(20 + i) for i in range(len(PROMPTS))]
    assert run(e, PROMPTS, sps) == run(ref, PROMPTS, sps)
    assert all_free(e)
