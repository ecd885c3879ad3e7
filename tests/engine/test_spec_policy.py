"""The speculation policy (issue 23): per-iteration depth S' in 0..S, draft layers that catch up.

Exactness through switches: with the policy forced to change depth every iteration (`cycle`: 0, 1,
…, S, 0, …) greedy float32 output equals target-only for chain and non-chain drafts, chunked or not,
on prefix-cache misses and hits, and every pool is free afterwards (the sampling side is in
test_spec_sampling.py). The catch-up is checked against the draft prefill it must equal: after
plain decode steps, a catch-up leaves every draft layer's KV where a prefill of the same sequence
puts it. The oracle draft keeps acceptance 1.0 at every depth through switches, so the drafts a
catch-up makes are right. The policy itself is checked on made-up costs: it picks the depth with the
most tokens per second, explores what it has not measured, switches only on a clear gain, and a
constrained batch always runs the full depth.
"""

from __future__ import annotations

import pytest
import torch

from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import EngineInputError
from mleagle.engine.spec.policy import Decision, SpecPolicy, _clipped_mean, size_bucket
from tests.spec_helpers import all_free, greedy, oracle_engine, run, tiny_engine

PROMPTS = [[1, 2, 3], list(range(5, 16)), [100], [7, 7, 7, 7, 7], list(range(30, 47)), [200, 3, 9, 41, 5, 6, 77, 8, 90]]


def _plain_steps_only(p: SpecPolicy) -> None:
    """Make a policy choose depth 0 (a plain decode step) for every iteration."""
    p.choose = lambda bs, constrained=False: Decision(0, "test")  # type: ignore[method-assign]


def _ref(chunk: int) -> list[list[int]]:
    return run(tiny_engine(chunked_prefill_size=chunk), PROMPTS, greedy(20))


@pytest.mark.parametrize(("draft", "chunk"), [("random:3:2", 5), ("random:2:1:nochain", 0), ("random:4:6", 0)])
def test_cycle_greedy_equals_target_only(draft: str, chunk: int) -> None:
    ref = _ref(chunk)
    e = tiny_engine(draft, spec_policy="cycle", chunked_prefill_size=chunk)
    assert run(e, PROMPTS, greedy(20)) == ref
    # Again: now every prompt hits the prefix cache the switching left behind.
    assert run(e, PROMPTS, greedy(20)) == ref
    st = e.worker.policy.stats
    assert all(n > 0 for n in st.iterations_by_depth) and st.catch_ups > 0
    assert e.scheduler.prefix_hits > 0
    assert all_free(e)


def test_off_never_runs_a_draft_and_auto_is_exact() -> None:
    ref = _ref(5)
    off = tiny_engine("random:3:2", spec_policy="off", chunked_prefill_size=5)
    assert run(off, PROMPTS, greedy(20)) == ref
    assert all(r.num_forwards == 0 for r in off.worker.drafts)
    assert off.worker.stats.num_verify == 0 and all_free(off)
    auto = tiny_engine("random:3:2", spec_policy="auto", chunked_prefill_size=5)
    assert run(auto, PROMPTS, greedy(20)) == ref and all_free(auto)


def test_oracle_accepts_everything_at_every_depth_through_switches() -> None:
    """Acceptance 1.0: the drafts after every catch-up (and every shallow iteration) are the target's."""
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11], list(range(20, 33)), [40]]
    plain = run(oracle_engine(), prompts, greedy(30))
    e = oracle_engine("random:3:0:chain", spec_policy="cycle")
    assert run(e, prompts, greedy(30)) == plain
    st, pst = e.worker.stats, e.worker.policy.stats
    assert pst.catch_ups > 0 and all(n > 0 for n in pst.iterations_by_depth)
    assert st.num_accepted_tokens == st.num_draft_tokens > 0  # every draft of every depth accepted
    assert e.worker.policy.acc == [1.0, 1.0, 1.0]


def _exact_positions(k: int, chain: bool, valid0: int, kv_len: int) -> list[int]:
    """Positions where draft layer k's KV must be equal after a catch-up and after a prefill of the same
    tokens. Layer k at p reads t_{p+k+1}: at the first prefill's last k positions that was a draft then
    (the boundary positions the stale policy keeps), and past the bonus in both it is one. In a chain,
    layer k also reads layer k-1's output, whose attention sees layer k-1's stale positions: from
    valid0-(k-1) on, a chain's layer k ≥ 2 legitimately differs."""
    first = list(range(0, valid0 - k))
    if chain and k >= 2:
        return first
    return first + list(range(valid0, kv_len - k))


@pytest.mark.parametrize("draft", ["random:3:2", "random:3:1:nochain"])
def test_catch_up_equals_prefill(draft: str) -> None:
    """Decode with plain steps only (the draft layers fall behind), catch up, and compare every draft
    layer's KV with a fresh engine's draft prefill over the same tokens: equal to float32 rounding at
    every position whose inputs are the same in both (`_exact_positions`), the catch-up's included."""
    prompt = list(range(40, 52))
    n_plain = 9
    e = tiny_engine(draft, spec_policy="cycle")
    w = e.worker
    _plain_steps_only(w.policy)
    e.add_request("a", prompt, greedy(64, ignore_eos=True))
    for _ in range(1 + n_plain):  # the prefill (its draft prefill included), then plain decode steps
        e.step()
    req = e.scheduler.reqs["a"]
    valid0 = req.draft_state.valid
    assert valid0 == len(prompt) and req.kv_len == len(prompt) + n_plain and req.draft_state.depth == 0
    w.catch_up([req])
    assert req.draft_state.valid == req.kv_len and req.draft_state.depth == w.steps
    seq = req.fill_ids[: req.kv_len]  # the committed tokens; fill_ids[kv_len] is the next input

    ref = tiny_engine(draft, spec_policy="always")
    ref.add_request("b", seq, greedy(8, ignore_eos=True))
    # One step: the prefill and its draft prefill (the request runs on: its slots stay held).
    ref.scheduler.step()
    rb = ref.scheduler.reqs["b"]
    assert rb.output_ids[0] == req.fill_ids[req.kv_len]  # the same bonus token (greedy exactness)
    compared = 0
    for k, (da, db) in enumerate(zip(w.drafts, ref.worker.drafts)):
        pos = torch.tensor(_exact_positions(k, w.chain, valid0, req.kv_len))
        pa = da.binding.req_to_token.req_to_token[req.req_pool_idx, pos]
        pb = db.binding.req_to_token.req_to_token[rb.req_pool_idx, pos]
        for layer in range(len(da.binding.kv_pool.k)):
            torch.testing.assert_close(da.binding.kv_pool.k[layer][pa], db.binding.kv_pool.k[layer][pb], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(da.binding.kv_pool.v[layer][pa], db.binding.kv_pool.v[layer][pb], atol=1e-5, rtol=1e-5)
        compared += sum(1 for p in pos.tolist() if p >= valid0)
    assert compared >= n_plain  # the catch-up's own positions were compared
    assert e.worker.policy.stats.catch_ups == 1


def test_a_catch_up_larger_than_the_prefill_graphs_runs_in_groups_that_fit_them() -> None:
    """Three requests 9 plain steps behind: 27 positions, more than the draft runners' largest prefill
    bucket (16, emulated graphs). The catch-up runs in groups that fit it (no eager forward), and leaves
    every draft layer's KV and the first drafts as one eager pass over all of them does."""
    prompts = [list(range(40 + 7 * i, 52 + 7 * i)) for i in range(3)]
    got = []
    for emulate in (False, True):
        e = tiny_engine("random:3:2", spec_policy="cycle", graph_emulate=emulate, prefill_graph_max_tokens=16,
                        max_running_requests=4)
        w = e.worker
        _plain_steps_only(w.policy)
        for i, p in enumerate(prompts):
            e.add_request(str(i), p, greedy(64, ignore_eos=True))
        e.step()  # the prefill of all three (and their draft prefill)
        for _ in range(9):
            e.step()
        reqs = [e.scheduler.reqs[str(i)] for i in range(3)]
        assert [r.kv_len - r.draft_state.valid for r in reqs] == [9, 9, 9]
        before = [dict(d.eager) for d in w.drafts]
        w.catch_up(reqs)
        if emulate:
            assert w._fill_groups([9, 9, 9]) == [[0], [1], [2]]
            assert [dict(d.eager) for d in w.drafts] == before  # every group replayed
            assert all(d.extend_graphs is not None for d in w.drafts)
        rpi = torch.tensor([r.req_pool_idx for r in reqs])
        kv = []
        for d in w.drafts:
            r2t = d.binding.req_to_token.req_to_token
            slots = torch.stack([r2t[r.req_pool_idx, : r.kv_len] for r in reqs])
            kv.append([(d.binding.kv_pool.k[i][slots], d.binding.kv_pool.v[i][slots]) for i in range(len(d.binding.kv_pool.k))])
        got.append((kv, w.state.drafts[rpi].clone()))
    (kv0, d0), (kv1, d1) = got
    assert torch.equal(d0, d1)
    for a, b in zip(kv0, kv1):
        for (ka, va), (kb, vb) in zip(a, b):
            torch.testing.assert_close(ka, kb, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(va, vb, atol=1e-5, rtol=1e-5)


def test_constrained_batch_runs_full_depth() -> None:
    p = SpecPolicy("auto", 3)
    assert p.choose(4, constrained=True).depth == 3
    assert SpecPolicy("off", 3).choose(4, constrained=True).depth == 0


def _teach(p: SpecPolicy, bs: int, cost: dict[int, float], acc: float) -> None:
    """Run the policy's exploration with made-up iteration costs and a per-draft acceptance `acc`."""
    for _ in range(40):
        d = p.choose(bs)
        accepted = [min(d.depth, int(acc * d.depth + 0.5))] * bs if d.depth else []
        p.observe(bs, d.depth, accepted, cost[d.depth])


def test_policy_picks_the_most_tokens_per_second() -> None:
    # Cheap verify (a memory-bound step): speculating to full depth pays.
    p = SpecPolicy("auto", 3)
    _teach(p, 1, {0: 1.0, 1: 1.05, 2: 1.1, 3: 1.15}, acc=1.0)
    d = p.choose(1)
    assert d.depth == 3 and d.predicted_gain > 3.0
    # Compute-bound: each verified row costs as much as a decode step; nothing is accepted.
    q = SpecPolicy("auto", 3)
    _teach(q, 8, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}, acc=0.0)
    assert q.choose(8).depth == 0
    # S timed first (`min_samples` iterations), then 0; nothing between. Those 3 iterations of 8 put
    # 24 request-iterations behind a_1 = 0: S could not win even were a_2 and a_3 1, so no more run to
    # measure them.
    assert q.stats.iterations_by_depth == [40 - q.min_samples, 0, 0, q.min_samples]
    # What each depth made, counted per request-iteration and per timed second (benchmarks print it
    # beside the choice): one token each, depth 3's iterations at 4 s, depth 0's at 1 s.
    st = q.stats
    assert st.rows_by_depth == [8 * (40 - q.min_samples), 0, 0, 8 * q.min_samples] == st.tokens_by_depth
    assert st.seconds_by_depth == [40.0 - q.min_samples, 0.0, 0.0, 4.0 * q.min_samples]
    assert st.timed_by_depth == st.iterations_by_depth
    # Full acceptance at depth 3: four tokens a request-iteration.
    assert p.stats.tokens_by_depth[3] == 4 * p.stats.rows_by_depth[3] > 0
    # Intermediate depths when asked for: each measured, and with every depth costing the same and
    # every draft accepted, the deepest wins.
    m = SpecPolicy("auto", 3, choices=[0, 1, 2, 3])
    _teach(m, 4, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}, acc=1.0)
    assert m.choose(4).depth == 3 and all(n > 0 for n in m.stats.iterations_by_depth)
    # Buckets are separate: a batch of 8 learned nothing for a batch of 1.
    assert q.choose(1).reason.startswith("explore")


def test_policy_switches_only_on_a_clear_gain_and_explores_the_runner_up() -> None:
    p = SpecPolicy("auto", 2, explore_every=16, margin=0.05, choices=[0, 1, 2], dwell=1)
    _teach(p, 2, {0: 1.0, 1: 1.5, 2: 2.0}, acc=0.0)  # depth 0 best by far
    assert p.choose(2).depth == 0
    # Depth 1 becomes 2 % better than depth 0 (acceptance 0.53 at cost 1.5): under the margin, no switch.
    p.acc = [0.53, 0.0]
    picks = [p.choose(2) for _ in range(32)]
    assert {d.depth for d in picks if d.reason == "best"} == {0}
    assert any(d.reason == "explore: runner-up" for d in picks)
    p.acc = [0.9, 0.0]  # now clearly better
    assert p.choose(2).depth == 1


def test_the_runner_up_is_not_explored_upwards_when_its_catch_up_costs_more_than_the_margin() -> None:
    """Depth 0 runs, the full depth is a close runner-up: a look at it every 16 iterations costs a
    catch-up; one of 2 iterations' time is over 5 % of 16 iterations, so it is never looked at, while a
    cheap catch-up is. Looking down (the layers are current) never waits for a catch-up."""
    def picks(catch_up: float) -> list[str]:
        p = SpecPolicy("auto", 1, explore_every=16, margin=0.05, dwell=1)
        _teach(p, 2, {0: 1.0, 1: 2.0}, acc=0.9)  # depth 1: 1.9 tokens for twice the cost, a close second
        assert p.choose(2).depth == 0
        p.catch_up_cost = catch_up
        return [p.choose(2).reason for _ in range(32)]

    assert "explore: runner-up" not in picks(2.0)
    assert "explore: runner-up" in picks(0.5)
    q = SpecPolicy("auto", 1, explore_every=16, margin=0.05, dwell=1)
    _teach(q, 2, {0: 1.0, 1: 1.0}, acc=0.9)  # depth 1 best
    q.acc, q.catch_up_cost = [0.1], 100.0  # still best (1.1 tokens at the same cost), depth 0 close
    assert q.choose(2).depth == 1
    assert "explore: runner-up" in [q.choose(2).reason for _ in range(32)]


def test_a_switch_holds_for_its_dwell() -> None:
    """Right after a switch the depth holds for `dwell` visits, whatever noise says meanwhile."""
    p = SpecPolicy("auto", 2, dwell=8, margin=0.0)
    _teach(p, 2, {0: 1.0, 2: 1.0}, acc=1.0)  # depth 2: three tokens for the price of one
    assert p.choose(2).depth == 2
    p.acc = [0.0, 0.0]  # now depth 0 is better: it switches
    assert p.choose(2).depth == 0
    p.acc = [1.0, 1.0]  # and back at once would flip each step: held for the dwell
    held = [p.choose(2).depth for _ in range(10)]
    assert held[:6] == [0] * 6 and held[-1] == 2


def test_a_switch_up_pays_for_its_catch_up_first() -> None:
    """Depth 1 is 10 % better per iteration than depth 0, but its catch-up costs 20 iterations of time:
    over a 64-iteration horizon that is not worth it, so the policy stays at 0; a cheap catch-up
    switches. Switching down needs no catch-up and is never held back by one."""
    def taught(catch_up: float) -> SpecPolicy:
        p = SpecPolicy("auto", 1, horizon=64, dwell=0)
        _teach(p, 4, {0: 1.0, 1: 1.0}, acc=0.0)  # equal costs, nothing accepted: depth 0 (tied: current)
        p.current[4] = 0
        p.acc = [0.1]  # depth 1 now 10 % better
        p.catch_up_cost = catch_up
        return p

    assert taught(20.0).choose(4).depth == 0
    assert taught(1.0).choose(4).depth == 1
    down = taught(20.0)
    down.current[4], down.acc = 1, [0.0]
    down.cost[(4, 1)] = 2.0  # depth 1 now twice the cost: down at once
    assert down.choose(4).depth == 0


def test_a_batch_hovering_across_buckets_does_not_flip_depth_with_them() -> None:
    """Bucket 2 learned depth 1 (10 % better there) and bucket 4 depth 0. The batch now runs at depth 0
    in bucket 4, and a request finishing moves it into bucket 2. Going up there pays a catch-up like
    any switch up, so with a catch-up of 20 iterations' time it stays at depth 0. With a cheap catch-up
    it goes up. A bucket that chose depth 0 while depth 1 ran goes down at once."""
    def taught(catch_up: float) -> SpecPolicy:
        p = SpecPolicy("auto", 1, horizon=64, dwell=0)
        _teach(p, 2, {0: 1.0, 1: 1.0}, acc=0.0)  # bucket 2: depth 1 costs what depth 0 does
        _teach(p, 4, {0: 1.0, 1: 2.0}, acc=0.0)  # bucket 4: twice
        p.acc = [0.1]  # depth 1 now gives 1.1 tokens: 10 % better in bucket 2, 45 % worse in bucket 4
        p.current[2], p.current[4] = 1, 0
        p.catch_up_cost = catch_up
        assert p.choose(4).depth == 0  # the batch runs at depth 0
        return p

    assert [taught(20.0).choose(2).depth for _ in range(3)] == [0, 0, 0]
    assert taught(1.0).choose(2).depth == 1
    up = taught(1.0)
    assert up.choose(2).depth == 1 and up.choose(4).depth == 0


def test_heavy_arrivals_make_drafting_pay_for_the_draft_prefill() -> None:
    """Depth 1 makes twice the tokens per iteration, but when every iteration brings a prefill whose draft
    prefill costs an iteration's time, plain decoding wins; with few arrivals drafting wins again."""
    p = SpecPolicy("auto", 1, dwell=0)
    _teach(p, 4, {0: 1.0, 1: 1.0}, acc=0.5)
    assert p.choose(4).depth == 1
    p.observe_fill(1.5)
    for _ in range(300):  # one completed prefill per iteration
        p.note_fill()
        p.observe(4, 0, [], None)
    assert 0.2 < p.fills_per_token < 0.3 and p.choose(4).depth == 0  # 1 per iteration of 4 tokens
    for _ in range(300):  # arrivals stop
        p.observe(4, 0, [], None)
    assert p.choose(4).depth == 1


def test_the_draft_prefill_charge_grows_with_the_tokens_a_deep_iteration_makes() -> None:
    """Requests end after so many tokens, so arrivals come per output token: an iteration of depth 3
    that makes twice the tokens of a plain one meets twice the arrivals. Charged per iteration as
    counted at depth 0 (0.1 fills of 2 s each: 0.2 s), depth 3 would still look 3 % better here; per
    token it pays 0.32-0.48 s of draft prefill an iteration and plain decoding wins."""
    p = SpecPolicy("auto", 3, dwell=0)
    _teach(p, 4, {0: 1.0, 3: 1.8}, acc=0.34)  # one draft accepted per request: 2 tokens an iteration
    assert p.tokens(3) == pytest.approx(2.0) and p.choose(4).depth == 3  # 2 / 1.8: 11 % better
    p.observe_fill(2.0)
    for i in range(300):  # plain iterations of 4 tokens, a prompt completing every 10th: 1 per 40 tokens
        if i % 10 == 0:
            p.note_fill()
        p.observe(4, 0, [0, 0, 0, 0], None)
    assert 0.02 < p.fills_per_token < 0.03
    assert p.choose(4).depth == 0


def test_policy_modes_and_buckets() -> None:
    c = SpecPolicy("cycle", 2)
    assert [c.choose(1).depth for _ in range(5)] == [0, 1, 2, 0, 1]
    assert SpecPolicy("always", 3).choose(64).depth == 3
    assert SpecPolicy("off", 3).choose(1).depth == 0
    with pytest.raises(ValueError, match="spec policy"):
        SpecPolicy("sometimes", 3)
    assert [size_bucket(b) for b in (1, 3, 5, 8, 9, 13, 17, 33, 64)] == [1, 4, 6, 8, 12, 16, 24, 48, 64]


def test_published_timings_reach_every_rank_alike() -> None:
    """Under tensor parallelism a rank's own clock is not used: rank 0's timings, published, make two
    policies (two ranks) choose alike."""
    r0, r1 = SpecPolicy("auto", 2, publish=True), SpecPolicy("auto", 2, publish=True)
    costs = {0: 1.0, 1: 0.7, 2: 3.0}
    for _ in range(12):
        d0, d1 = r0.choose(4), r1.choose(4)
        assert d0 == d1
        r0.observe(4, d0.depth, [1] * 4 if d0.depth else [], costs[d0.depth])
        r1.observe(4, d1.depth, [1] * 4 if d1.depth else [], costs[d1.depth] * 5)  # another clock
        pub = r0.take_published()
        r1.take_published()  # a follower's own timings are dropped
        r0.apply_published(pub)
        r1.apply_published(pub)
    assert r0.cost == r1.cost and r0.choose(4) == r1.choose(4)


def test_sampled_batch_under_auto_is_served() -> None:
    """Sampled and greedy requests side by side under `auto`: every request ends with its tokens."""
    e = tiny_engine("random:2:4", spec_policy="auto")
    sps = [SamplingParams(temperature=0.9, max_new_tokens=15), greedy(15), SamplingParams(temperature=0.7, seed=3,
                                                                                       max_new_tokens=15)]
    out = e.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9]], sps)
    assert [len(c.token_ids) for c in out] == [15, 15, 15]
    assert all_free(e)


def test_every_depth_has_its_graphs_emulated() -> None:
    """On the CPU the graph runners' buffers, padding and metadata run emulated: under `cycle` every
    depth's shapes are captured (decode, verify and draft extend at W = 1..S+1) and each depth's
    whole-iteration graph serves its iterations, exactly."""
    ref = _ref(0)
    e = tiny_engine("random:3:2", spec_policy="cycle", graph_emulate=True, max_running_requests=8)
    assert [1 + len(r.more_graphs) for r in e.runners] == [4, 3, 2, 1], e.graph_report
    assert run(e, PROMPTS, greedy(20)) == ref
    assert sorted(e.worker.iter_graphs) == [0, 1, 2, 3]
    assert all(sum(g.stats.replays.values()) > 0 for g in e.worker.iter_graphs.values())
    assert all_free(e)


def test_a_request_that_stopped_drafting_still_leaves_all_its_kv_to_the_cache() -> None:
    """A request decoded only by plain steps ends with its draft layers behind; before its KV goes to the
    prefix cache they catch up, so a follow-up turn hits everything a fully speculated request leaves
    (all but the last token, less the S positions a hit recomputes), and its output stays exact."""
    prompt = list(range(60, 75))
    hits = []
    for policy in ("plain", "always"):
        e = tiny_engine("random:3:2", spec_policy="always" if policy == "always" else "cycle")
        if policy == "plain":
            _plain_steps_only(e.worker.policy)
        first = e.generate([prompt], greedy(20, ignore_eos=True))[0].token_ids
        before = e.scheduler.prefix_hits
        nxt = e.generate([prompt + first + [7]], greedy(6))[0]
        hits.append(e.scheduler.prefix_hits - before)
        assert nxt.token_ids == run(tiny_engine(), [prompt + first + [7]], greedy(6))[0]
        assert all_free(e)
    assert hits[0] == hits[1] == len(prompt) + 20 - 1 - 3


def _force_depth(p: SpecPolicy, depth: int) -> None:
    """Make a policy choose `depth` for every iteration, as if it had just decided so."""
    d = Decision(depth, "test")
    p.last = d
    p.choose = lambda bs, constrained=False: d  # type: ignore[method-assign]


@pytest.mark.parametrize("draft", ["random:3:2", "random:3:1:nochain"])
def test_a_put_off_draft_prefill_catches_up_through_the_prefix_cache(draft: str) -> None:
    """While the batch decodes without drafts a finished prefill leaves the draft layers out, and the
    prefix cache keeps that request's target KV with its draft KV marked missing. A later request that
    hits it and drafts catches up over everything the cache gave it, from the hidden states the first
    request left in the pool: its draft KV then equals a fresh engine's draft prefill of the same
    tokens (float32), and its output stays exact."""
    prompt = list(range(80, 97))
    e = tiny_engine(draft, spec_policy="cycle")
    w = e.worker
    _force_depth(w.policy, 0)
    first = e.generate([prompt], greedy(12, ignore_eos=True))[0].token_ids
    assert all(r.num_forwards == 0 for r in w.drafts)  # the draft layers never ran
    seq = prompt + first + [7, 8]
    _force_depth(w.policy, w.steps)
    before = e.scheduler.prefix_hits
    e.add_request("b", seq, greedy(4, ignore_eos=True))
    e.step()  # its prefill past the hit; the draft layers' pass waits for the worker's next call
    w._flush_fill()  # type: ignore[attr-defined]  # which runs it over all of it (the hit included)
    req = e.scheduler.reqs["b"]
    hit = e.scheduler.prefix_hits - before
    assert hit == len(prompt) + 12 - 1 - w.steps and req.draft_state.valid == req.kv_len == len(seq)

    ref = tiny_engine(draft, spec_policy="always", enable_prefix_cache=False)
    ref.add_request("c", seq, greedy(4, ignore_eos=True))
    ref.scheduler.step()
    rc = ref.scheduler.reqs["c"]
    assert rc.output_ids == req.output_ids
    for k, (da, db) in enumerate(zip(w.drafts, ref.worker.drafts)):
        pos = torch.arange(req.kv_len - k)  # past the bonus a layer reads drafts, in both
        pa = da.binding.req_to_token.req_to_token[req.req_pool_idx, pos]
        pb = db.binding.req_to_token.req_to_token[rc.req_pool_idx, pos]
        for layer in range(len(da.binding.kv_pool.k)):
            torch.testing.assert_close(da.binding.kv_pool.k[layer][pa], db.binding.kv_pool.k[layer][pb], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(da.binding.kv_pool.v[layer][pa], db.binding.kv_pool.v[layer][pb], atol=1e-5, rtol=1e-5)
    while e.has_work():
        e.step()
    assert all_free(e)
    again = e.generate([seq], greedy(10))[0].token_ids  # a hit on complete draft KV now
    assert again == run(tiny_engine(), [seq], greedy(10))[0]


def test_spec_depths_add_depths_between_for_auto() -> None:
    """`spec_depths` gives `auto` depths between 0 and S to choose from (0 and S always in): each gets its
    whole-iteration graph, the output stays exact, and a depth past the draft's steps is refused."""
    ref = _ref(0)
    e = tiny_engine("random:3:2", spec_policy="auto", spec_depths=[2], graph_emulate=True, max_running_requests=8)
    assert e.worker.policy.choices == [0, 2, 3] and e.worker.graph_depths() == [0, 2, 3]
    assert run(e, PROMPTS, greedy(20)) == ref
    assert sorted(e.worker.iter_graphs) == [0, 2, 3] and all_free(e)
    with pytest.raises(EngineInputError, match="spec-depths"):
        tiny_engine("random:3:2", spec_policy="auto", spec_depths=[0, 4])
    from pydantic import ValidationError

    from mleagle.engine.contract.config import EngineConfig

    with pytest.raises(ValidationError, match="auto policy"):
        EngineConfig(spec_policy="always", spec_depths=[2])  # only auto chooses: refused, not ignored
    with pytest.raises(ValidationError):
        EngineConfig(spec_depths=[-1])


def test_the_warm_up_times_each_depth_per_bucket_and_keeps_only_the_timings() -> None:
    """`Engine.warm_up` under `auto` times depth 0 and S in each batch-size bucket it has the time for
    (smallest first), then forgets everything but the timings: no iteration, acceptance or switch is
    counted, pools are free; traffic in a timed bucket then never runs an explore iteration to time it,
    and greedy output is still target-only's."""
    prompts = [[5, 6, 7, 8, 9], [9, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6]]
    want = run(tiny_engine(), prompts, greedy(24))
    e = tiny_engine("random:2", spec_policy="auto", spec_prime_s=30.0, max_running_requests=8)
    p = e.worker.policy  # type: ignore[attr-defined]
    assert e.warm_up(lengths=(8, 24)) > 0
    assert all(p.timed(b) for b in (1, 2, 4, 6, 8)), p.samples
    assert p.cost[(4, 2)] > 0 and p.cost[(4, 0)] > 0
    st = p.stats
    assert sum(st.iterations_by_depth) == st.explore_iterations == st.switches == st.catch_ups == 0
    assert p.acc == [0.0, 0.0] and p.acc_seen == [0, 0] and not p.current
    assert all_free(e) and e.scheduler.num_steps == 0
    _as_on_a_gpu(p)
    assert run(e, prompts, greedy(24)) == want
    # Buckets 1-4 were timed before the traffic came: the only measurement left is what it accepts.
    # It runs depth S until the evidence is in (a random draft's a_1 is soon measured at about 0, and
    # then S could not win), at most until 4 x min_evidence request-iterations (batches of 3) have.
    assert 1 <= p.stats.explore_iterations <= -(-4 * p.min_evidence // len(prompts))
    assert sum(p.stats.iterations_by_depth) > p.min_samples


def _as_on_a_gpu(p: SpecPolicy) -> None:
    """Make the warm-up's timings say every depth costs what the cheapest does (a batch of 1 on a GPU)
    and drop the draft fill's charge: drafting could then pay whatever the tiny CPU model's timings, so
    the policy must measure what the traffic accepts before it chooses."""
    floor = min(p.cost.values())
    p.primed = dict.fromkeys(p.cost, floor)
    p.fill_cost = 0.0


def test_no_timing_at_warm_up_without_the_budget_or_auto() -> None:
    for over in ({"spec_policy": "auto", "spec_prime_s": 0.0}, {"spec_policy": "always"}):
        e = tiny_engine("random:2", **over)
        e.warm_up(lengths=(8,))
        assert not e.worker.policy.cost  # type: ignore[attr-defined]


def test_after_the_warm_up_timing_auto_measures_acceptance_before_it_trusts_the_costs() -> None:
    """The warm-up times every depth but forgets what its own prompts accepted: the policy must then
    run the full depth until it has seen the traffic accept (`min_samples` request-iterations), not read
    every a_j as 0 and choose depth 0 without ever measuring what drafting makes. With an oracle draft
    it then knows every draft is accepted."""
    from tests.spec_helpers import oracle_engine

    e = oracle_engine("random:3", spec_policy="auto", spec_prime_s=30.0, max_running_requests=4)
    p = e.worker.policy  # type: ignore[attr-defined]
    e.warm_up(lengths=(8,))
    assert p.timed(1) and p.acc == [0.0, 0.0, 0.0]
    _as_on_a_gpu(p)
    seen: list[tuple[int, str]] = []
    choose = p.choose
    p.choose = lambda bs, constrained=False: (d := choose(bs, constrained), seen.append((d.depth, d.reason)))[0]
    e.generate([[3, 4, 5, 6]], greedy(60))
    assert seen[0] == (3, "explore: acceptance not measured yet"), seen[:5]
    # One request: one request-iteration each, every one reaching the last draft (60 tokens, 4 an
    # iteration). Each depth-3 iteration is an explore one until the evidence is in; the prompt's draft
    # fill, which on the tiny CPU model costs about an iteration, may put a depth-0 one between them.
    deep = [r for d, r in seen if d == 3]
    assert deep[: p.min_evidence] == ["explore: acceptance not measured yet"] * min(p.min_evidence, len(deep))
    assert p.stats.explore_iterations == min(p.min_evidence, len(deep))
    assert all(a > 0.9 for a in p.acc), p.acc


def test_a_deep_rate_moves_with_the_shallow_rates_it_is_built_on() -> None:
    """Acceptance is kept as conditional rates: a_j is c_1 ... c_j. A stretch at depth 3 of a 5-step
    draft, whose traffic accepts more than before, raises a_4 and a_5 with a_3 (their conditional rates
    unchanged), where unconditional rates measured only at depth 5 would stay where they were."""
    p = SpecPolicy("auto", 5, choices=[0, 3, 5])
    # Depth 5: a quarter accept no draft, the rest 2 or 5: c = 0.75, 1, 2/3, 1, 1; a_3 = a_4 = a_5 = 0.5.
    for _ in range(200):
        p.observe(4, 5, [0, 2, 5, 5], 1.0)
    assert p.cond == pytest.approx([0.75, 1.0, 2 / 3, 1.0, 1.0], abs=1e-6)
    assert p.acc == pytest.approx([0.75, 0.75, 0.5, 0.5, 0.5], abs=1e-6)
    assert p.acc_seen == [800, 600, 600, 400, 400]  # the request-iterations that reached each draft
    # Depth 3 on easier traffic: every draft accepted. c_1..c_3 move to 1; c_4, c_5 keep their value.
    for _ in range(2000):
        p.observe(4, 3, [3, 3, 3, 3], 1.0)
    assert p.cond[:3] == pytest.approx([1.0, 1.0, 1.0], abs=1e-3) and p.cond[3:] == [1.0, 1.0]
    assert p.acc == pytest.approx([1.0] * 5, abs=1e-3)


def test_the_warm_up_timing_is_a_ceiling_on_what_served_iterations_measure() -> None:
    """A served iteration's clock also holds what arrivals cost the step around it: after the warm-up's
    timing (`reset(keep_costs=True)`), a depth costs at most what the warm-up measured, and less where
    the served median is lower. Without the warm-up it is the served median alone."""
    p = SpecPolicy("auto", 3)
    for d, c in ((0, 1.0), (3, 1.2)):
        for _ in range(p.min_samples):
            p.observe(8, d, [1] * 8 if d else [], c)
    p.reset(keep_costs=True)
    assert p.primed == {(8, 0): 1.0, (8, 3): 1.2} and p.acc_seen == [0, 0, 0]
    for _ in range(p.window):
        p.observe(8, 3, [3] * 8, 3.0)  # served under arrivals: slower than the warm-up measured
        p.observe(8, 0, [], 0.5)  # and faster
    assert p.cost[(8, 3)] == 3.0 and p.cost_of(8, 3) == 1.2 and p.cost_of(8, 0) == 0.5
    assert p.served[(8, 3)] == p.window and p.snapshot()["primed_ms"] == {"8:0": 1000.0, "8:3": 1200.0}
    q = SpecPolicy("auto", 3)
    for _ in range(p.min_samples):
        q.observe(8, 3, [3] * 8, 3.0)
    assert q.cost_of(8, 3) == 3.0
    q.reset()
    assert not q.primed and not q.cost


def _served(p: SpecPolicy, bs: int, cost: dict[int, float], n: int) -> list[Decision]:
    """`n` served iterations, every draft accepted, at made-up costs per depth."""
    out = []
    for _ in range(n):
        d = p.choose(bs)
        p.observe(bs, d.depth, [d.depth] * bs if d.depth else [], cost[d.depth])
        out.append(d)
    return out


def _primed(steps: int, cost: dict[int, float]) -> SpecPolicy:
    """A policy whose warm-up timed `cost`, then served at those costs with every draft accepted."""
    p = SpecPolicy("auto", steps, dwell=0, probe=4, choices=sorted(cost))
    _teach(p, 8, cost, acc=1.0)
    p.reset(keep_costs=True)
    _served(p, 8, cost, 20)  # served acceptance measured, at the warm-up's costs
    assert p.served[(8, 0)] == 0 and not p.slow
    return p


def test_drafting_that_costs_far_more_served_than_at_warm_up_is_weighed_against_depth_0_served() -> None:
    """A host that slows under load: the warm-up timed depth 3 at 1.2x depth 0, so with every draft
    accepted it makes 3.3x the tokens a second. Served, depth 3 costs 6 s against 1.1 for depth 0 (it
    makes 0.73x): past `slack` over its warm-up timing in most of a window, depth 0 is timed under
    the same traffic for `probe` iterations, and the served rates discount drafting until depth 0
    runs. Where served depth 3 stays within the slack, nothing is probed and depth 3 keeps running."""
    p = _primed(3, {0: 1.0, 3: 1.2})
    picks = _served(p, 8, {0: 1.1, 3: 6.0}, 40)
    reasons = [d.reason for d in picks]
    i = reasons.index("explore: drafting costs more served than at warm-up")
    assert i > p.window // 2 and [d.depth for d in picks[i : i + p.probe]] == [0] * p.probe
    # The look says why for all of its iterations, and the stats count them by that reason.
    assert reasons[i : i + p.probe] == [reasons[i]] * p.probe
    assert p.stats.explore_by_reason["drafting costs more served than at warm-up"] == p.probe
    assert sum(p.stats.explore_by_reason.values()) == p.stats.explore_iterations
    # The served rates put drafting's gain at about 1x, where the capped costs say 3.3x: depth 0 runs.
    assert p.slow == {8} and {d.depth for d in picks[-16:]} == {0}
    assert p.snapshot()["served_discount"]["8"] * 4 / 1.2 == pytest.approx(1.0, abs=0.05)
    q = _primed(3, {0: 1.0, 3: 1.2})
    picks = _served(q, 8, {0: 1.1, 3: 1.45}, 40)
    assert {d.depth for d in picks} == {3} and not q.slow
    # Past the slack but still far ahead of what depth 0 makes at its warm-up cost (4 tokens in 2 s
    # against 1 in 1): a look at depth 0 could not change the choice, so none is taken.
    r = _primed(3, {0: 1.0, 3: 1.2})
    picks = _served(r, 8, {0: 1.1, 3: 2.0}, 40)
    assert {d.depth for d in picks} == {3} and not r.slow


def test_the_served_discount_keeps_the_order_among_drafting_depths() -> None:
    """Depths 0, 3 and 5, all drafts accepted, warm-up costs 1.0 / 1.1 / 1.2: depth 5 is best. Served,
    depth 5 costs 5.5 (past the slack, and near what depth 0 makes) and depth 3 would cost 3; depth 0
    is timed served and drafting is discounted (6 tokens in 5.5 against 1 in 1.1: 1.2x, where the
    capped costs say 5x), but depth 5 still wins and depth 3, whose capped rate is discounted alike,
    is not chosen over it."""
    p = _primed(5, {0: 1.0, 3: 1.1, 5: 1.2})
    picks = _served(p, 8, {0: 1.1, 3: 3.0, 5: 5.5}, 60)
    assert p.slow == {8} and p.snapshot()["served_discount"]["8"] == pytest.approx(6 / 5.5 * 1.1 / 5, rel=0.05)
    assert [d.depth for d in picks if not d.reason.startswith("explore")] and {
        d.depth for d in picks if not d.reason.startswith("explore")} == {5}


def test_a_stall_moves_the_served_mean_little_and_a_shared_tail_counts() -> None:
    """The served check's cost (`_clipped_mean`): one stall is cut to 4x the median; a tail every other
    iteration shares counts in full, where the median (the cost the policy chooses by) ignores both."""
    p = SpecPolicy("auto", 1)
    for c in [1.0] * 8 + [100.0]:
        p.observe(4, 1, [1] * 4, c)
    assert _clipped_mean(p._recent[(4, 1)]) == pytest.approx((8 + 4) / 9) and p.cost[(4, 1)] == 1.0
    q = SpecPolicy("auto", 1)
    for c in [1.0, 3.0] * 4 + [1.0]:  # every other iteration slow: the median says 1, the rate 1.9
        q.observe(4, 1, [1] * 4, c)
    assert _clipped_mean(q._recent[(4, 1)]) == pytest.approx(17 / 9) and q.cost[(4, 1)] == 1.0


def test_a_look_at_the_runner_up_lasts_probe_iterations() -> None:
    """Every `explore_every` visits the runner-up runs `probe` iterations in a row (one catch-up for
    all of them, and more than one request-iteration of evidence for its deep rates), then the best
    depth again."""
    p = SpecPolicy("auto", 2, explore_every=32, margin=0.05, choices=[0, 1, 2], dwell=1, probe=4)
    _teach(p, 2, {0: 1.0, 1: 1.5, 2: 2.0}, acc=0.0)  # depth 0 best by far
    p.acc = [0.45, 0.0]  # depth 1 a close runner-up (1.45 tokens at 1.5 times the cost)
    reasons = [p.choose(2).reason for _ in range(64)]
    i = reasons.index("explore: runner-up")
    assert reasons[i : i + 4] == ["explore: runner-up"] * 4 and reasons[i + 4] != "explore: runner-up"
    assert reasons.count("explore: runner-up") == 8  # two looks in 64 visits


@pytest.mark.parametrize("policy", ["auto", "cycle"])
def test_a_prefill_only_step_sends_its_first_tokens_before_the_draft_layers_pass(policy: str) -> None:
    """A step that only prefills (nothing decodes behind it) returns its first tokens with the draft
    layers' pass over the prompt still to do; the next step does it before its iteration (counted as a
    draft fill), and greedy output is target-only's. A request that ends at its first token leaves
    nothing to fill and the pools free. (Under the policies that keep the hidden-state pool: `always`
    fills at once, from the prefill's own hidden states.)"""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [9, 10, 11]]
    want = run(tiny_engine(), prompts, greedy(12))
    e = tiny_engine("random:3", spec_policy=policy)
    w = e.worker
    e.add_request("a", prompts[0], greedy(12))
    outs = e.step()
    assert [o.rid for o in outs] == ["a"] and len(outs[0].token_ids) == 1  # the first token is out
    req = e.scheduler.reqs["a"]
    assert w._fill_later == [req] and req.draft_state.valid == 0 and req.draft_state.depth == 0  # type: ignore[attr-defined]
    fills = w.policy.stats.fills  # type: ignore[attr-defined]
    e.step()
    assert not w._fill_later and req.draft_state.valid >= len(prompts[0])  # type: ignore[attr-defined]
    assert w.policy.stats.fills == fills + 1  # type: ignore[attr-defined]
    while e.has_work():
        e.step()
    assert run(e, prompts, greedy(12)) == want
    e.add_request("one", prompts[1], greedy(1))
    while e.has_work():
        e.step()
    assert not w._fill_later and all_free(e)  # type: ignore[attr-defined]


def test_a_depth_is_run_to_measure_its_acceptance_only_where_it_could_win() -> None:
    """The CPU's costs at a batch of 1 for a 5-step draft (depth 5 about twice depth 3): once a_1 rests
    on `min_evidence` request-iterations, depth 5 could not win even were every deeper draft accepted,
    so the full depth stops running to measure a_4 and a_5. With a GPU's costs (depth 5 a tenth over
    depth 3) the same traffic keeps it measuring until the deep rates are in or the cap is reached."""
    pattern = [0, 1, 2, 0, 3, 0, 1, 5]  # accepted drafts per iteration: a_1 = 5/8, rarely past 3

    def run(cost: dict[int, float]) -> list[int]:
        p = SpecPolicy("auto", 5, choices=[0, 3, 5])
        for d, c in cost.items():  # the warm-up's timings
            for _ in range(p.min_samples):
                p.observe(1, d, [], c)
        p.reset(keep_costs=True)
        for i in range(200):
            d = p.choose(1).depth
            p.observe(1, d, [min(d, pattern[i % len(pattern)])] if d else [], cost[d])
        return p.stats.iterations_by_depth

    n = SpecPolicy("auto", 5).min_evidence
    # The CPU: depth 5 until a_1 rests on 16 request-iterations (one an iteration), then depth 3.
    assert run({0: 0.044, 3: 0.054, 5: 0.103}) == [0, 0, 0, 200 - n, 0, n]
    # The GPU: depth 5 is measured to the cap (1 in 8 iterations reaches draft 5), and is then the best.
    assert run({0: 1.0e-3, 3: 1.1e-3, 5: 1.2e-3})[5] >= 4 * n


def test_a_rate_the_running_depth_does_not_reach_falls_back_to_its_long_run_value() -> None:
    """A burst of hard tokens pulls the deep rates' rolling averages down, which is when `auto` leaves
    the full depth; at depth 3 a_4 and a_5 are not measured, and frozen at that low they would keep it
    there. They follow their long-run averages instead, and a_1..a_3 stay the rolling ones."""
    p = SpecPolicy("auto", 5, choices=[0, 3, 5])
    for _ in range(2000):  # every draft accepted: the long run
        p.observe(1, 5, [5], 1.0)
    for _ in range(150):  # a burst that stops at draft 3
        p.observe(1, 5, [3], 1.0)
    dip = list(p.cond)
    assert dip[3] < 0.4 and p.cond_slow[3] > 0.8  # the rolling c_4 fell, the long-run one barely
    p.observe(1, 3, [3], 1.0)
    assert p.cond[:3] == pytest.approx(dip[:3], abs=0.02)
    assert p.cond[3:] == p.cond_slow[3:] and p.acc[4] > 0.7
