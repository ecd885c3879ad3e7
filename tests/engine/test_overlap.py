"""Overlap scheduling (launch step N+1, then finish step N), forced on here so the CPU runs the same
bookkeeping the GPU does: outputs equal the synchronous schedule's, requests that stop or are aborted
while a step is in flight end exactly where they should, and every pool comes back free."""

from __future__ import annotations

import itertools
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


@pytest.mark.parametrize("over", [{"max_total_tokens": 600},
                                  {"max_total_tokens": 240, "spec_policy": "auto", "graph_emulate": True,
                                   "prefill_graph_max_tokens": 32, "chunked_prefill_size": 16}])
def test_overlap_aborts_and_arrivals_leave_nothing_behind(over: dict) -> None:
    """Random arrivals, aborts and a pool too small for everyone (preemption) under overlap: mixed
    steps, prefill graphs and the policy's depth switches included, every request ends and nothing is
    held afterwards."""
    _, ov = _pair("random:2", **over)
    modes: list[str] = []
    ov.observers.append(lambda outs, rep: modes.append(rep.mode))
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
    assert "MIXED" in modes and (over["max_total_tokens"] > 300 or ov.scheduler.num_preemptions > 0)


def test_overlap_with_graph_emulation_equals_eager() -> None:
    cfg = tiny_cfg()
    ref = tiny_engine("none", cfg=cfg)
    e = tiny_engine("random:3", cfg=cfg, graph_emulate=True)
    e.scheduler.overlap = True
    sps = [greedy(20 + i) for i in range(len(PROMPTS))]
    assert run(e, PROMPTS, sps) == run(ref, PROMPTS, sps)
    assert all_free(e)


def _staggered(e, prompts, sps, every: int = 3, after_step=None) -> tuple[dict[str, list[int]], list[str]]:
    """Add one request every `every` steps while the others decode; tokens per request and step modes."""
    toks: dict[str, list[int]] = {}
    modes: list[str] = []
    i = 0
    while i < len(prompts) or e.has_work():
        if i < len(prompts) and e.scheduler.num_steps % every == 0:
            e.add_request(f"s{i}", prompts[i], sps[i])
            toks[f"s{i}"] = []
            i += 1
        for o in e.step():
            toks[o.rid] += o.token_ids
        modes.append(e.scheduler.last_mode)
        if after_step is not None:
            after_step()
    return toks, modes


def _counts_agree(e) -> None:
    """Every decoding request's output count in the slot state is the host's plus the token the
    iteration in flight adds (its first token included, where that iteration takes it)."""
    p = e.scheduler.inflight
    ahead = {id(r) for r, ep in zip(p.reqs, p.epoch) if r.epoch == ep} if p is not None else set()
    for r in e.scheduler.running:
        if not r.prefilling and not r.finished:
            got = int(e.worker.state.n_out[r.req_pool_idx])
            assert got == len(r.output_ids) + (id(r) in ahead), (r.rid, got, len(r.output_ids))


@pytest.mark.parametrize(("draft", "policy"), [("none", "always"), ("random:3", "always"), ("random:3", "auto"),
                                               ("random:3", "cycle")])
def test_mixed_steps_prefill_arrivals_behind_the_iteration_in_flight(draft: str, policy: str) -> None:
    """Arrivals while others decode (overlap on, graphs emulated): steps are MIXED (a prefill, on its
    prefill graph, plus the next decode iteration), the decoding rows keep their whole-iteration graph
    in those steps, every output equals the synchronous engine's, nothing is left behind."""
    cfg = tiny_cfg()
    over = dict(spec_policy=policy, graph_emulate=True, prefill_graph_max_tokens=64, chunked_prefill_size=24,
                fuse_mixed_steps=False)
    sync = tiny_engine(draft, cfg=cfg, **over)
    ov = tiny_engine(draft, cfg=cfg, **over)
    ov.scheduler.overlap = True
    prompts = [*PROMPTS, list(range(60, 110)), [4] * 3, list(range(5, 40))]
    sps = [greedy(14 + 3 * i) for i in range(len(prompts))]
    want, _ = _staggered(sync, prompts, sps)
    seen: list[tuple[str, list]] = []
    ov.observers.append(lambda outs, rep: seen.append((rep.mode, list(rep.forwards))))
    got, modes = _staggered(ov, prompts, sps)
    assert got == want
    mixed = [f for m, f in seen if m == "MIXED"]
    # (`cycle` changes depth every iteration: its catch-ups drain the step in flight, so fewer mix.)
    assert len(mixed) >= (2 if policy == "cycle" else len(prompts) - 2), modes
    # The iteration's forwards come first and replayed its graph (graph_bs set, no eager reason), then the
    # prefill's EXTEND on its prefill graph (two forwards: `fuse_mixed_steps` is off here).
    assert any(f[0].graph_bs and f[-1].mode == "EXTEND" and f[-1].graph_bs for f in mixed)
    assert all(f[0].mode != "EXTEND" for f in mixed)
    st = ov.stats()  # what the daemon's /debug/engine and the serve benchmark's records carry
    assert st["fused_mixed_steps"] == 0
    assert st["mixed_steps"] == len(mixed) and sum(st["graphs"]["target"]["prefill_replays"].values()) > 0
    assert ov.scheduler.inflight is None and all_free(ov)


@pytest.mark.parametrize("sampled", [True, False])
def test_a_fused_mixed_step_equals_two_forwards(sampled: bool) -> None:
    """Target-only with `fuse_mixed_steps`, a mixed step runs the arrivals' prompts and the decoding rows'
    next tokens as one EXTEND forward on a prefill graph: outputs equal the two-forward mixed step's
    (greedy, and with `sampled` seeded sampling with top-p and a repetition penalty, logprobs; stops
    while a step is in flight), each fused step runs that one forward over the decoding rows and the
    arrivals, a prompt that does not fit the largest prefill graph keeps the two forwards, and nothing
    is left behind. Where every row is plain greedy the step is staged whole into the graph (its tail
    commits every row: `graph_fused_steps`), else sampled on the host."""
    cfg = tiny_cfg()
    over = dict(graph_emulate=True, prefill_graph_max_tokens=64)
    two = tiny_engine("none", cfg=cfg, fuse_mixed_steps=False, **over)
    one = tiny_engine("none", cfg=cfg, **over)  # the default: one forward
    for e in (two, one):
        e.scheduler.overlap = True
    prompts = [*PROMPTS, list(range(60, 110)), [4] * 3, list(range(5, 40)), list(range(1, 90))]
    sps = [greedy(14 + 3 * i) for i in range(len(prompts))]
    if sampled:
        sps[1] = SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_new_tokens=25, logprobs=2)
        sps[3] = SamplingParams(temperature=0.7, seed=11, max_new_tokens=30, repetition_penalty=1.3)
    sps[5] = greedy(20, stop_token_ids=[7, 9])
    seen: list[tuple[str, list]] = []
    one.observers.append(lambda outs, rep: seen.append((rep.mode, list(rep.forwards))))
    want, _ = _staggered(two, prompts, sps, every=2, after_step=lambda: _counts_agree(two))
    got, _ = _staggered(one, prompts, sps, every=2, after_step=lambda: _counts_agree(one))
    assert got == want
    assert two.stats()["fused_mixed_steps"] == 0 < two.stats()["mixed_steps"]
    st = one.stats()
    # (the 89-token prompt is past the largest prefill graph, 64 tokens: its mixed step is not fused)
    assert st["fused_mixed_steps"] >= len(prompts) - 3 and st["mixed_steps"] > st["fused_mixed_steps"]
    if sampled:  # (while a sampled request decodes, its step is sampled on the host)
        assert st["graph_fused_steps"] < st["fused_mixed_steps"]
    else:
        assert st["graph_fused_steps"] == st["fused_mixed_steps"]
    # A fused step's own forward (the last of its report, after the finished iteration's) is one EXTEND on
    # a prefill graph carrying more requests than it prefilled: the decoding rows, one token each.
    fused = [f[-1] for m, f in seen if m == "MIXED" and f[-1].mode == "EXTEND" and len(f[-1].rids) > 1]
    assert fused and all(x.graph_bs for x in fused)
    assert one.scheduler.inflight is None and all_free(one) and all_free(two)


def test_mixed_steps_leave_the_policy_its_measurements() -> None:
    """An arrival every other step makes most steps mixed: the iteration intervals still reach the policy
    (the prefills' own spans are taken out of them), so `auto` measures its depths instead of waiting
    for a quiet step that never comes."""
    ov = tiny_engine("random:3", cfg=tiny_cfg(), spec_policy="auto", graph_emulate=True, prefill_graph_max_tokens=64)
    ov.scheduler.overlap = True
    prompts = [[(5 * i + j) % 250 + 1 for j in range(3 + i % 5)] for i in range(40)]
    _, modes = _staggered(ov, prompts, [greedy(30)] * len(prompts), every=2)
    p = ov.worker.policy
    assert modes.count("MIXED") >= 30, modes
    # Every iteration but the first after a catch-up or a drain is measured (dropping those a mixed step
    # ran beside, as before, left about 60 %).
    assert sum(p.samples.values()) >= 0.9 * sum(p.stats.iterations_by_depth) and all(c > 0 for c in p.cost.values())
    assert ov.scheduler.inflight is None and all_free(ov)


@pytest.mark.parametrize("draft", ["none", "random:3"])
def test_arrivals_wait_a_few_steps_to_share_one_prefill(draft: str) -> None:
    """With `prefill_wait_steps` an arrival while others decode waits up to that many steps for company:
    one arrival per step then makes one prefill per few steps, each carrying several requests; the first
    request (nothing decodes) and the head of the queue never wait longer; outputs equal the engine that
    prefills every arrival at once, and nothing is left behind."""
    cfg = tiny_cfg()
    over = dict(spec_policy="always", graph_emulate=True, prefill_graph_max_tokens=64)
    ref = tiny_engine(draft, cfg=cfg, **over)
    ref.scheduler.overlap = True
    e = tiny_engine(draft, cfg=cfg, prefill_wait_steps=3, **over)
    e.scheduler.overlap = True
    prompts = [[(7 * i + j) % 250 + 1 for j in range(2 + i % 4)] for i in range(13)]
    sps = [greedy(40 - i) for i in range(len(prompts))]
    prefills: list[tuple[int, int]] = []  # (step, requests prefilled)
    e.observers.append(lambda outs, rep: rep.mode in ("EXTEND", "MIXED") and prefills.append(
        (rep.step, len(rep.forwards[-1].rids))))
    want, _ = _staggered(ref, prompts, sps, every=1)
    got, _ = _staggered(e, prompts, sps, every=1)
    assert got == want
    assert prefills[0] == (0, 1)  # nothing decoded yet: no wait
    # Twelve later arrivals, one per step, in prefills of three or four (never a longer wait than 3 steps).
    assert [n for _, n in prefills[1:]] and all(n >= 3 for _, n in prefills[1:-1]), prefills
    assert len(prefills) <= 5 and all(b - a <= 4 for (a, _), (b, _) in itertools.pairwise(prefills)), prefills
    st = e.stats()
    assert st["prefill_wait_steps"] == 3 and st["held_prefill_steps"] >= 8
    assert e.scheduler.inflight is None and all_free(e)


def test_the_prefill_wait_is_off_by_default() -> None:
    e = tiny_engine("none", cfg=tiny_cfg())
    assert e.scheduler.prefill_wait == 0 and e.stats()["prefill_wait_steps"] == 0


def _scripted(e, script: list, back: int, after_step=None) -> dict[str, list[int]]:
    """Run `script` ((rid, prompt, params, abort) each) one arrival every other step; an arrival marked
    `abort` aborts the request added `back` arrivals before it. Tokens per request."""
    toks: dict[str, list[int]] = {}
    live: list[str] = []
    n = 0
    while n < len(script) or e.has_work():
        if n < len(script) and e.scheduler.num_steps % 2 == 0:
            rid, p, sp, abort = script[n]
            e.add_request(rid, p, sp)
            toks[rid] = []
            live.append(rid)
            n += 1
            if abort and len(live) > back:
                e.abort(live[-back])
        for o in e.step():
            toks[o.rid] += o.token_ids
        if after_step is not None:
            after_step()
    return toks


def _reuse_watch(e) -> list[str]:
    """Record every page and request slot the memory manager gives back (with its launch count then) and
    check every allocation: while an iteration is in flight, nothing it may still write (a row or page
    freed after its launch) may be handed out. Returns the violations seen."""
    mem, sch = e.mem, e.scheduler
    freed_at: dict[tuple[str, int], int] = {}
    bad: list[str] = []
    free0, alloc0, ensure0 = mem._free, mem.allocator.alloc, mem.ensure

    def free(pages, slot=None):
        for p in pages:
            freed_at[("page", p)] = mem.launches
        if slot is not None:
            freed_at[("slot", slot)] = mem.launches
        free0(pages, slot)

    def check(kind: str, x: int) -> None:
        fl = sch.inflight
        if fl is not None and freed_at.get((kind, x), -1) >= fl.seq:
            bad.append(f"{kind} {x} freed at launch {freed_at[(kind, x)]}, reused with iteration {fl.seq} in flight")

    def alloc(n):
        got = alloc0(n)
        for p in got or []:
            check("page", p)
        return got

    def ensure(req, new_len, grow=0):
        had = req.req_pool_idx
        ok = ensure0(req, new_len, grow)
        if had is None and req.req_pool_idx is not None:
            check("slot", req.req_pool_idx)
        return ok

    mem._free, mem.allocator.alloc, mem.ensure = free, alloc, ensure
    return bad


@pytest.mark.parametrize("hold", [True, False])
def test_held_frees_keep_rows_and_pages_from_the_iteration_in_flight(hold: bool) -> None:
    """What a prefill on its own stream needs (`MemoryManager.hold_frees`, on by default on a target-only
    CUDA engine): under overlap, with arrivals, aborts and a pool small enough to preempt, no request slot
    or KV page freed after the in-flight iteration's launch is handed to anyone while that iteration is
    in flight; outputs equal an engine that frees at once; the audit holds after every step and nothing
    is left held or lost once the work drains. Without holding, the same run does reuse such pages and
    slots (so the check can fail)."""
    cfg = tiny_cfg()
    over = dict(max_total_tokens=260, graph_emulate=True, prefill_graph_max_tokens=32, chunked_prefill_size=16)
    ref = tiny_engine("none", cfg=cfg, **over)
    e = tiny_engine("none", cfg=cfg, **over)
    for x in (ref, e):
        x.scheduler.overlap = True
    if hold:
        e.mem.hold_frees()
    bad = _reuse_watch(e)
    rng = random.Random(3)
    script = []
    for i in range(70):
        p = [rng.randrange(1, 256) for _ in range(rng.randint(1, 30))]
        script.append((f"r{i}", p, greedy(rng.randint(1, 30)), rng.random() < 0.15))
    def audit() -> None:
        assert not e.mem.audit(e.scheduler.running), e.mem.audit(e.scheduler.running)

    assert _scripted(ref, script, back=3) == _scripted(e, script, back=3, after_step=audit)
    assert e.scheduler.num_preemptions > 0 and e.scheduler.num_mixed > 0
    assert all_free(e) and not e.mem.held
    assert not bad if hold else bad


def test_held_frees_wait_for_the_iterations_launched_before_them() -> None:
    """`MemoryManager.hold_frees` alone: what a request gives back is neither free nor lost while held
    (the audit counts it, `idle_problems` names it), `settle(n)` frees what was given back before the
    (n+1)-th launch and keeps the rest, `settle()` frees everything; a prefix-cache insert is not held."""
    from types import SimpleNamespace

    from mleagle.engine.memory.allocator import SlotAllocator
    from mleagle.engine.memory.manager import MemoryManager
    from mleagle.engine.memory.req_to_token import ReqToTokenPool

    mem = MemoryManager(SlotAllocator(64), [ReqToTokenPool("t", 4, 32, "cpu")], prefix_cache=True)
    mem.hold_frees()

    def req() -> SimpleNamespace:
        r = SimpleNamespace(req_pool_idx=None, pages=[], prefix_node=None, cached_len=0)
        assert mem.ensure(r, 10)
        return r

    a, b = req(), req()
    free0, slots0 = len(mem.allocator.free_pages), len(mem.free_reqs)
    mem.launches = 3
    mem.release(a, keep=list(range(100, 104)))  # 4 tokens into the cache, 6 pages and the slot held
    mem.launches = 5
    mem.release(b)
    assert len(mem.allocator.free_pages) == free0 and len(mem.free_reqs) == slots0
    assert not mem.audit([]) and mem.idle_problems()[0] == "idle: 2 frees still held"
    assert mem.cache is not None and mem.cache.evictable_tokens == 4  # the insert was not held
    mem.settle(4)  # launches 1..4 have ended: a's frees (made when 3 had launched) are free, b's not
    assert len(mem.allocator.free_pages) == free0 + 6 and len(mem.free_reqs) == slots0 + 1
    mem.settle()
    assert len(mem.allocator.free_pages) == free0 + 16 and len(mem.free_reqs) == slots0 + 2
    assert not mem.held and not mem.idle_problems()


def test_fused_steps_under_aborts_preemption_and_chunks_equal_two_forwards() -> None:
    """Fused mixed steps (the default) with arrivals every other step, aborts, chunked prompts and a pool
    small enough to preempt, greedy (staged whole into the prefill graph) and sampled rows among them:
    outputs equal the two-forward engine's, the slot state's output counts agree with the host's after
    every step, both ways of fusing ran, and nothing is left behind."""
    cfg = tiny_cfg()
    over = dict(max_total_tokens=300, graph_emulate=True, prefill_graph_max_tokens=64, chunked_prefill_size=32)
    two = tiny_engine("none", cfg=cfg, fuse_mixed_steps=False, **over)
    one = tiny_engine("none", cfg=cfg, **over)
    for e in (two, one):
        e.scheduler.overlap = True
    rng = random.Random(11)
    script = []
    for i in range(60):
        p = [rng.randrange(1, 256) for _ in range(rng.randint(1, 50))]
        sp = greedy(rng.randint(1, 30))
        if i % 7 == 3:
            sp = SamplingParams(temperature=0.8, seed=i, max_new_tokens=15)
        script.append((f"r{i}", p, sp, rng.random() < 0.12))
    assert _scripted(two, script, back=3) == _scripted(one, script, back=3, after_step=lambda: _counts_agree(one))
    st = one.stats()
    assert 0 < st["graph_fused_steps"] < st["fused_mixed_steps"], st
    assert one.scheduler.num_preemptions > 0 and two.stats()["fused_mixed_steps"] == 0
    assert all_free(one) and all_free(two) and one.scheduler.inflight is None


@pytest.mark.parametrize("page_size", [1, 4])
def test_fused_steps_over_cached_prefixes_equal_two_forwards_and_eager(page_size: int) -> None:
    """Arrivals that share prefixes with earlier prompts (so a fused step extends over a cached prefix),
    rows asking for logprobs or a stop token among greedy ones, pages of one and of four tokens: the
    fused engine on emulated graphs equals the two-forward engine and the eager engine (no graphs),
    token for token and logprob for logprob, the cache served tokens, every counter agrees after each
    step, and nothing is left behind."""
    cfg = tiny_cfg()
    base = dict(page_size=page_size, chunked_prefill_size=32)
    over = dict(graph_emulate=True, prefill_graph_max_tokens=64, **base)
    eager = tiny_engine("none", cfg=cfg, **base)
    two = tiny_engine("none", cfg=cfg, fuse_mixed_steps=False, **over)
    one = tiny_engine("none", cfg=cfg, **over)
    for e in (eager, two, one):
        e.scheduler.overlap = True
    rng = random.Random(5 + page_size)
    stems = [[rng.randrange(1, 256) for _ in range(rng.randint(8, 40))] for _ in range(4)]
    script = []
    for i in range(40):
        p = rng.choice(stems) + [rng.randrange(1, 256) for _ in range(rng.randint(1, 12))]
        sp = greedy(rng.randint(4, 24))
        if i % 16 == 2:  # (few and short: a step is staged whole only while no such row decodes)
            sp = greedy(4, logprobs=2)
        elif i % 9 == 4:
            sp = greedy(24, stop_token_ids=[rng.randrange(1, 256) for _ in range(20)])
        script.append((f"r{i}", p, sp, False))

    def lps(e) -> dict[str, list]:
        got: dict[str, list] = {}
        e.observers.append(lambda outs, rep: [got.setdefault(o.rid, []).extend(
            (lp.token_id, lp.logprob) for lp in (getattr(o, "logprobs", None) or [])) for o in outs])
        return got

    got_lp = [lps(e) for e in (eager, two, one)]
    toks = [_scripted(e, script, back=1, after_step=lambda e=e: _counts_agree(e)) for e in (eager, two, one)]
    assert toks[0] == toks[1] == toks[2]
    for a in got_lp[1:]:
        assert a.keys() == got_lp[0].keys()
        for rid, want in got_lp[0].items():
            assert [t for t, _ in a[rid]] == [t for t, _ in want], rid
            bad = [(i, x, y) for i, ((_, x), (_, y)) in enumerate(zip(a[rid], want)) if abs(x - y) > 1e-4]
            assert not bad, (rid, bad[:5], len(want))
    assert any(got_lp[2].values())
    st = one.stats()
    assert 0 < st["graph_fused_steps"] < st["fused_mixed_steps"], st  # (logprob rows take the host's way)
    assert st["prefix_cache"]["hits"] > 0, st["prefix_cache"]
    for e in (eager, two, one):
        assert e.scheduler.inflight is None and all_free(e)


def test_iteration_counters_count_the_decoding_rows() -> None:
    """`iterations` / `iteration_rows` in the engine's stats (what `bench serve` and the offline replay
    turn into rows per iteration): a synchronous static batch of 4 requests of 10 tokens runs 9 decode
    iterations of 4 rows (the first token is the prefill's). With overlap and fused mixed steps, every
    token after a request's first comes from an iteration row, and a request is in at most one
    iteration past its last token (launched before that token came back); a fused step's arrivals,
    whose first tokens it makes, are not rows."""
    e = tiny_engine("none")
    run(e, [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], greedy(10))
    st = e.stats()
    assert (st["iterations"], st["iteration_rows"]) == (9, 36)
    one = tiny_engine("none", graph_emulate=True, prefill_graph_max_tokens=64)
    one.scheduler.overlap = True
    _staggered(one, PROMPTS, [greedy(12) for _ in PROMPTS], every=2)
    st = one.stats()
    assert st["fused_mixed_steps"] > 0
    assert 11 * len(PROMPTS) <= st["iteration_rows"] <= 12 * len(PROMPTS), st["iteration_rows"]
    assert st["iteration_rows"] < st["iterations"] * len(PROMPTS)
