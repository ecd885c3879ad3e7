"""The boundary-KV policy (DESIGN §3), shown on the draft pools themselves.

Under "stale" (the serving policy) draft layer k >= 1 keeps, at positions just before each
iteration's bonus, KV computed from tokens that were drafts at the time; where those drafts were
rejected the KV differs from what a fresh pass over the verified sequence gives. Under "recompute"
(the reference policy) every draft pool equals that fresh pass. Both policies leave the output
exactly the target's; only draft acceptance can differ.
"""

from __future__ import annotations

import torch

from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine
from mleagle.engine.core.request import Req
from mleagle.engine.spec.reference import RecomputeSpecWorker
from tests.spec_helpers import tiny_engine

PROMPT = [5, 17, 99, 3, 42, 8, 77, 120, 9, 31]
GREEDY = SamplingParams(max_new_tokens=40, temperature=0)


def _run_until(e: Engine, n_decode: int) -> Req:
    e.add_request("r", PROMPT, GREEDY)
    decodes = 0
    while decodes < n_decode:
        e.step()
        decodes += e.scheduler.last_mode == "DECODE"
    return e.scheduler.reqs["r"]


def _draft_kv(e: Engine, req: Req, upto: int) -> list[torch.Tensor]:
    slots = e.mem.maps[0].req_to_token[req.req_pool_idx, :upto]
    return [torch.cat([r.binding.kv_pool.k[0][slots], r.binding.kv_pool.v[0][slots]], -1) for r in e.worker.drafts]


def _fresh_draft_kv(seq: list[int], upto: int) -> list[torch.Tensor]:
    """A new engine prefilled over the committed sequence: every draft layer's KV computed fresh."""
    f = tiny_engine("random:3")
    f.add_request("f", seq, SamplingParams(max_new_tokens=8, temperature=0))
    f.step()  # one EXTEND over the whole sequence (the chunk budget exceeds it), then each draft layer
    assert f.scheduler.last_mode == "EXTEND" and not f.scheduler.reqs["f"].prefilling
    return _draft_kv(f, f.scheduler.reqs["f"], upto)


def test_recompute_matches_a_fresh_pass_and_stale_does_not() -> None:
    stale = tiny_engine("random:3")
    recompute = tiny_engine("random:3", spec_worker=RecomputeSpecWorker, enable_prefix_cache=False)
    rs, rr = _run_until(stale, 6), _run_until(recompute, 6)
    assert rs.output_ids == rr.output_ids  # same target, same verified tokens
    assert stale.worker.boundary_kv_stale_positions > 0
    # Positions whose draft inputs are all verified: the committed sequence minus the last S.
    upto = rr.kv_len - 3
    fresh = _fresh_draft_kv(rr.fill_ids[: rr.kv_len], upto)
    for k, (a, b) in enumerate(zip(_draft_kv(recompute, rr, upto), fresh)):
        assert torch.allclose(a, b, atol=1e-5), f"recompute: draft{k} pool differs from a fresh pass"
    got = _draft_kv(stale, rs, upto)
    assert torch.allclose(got[0], fresh[0], atol=1e-5), "layer 0 reads only verified tokens: never stale"
    assert any(not torch.allclose(g, f, atol=1e-3) for g, f in zip(got[1:], fresh[1:])), \
        "with random drafts (all rejected) layers >= 1 must hold stale boundary KV"


def test_both_policies_are_exact() -> None:
    want = tiny_engine().generate([PROMPT, PROMPT[:4]], GREEDY)
    for pol in ("stale", "recompute"):
        ref = {"spec_worker": RecomputeSpecWorker} if pol == "recompute" else {}
        e = tiny_engine("random:3", enable_prefix_cache=pol == "stale", **ref)
        got = e.generate([PROMPT, PROMPT[:4]], GREEDY)
        assert [c.token_ids for c in got] == [c.token_ids for c in want], pol
        assert not e.mem.idle_problems()


def test_forced_acceptance_accepts_the_forced_count() -> None:
    """The benchmarks' measuring worker: every iteration accepts exactly the forced number of drafts
    (eagerly, and inside the whole-iteration graph path), whatever the draft proposed."""
    from mleagle.engine.spec.reference import ForcedAcceptSpecWorker

    for over in ({}, {"graph_emulate": True}):
        e = tiny_engine("random:3", spec_worker=ForcedAcceptSpecWorker, spec_worker_kw={"accept": 2}, **over)
        e.generate([PROMPT, PROMPT[:4]], SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))
        st = e.worker.stats
        assert st.num_verify > 0 and st.num_accepted_tokens == 2 * st.num_verify, over
        assert st.accepted_per_depth == [st.num_verify, st.num_verify, 0]
        assert not e.mem.idle_problems()
