"""The prefix cache (issue 13): a radix tree of KV pages shared by the target and every draft runner.

The tree on its own (matching, splitting, page-size alignment, locks, LRU eviction) is checked against
a ground truth of what each page holds. In the engine: greedy float32 output with the cache equals the
output without it on multi-turn conversations (second turn resending the first), target-only and with
a draft, with chunked prefill, with pages of 4 tokens and under pool pressure that forces eviction and
preemption; hundreds of random requests with shared prefixes and aborts keep every page with exactly
one owner after every step and leave only unlocked cached pages behind; a lock that is skipped (a
prefix freed while in use) fails that same check. Usage, events and the start-up refusal of the
`recompute` boundary-KV policy with the cache are checked too.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from mleagle.engine.contract.event_bus import EventBus
from mleagle.engine.contract.events import EngineEvent, PoolEvent
from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine, EngineInputError
from mleagle.engine.memory.allocator import SlotAllocator
from mleagle.engine.memory.radix_cache import RadixCache
from mleagle.engine.service.telemetry import Telemetry
from mleagle.engine.spec.reference import RecomputeSpecWorker
from tests.spec_helpers import greedy, run, tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")


# --- the tree on its own -------------------------------------------------------------------------------
def _walk_evict_order(c: RadixCache, num_tokens: int) -> list[int]:
    """The pages `evict(num_tokens)` must free, by the definition: walk the whole tree for its unlocked
    leaves, free the least recently used first, a parent left childless and unlocked joining in turn
    (what `evict` did before it kept its heap). Nothing is changed."""
    import heapq

    left = {n.id: len(n.children) for n in c.nodes()}
    heap = [(n.stamp, n.id, n) for n in c.nodes() if not n.children and n.lock == 0]
    heapq.heapify(heap)
    freed, pages = 0, []
    while freed < num_tokens and heap:
        _, _, leaf = heapq.heappop(heap)
        pages += leaf.pages
        freed += len(leaf.key)
        up = leaf.parent
        if up is not c.root:
            left[up.id] -= 1
            if left[up.id] == 0 and up.lock == 0:
                heapq.heappush(heap, (up.stamp, up.id, up))
    return pages


def _fill(c: RadixCache, seq: list[int], truth: dict[int, tuple[int, ...]]) -> int:
    """What the memory manager does at a request's end: pages for seq's whole pages, inserted; the
    duplicates the tree already held freed. `truth[page]` = the prefix whose last page it holds."""
    p = c.page_size
    n = len(seq) // p
    pages = c.alloc.alloc(n)
    if pages is None:
        c.evict(n * p)
        pages = c.alloc.alloc(n)
    assert pages is not None
    for i, pg in enumerate(pages):
        truth[pg] = tuple(seq[: (i + 1) * p])
    present = c.insert(seq, pages) // p
    c.alloc.free(pages[:present])
    return present * p


@pytest.mark.parametrize("page", [1, 2, 4])
def test_common_prefix_equals_the_token_by_token_count(page: int) -> None:
    """`_common` (slice compares and a binary search for the first mismatch) gives the common prefix a
    token-by-token walk gives, rounded down to whole pages: equal keys, a mismatch anywhere (first
    token, inside the search's last 16, past them), `ids` shorter or longer than the key, an offset."""
    c = RadixCache(SlotAllocator(64, page_size=page))
    rng = random.Random(page)
    for _ in range(2000):
        key = [rng.randrange(3) for _ in range(rng.randint(1, 200))]
        ids = [rng.randrange(3) for _ in range(rng.randint(0, 5))] + key[: rng.randint(0, len(key))]
        if rng.random() < 0.7 and len(ids) > 5:
            k = rng.randrange(5, len(ids))
            ids[k] = 3  # a token the key never has: the mismatch is there (or earlier)
        ids += [rng.randrange(3) for _ in range(rng.randint(0, 30))]
        i = rng.randint(0, 5) if len(ids) > 5 else 0
        n = min(len(key), len(ids) - i)
        j = 0
        while j < n and key[j] == ids[i + j]:
            j += 1
        assert c._common(key, ids, i) == j - j % page, (key, ids, i)


def test_match_insert_split() -> None:
    c = RadixCache(SlotAllocator(64))
    truth: dict[int, tuple[int, ...]] = {}
    assert _fill(c, [1, 2, 3, 4, 5], truth) == 0
    assert _fill(c, [1, 2, 3, 9, 9], truth) == 3  # splits the first edge after 3 tokens
    assert _fill(c, [1, 2, 3, 4, 5, 6], truth) == 5
    pages, node = c.match([1, 2, 3, 4, 7])
    assert [truth[p] for p in pages] == [(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)]
    assert node.key == [4] or node.key[-1] == 4
    assert c.match([2, 2])[0] == [] and c.match([])[0] == []
    assert c.cached_tokens == 8 and c.evictable_tokens == 8 and not c.check()


def test_pages_of_four_match_whole_pages_only() -> None:
    c = RadixCache(SlotAllocator(256, page_size=4))
    truth: dict[int, tuple[int, ...]] = {}
    _fill(c, list(range(10)), truth)  # 2 whole pages (8 tokens) cached, the last 2 tokens not
    assert c.cached_tokens == 8
    assert len(c.match(list(range(10)))[0]) == 2
    assert len(c.match([0, 1, 2, 3, 4, 5, 6, 99])[0]) == 1  # diverges inside page 2: page 1 only
    assert _fill(c, [0, 1, 2, 3, 4, 5, 99, 99, 1, 1, 1, 1], truth) == 4  # split at the page boundary
    for pg in c.pages():
        assert len(truth[pg]) % 4 == 0
    assert not c.check()


def test_locks_and_lru_eviction() -> None:
    a = SlotAllocator(64)
    c = RadixCache(a)
    truth: dict[int, tuple[int, ...]] = {}
    for seq in ([1, 2, 3], [1, 2, 4], [5, 6], [7, 8, 9, 10]):
        _fill(c, seq, truth)
    c.match([5, 6])  # [5, 6] is now the most recently used; [1, 2, 3] the least
    _, node = c.match([7, 8, 9, 10])
    c.lock(node)
    assert c.evictable_tokens == c.cached_tokens - 4
    freed = c.evict(1)
    assert freed == 1 and c.match([1, 2, 3])[0].__len__() == 2  # the oldest leaf, [3], went first
    freed = c.evict(100)  # everything not locked
    assert c.cached_tokens == 4 and c.evictable_tokens == 0 and c.match([7, 8, 9, 10])[0]
    c.unlock(node)
    with pytest.raises(RuntimeError, match="unlock of an unlocked"):
        c.unlock(node)
    assert c.reset() == 4 and a.num_free_tokens == a.capacity_tokens and not c.check()


@pytest.mark.parametrize("page", [1, 2, 4])
def test_random_operations_keep_the_tree_true(page: int) -> None:
    """Random inserts (from a few shared stems, so edges split), matches, locks and evictions: every
    match returns pages that hold exactly the matched prefix, the counts always add up (every unlocked
    leaf in the eviction heap), and each eviction frees exactly what a walk of the tree for its least
    recently used unlocked leaves frees."""
    rng = random.Random(page)
    a = SlotAllocator(400, page_size=page)
    c = RadixCache(a)
    truth: dict[int, tuple[int, ...]] = {}
    stems = [[rng.randrange(6) for _ in range(rng.randint(0, 12))] for _ in range(5)]
    locked: list[Any] = []
    for step in range(600):
        seq = rng.choice(stems) + [rng.randrange(6) for _ in range(rng.randint(1, 12))]
        op = rng.random()
        if op < 0.45:
            if len(seq) // page <= a.num_free_tokens // page + c.evictable_tokens // page:
                _fill(c, seq, truth)
        elif op < 0.75:
            pages, node = c.match(seq)
            for i, pg in enumerate(pages):
                assert truth[pg] == tuple(seq[: (i + 1) * page]), "a page holds another prefix"
            if pages and rng.random() < 0.5:
                c.lock(node)
                locked.append((node, pages))
        elif op < 0.9 and locked:
            node, _ = locked.pop(rng.randrange(len(locked)))
            c.unlock(node)
        else:
            k = rng.randint(1, 40)
            want = _walk_evict_order(c, k)
            before = c.pages()
            c.evict(k)
            assert before - c.pages() == set(want), "evict freed other pages than the LRU walk"
        for _, pages in locked:  # locked prefixes are never evicted
            assert set(pages) <= c.pages()
        assert not c.check(), step
        assert a.num_free_tokens + c.cached_tokens == a.capacity_tokens
    for node, _ in locked:
        c.unlock(node)
    c.reset()
    assert a.num_free_tokens == a.capacity_tokens and c.cached_tokens == 0


# --- the engine: exactness -----------------------------------------------------------------------------
def _conversations(n: int, seed: int, stem: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    common = [rng.randrange(1, 256) for _ in range(stem)]  # a shared "system prompt"
    return [common + [rng.randrange(1, 256) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def _two_turns(e: Engine, firsts: list[list[int]], n1: int, n2: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Turn 1, then turn 2 resending turn 1 (prompt + answer) plus a new user turn."""
    out1 = run(e, firsts, greedy(n1))
    seconds = [p + o + [3, 1, 4, 1, 5][: 1 + i % 5] + p[:3] for i, (p, o) in enumerate(zip(firsts, out1))]
    res = e.generate(seconds, greedy(n2))
    return out1, [c.token_ids for c in res], [len(s) for s in seconds]


CASES = {
    "target": {},
    "target-chunked": {"chunked_prefill_size": 7},
    "target-page4": {"page_size": 4},
    "draft": {"draft": "random:2"},
    "draft-chunked": {"draft": "random:3", "chunked_prefill_size": 5},
    "draft-nochain-page2": {"draft": "random:2:1:nochain", "page_size": 2},
}


@pytest.mark.parametrize("case", list(CASES))
def test_multi_turn_cache_on_equals_off(case: str) -> None:
    over = CASES[case]
    draft = over.get("draft", "none")
    kw = {k: v for k, v in over.items() if k != "draft"}
    firsts = _conversations(6, seed=3, stem=9)
    off = _two_turns(tiny_engine(draft, enable_prefix_cache=False, **kw), firsts, 12, 10)
    e = tiny_engine(draft, **kw)
    on = _two_turns(e, firsts, 12, 10)
    assert on[:2] == off[:2]
    st = e.prefix_cache_stats()
    page = kw.get("page_size", 1)
    margin = int(draft.split(":")[1]) if draft != "none" else 0  # S positions a speculative hit recomputes
    # Every second turn hit what its first left: prompt + answer but the last token, in whole pages.
    assert st is not None and st["hits"] >= sum((len(p) + 11 - margin) // page * page for p in firsts)
    assert not e.mem.idle_problems()


def pressure_problems(draft: str) -> list[str]:
    """A pool of 160 slots for 8 conversations of ~40-70 tokens: turn 2 must evict cached prefixes
    (before preempting anyone), and decode still runs out, so requests are preempted (their KV goes
    to the cache and their resume can hit it). What differs from the cache-off engine, or fails."""
    firsts = _conversations(8, seed=5, stem=6)
    kw: dict[str, Any] = {"max_total_tokens": 160, "max_running_requests": 6, "chunked_prefill_size": 16}
    want = _two_turns(tiny_engine(draft, enable_prefix_cache=False, **kw), firsts, 16, 12)[:2]
    e = tiny_engine(draft, **kw)
    try:
        got = _two_turns(e, firsts, 16, 12)[:2]
    except (RuntimeError, IndexError) as err:  # the allocator's double-free check, or a slot map gone wrong
        return [f"raised: {type(err).__name__}: {err}"]
    bad = [f"turn {t + 1}, conversation {i}: output differs from the cache-off engine"
           for t in range(2) for i, (x, y) in enumerate(zip(got[t], want[t])) if x != y]
    c = e.mem.cache
    assert c is not None and c.evicted_tokens > 0, draft
    assert e.scheduler.num_preemptions > 0 and e.scheduler.prefix_hits > 0, draft
    return bad + e.mem.idle_problems()


def test_oracle_accepts_everything_on_cache_hits() -> None:
    """The DESIGN §3 oracle: a draft layer that read another runner's pool would lose acceptance.
    Second turns hit their first turns' prefixes (their draft KV is what the first turns left in
    each runner's own pool) and still accept every draft at every depth."""
    from mleagle.engine.contract.outputs import SpecStats
    from tests.spec_helpers import oracle_engine

    e = oracle_engine("random:3")
    firsts = [[1 + i, 9, 17 + i, 4, 30 + i] * (2 + i % 3) for i in range(5)]
    out1 = run(e, firsts, greedy(12))
    e.worker.stats = SpecStats(accepted_per_depth=[0] * 3)
    hits = e.scheduler.prefix_hits
    seconds = [p + o + [5, 6] for p, o in zip(firsts, out1)]
    assert run(e, seconds, greedy(12)) == run(oracle_engine(enable_prefix_cache=False), seconds, greedy(12))
    assert e.scheduler.prefix_hits - hits >= sum(len(p) + 11 - 3 for p in firsts)
    st = e.worker.stats
    assert st.num_verify > 0 and st.accepted_per_depth == [st.num_verify] * 3


def _draft_kv_after_prefill(e: Engine, seq: list[int]) -> list[torch.Tensor]:
    """Run `seq`'s prefill (one step) and read every draft pool's K|V at its positions."""
    e.add_request("b", seq, greedy(2))
    e.step()
    r = e.scheduler.reqs["b"]
    assert not r.prefilling
    slots = e.mem.maps[0].req_to_token[r.req_pool_idx, : len(seq)]
    kv = [torch.cat([d.binding.kv_pool.k[0][slots], d.binding.kv_pool.v[0][slots]], -1) for d in e.worker.drafts]
    while e.has_work():
        e.step()
    return kv


@pytest.mark.parametrize("margin", ["S", "none"])
def test_a_hit_reuses_only_draft_kv_computed_from_its_own_tokens(margin: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Draft layer k at position p reads t_{p+k+1}: in a cached prefix of m tokens, its last k+1
    positions read the owner's next tokens. A hit leaves the last S cached positions to recompute,
    so every draft pool's KV for a request that shares a system prompt with an earlier one equals a
    fresh prefill of its own tokens; without that margin (the check's teeth) it does not."""
    from mleagle.engine.spec.worker import SpecWorker

    if margin == "none":
        monkeypatch.setattr(SpecWorker, "prefix_margin", property(lambda self: 0))
    rng = random.Random(4)
    system = [rng.randrange(1, 256) for _ in range(40)]
    a, b = system + [7, 8, 9, 10, 11], system + [200, 201, 202, 203]
    e = tiny_engine("random:3")
    run(e, [a], greedy(6))
    got = _draft_kv_after_prefill(e, b)
    assert e.scheduler.prefix_hits == 40 - (3 if margin == "S" else 0)
    fresh = _draft_kv_after_prefill(tiny_engine("random:3", enable_prefix_cache=False), b)
    same = [torch.allclose(g, f, atol=1e-5) for g, f in zip(got, fresh)]
    if margin == "S":
        assert all(same), same
    else:
        assert not any(same), same  # layer k differs at positions m-k-1..m-1


# SmolLM2, float32: MT-Bench questions 81, 82, 91 and 101 (both turns), verbatim.
MT_BENCH = [
    ["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and "
     "must-see attractions.", "Rewrite your previous response. Start every sentence with the letter A."],
    ["Draft a professional email seeking your supervisor's feedback on the 'Quarterly Financial Report' you "
     "prepared. Ask specifically about the data analysis, presentation style, and the clarity of conclusions "
     "drawn. Keep the email short and to the point.", "Take a moment to evaluate and critique your own response."],
    ["Pretend yourself to be Elon Musk in all the following conversations. Speak like Elon Musk as much as "
     "possible. Why do we need to go to Mars?", "How do you like dancing? Can you teach me?"],
    ["Imagine you are participating in a race with a group of people. If you have just overtaken the second "
     "person, what's your current position? Where is the person you just overtook?",
     "If the \"second person\" is changed to \"last person\" in the above question, what would the answer be?"],
]


def _chat_two_turns(e: Engine, n1: int, n2: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Turn 1 for every conversation in one batch; turn 2 resends question and answer (as text,
    through the chat template, as an OpenAI client does) with the second question."""
    from mleagle.engine.entrypoints.bench_prefix import chat_ids

    tok = e.tokenizer
    assert tok is not None
    m1 = [[{"role": "user", "content": q1}] for q1, _ in MT_BENCH]
    c1 = e.generate([chat_ids(tok, m) for m in m1], greedy(n1))
    m2 = [m + [{"role": "assistant", "content": c.text}, {"role": "user", "content": q2}]
          for m, c, (_, q2) in zip(m1, c1, MT_BENCH)]
    p2 = [chat_ids(tok, m) for m in m2]
    rids: list[str] = []
    outs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for i, p in enumerate(p2):
        rids.append(f"t2-{i}")
        e.add_request(rids[-1], p, greedy(n2))
    while e.has_work():
        for o in e.step():
            outs[o.rid] = outs.get(o.rid, []) + o.token_ids
            cached[o.rid] = o.num_cached_tokens
    return [c.token_ids for c in c1], [outs[r] for r in rids], [cached[r] for r in rids]


@pytest.mark.parametrize(("draft", "chunk", "n1"), [("none", 512, 24), ("random:2", 16, 16)])
def test_smollm2_mt_bench_two_turns_cache_on_equals_off(draft: str, chunk: int, n1: int) -> None:
    kw: dict[str, Any] = {"draft": draft, "chunked_prefill_size": chunk, "max_total_tokens": 4096}
    on = _chat_two_turns(Engine(**kw), n1, 8)
    off = _chat_two_turns(Engine(enable_prefix_cache=False, **kw), n1, 8)
    assert on[:2] == off[:2]
    assert off[2] == [0] * len(MT_BENCH)
    # Each second turn reuses its first turn: the chat-templated question and the answer but its last
    # token (the first turn's KV stops there), and the answer re-encodes to the same tokens.
    assert all(c >= n1 + 20 - 2 for c in on[2]), on[2]


@pytest.mark.parametrize("draft", ["none", "random:2"])
def test_eviction_and_preemption_under_pressure_are_exact(draft: str) -> None:
    assert not pressure_problems(draft)


def test_prompt_logprobs_compute_the_whole_prompt() -> None:
    p = _conversations(1, seed=8)[0]
    sp = SamplingParams(temperature=0, max_new_tokens=4, prompt_logprobs=2)
    e = tiny_engine()
    e.generate([p], greedy(4))  # cached now
    got = e.generate([p], sp)[0]
    want = tiny_engine(enable_prefix_cache=False).generate([p], sp)[0]
    assert got.token_ids == want.token_ids
    assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(p)
    assert [x.token_id if x else None for x in got.prompt_logprobs] == \
        [x.token_id if x else None for x in want.prompt_logprobs]  # type: ignore[union-attr]


def test_a_hit_writes_its_map_row_in_one_copy() -> None:
    """A new request that starts on a cached prefix gets its map row (the prefix's pages and its new
    ones) in one write, not one for the prefix and one for the rest, and from the host straight into the
    row (not an upload and then a device copy): on a GPU each is a launch, and most served arrivals hit
    (a shared system prompt, a conversation's history)."""
    from mleagle.engine.core.request import Req
    from mleagle.engine.memory.manager import page_slots
    from tests.spec_helpers import OpCount

    e = tiny_engine("none")
    prompt = list(range(1, 41))
    run(e, [prompt], greedy(2))  # its KV is cached as it ends
    req = Req("b", prompt[:32] + [99] * 8, greedy(2), seed=0)
    assert e.mem.match(req, req.prompt_ids[:39]) >= 30
    with OpCount(lambda f: f.overloadpacket.__name__ in ("copy_", "_to_copy")) as w:  # writes and uploads
        assert e.mem.ensure(req, 40)
    assert w.n == 1, w.n  # (on a GPU too: the host's slots go straight into the row)
    row = e.mem.maps[0].req_to_token[req.req_pool_idx, :40]
    assert row.tolist() == page_slots(req.pages, e.mem.page_size, 40).tolist()
    e.mem.release(req)
    assert not e.mem.idle_problems()


def test_cached_tokens_reported_and_events() -> None:
    e = tiny_engine("random:2")
    bus = EventBus()
    tel = Telemetry.attach(e, bus)
    p = _conversations(1, seed=9, stem=0)[0] + list(range(40, 60))
    outs: list[Any] = []
    for rid in ("a", "b"):
        e.add_request(rid, p, greedy(3))
        while e.has_work():
            outs += e.step()
    fin = {o.rid: o for o in outs if o.finished}
    assert fin["a"].num_cached_tokens == 0
    # All but the last prompt token (whose logits it needs) and, with S = 2 draft layers, the last 2
    # cached positions, where the first request's draft KV read its own continuation.
    hit = len(p) - 1 - 2
    assert fin["b"].num_cached_tokens == hit
    st = e.prefix_cache_stats()
    assert st is not None and st["queries"] == 2 * len(p) and st["hits"] == hit
    tel.status()
    evs = bus.drain()
    pools = [x for x in evs if isinstance(x, PoolEvent)]
    last = {x.runner: x for x in pools}
    assert set(last) == {"target", "draft0", "draft1"}
    cached = len(p) + 3 - 1  # prompt + output - the last output token
    for x in last.values():  # the same slots in every runner's pool
        assert (x.kv_used, x.kv_cached, x.kv_evictable) == (0, cached, cached)
    eng = [x for x in evs if isinstance(x, EngineEvent)][-1]
    assert (eng.prefix_cache_queries_total, eng.prefix_cache_hits_total) == (2 * len(p), hit)


def test_recompute_policy_refuses_the_cache_at_start() -> None:
    with pytest.raises(EngineInputError, match="needs the prefix cache off"):
        Engine("tiny-dummy", draft="random:2", spec_worker=RecomputeSpecWorker)
    e = Engine("tiny-dummy", draft="random:2", spec_worker=RecomputeSpecWorker, enable_prefix_cache=False)
    assert e.mem.cache is None and e.prefix_cache_stats() is None
    # no draft: nothing to recompute, the cache stays on
    assert Engine("tiny-dummy", spec_worker=RecomputeSpecWorker).mem.cache is not None


# --- nothing leaks; a reference-count bug is caught -----------------------------------------------------
def audited_load(e: Engine, n: int, seed: int, p_abort: float = 0.12,
                 check_locks: bool = True) -> tuple[list[str], dict[str, tuple[list[int], SamplingParams, list[int]]]]:
    """Random requests with shared prefixes (system prompts, second turns resending finished first
    turns), greedy and sampled, with arrivals while others run and random aborts. After every step
    every page must have exactly one owner and every live prefix must be locked (`MemoryManager.audit`).
    Returns the problems found (empty when all is well) and, per greedy request that ran to its
    length, (prompt, params, tokens)."""
    rng = random.Random(seed)
    v = e.arch.vocab_size
    systems = [[rng.randrange(v) for _ in range(rng.randint(4, 24))] for _ in range(4)]
    done: list[list[int]] = []  # finished fill sequences (prompt + output): second turns resend them
    prompts: dict[str, list[int]] = {}
    params: dict[str, SamplingParams] = {}
    outs: dict[str, list[int]] = {}
    full: set[str] = set()  # greedy requests that ended by length
    problems: list[str] = []
    live: set[str] = set()
    i = steps = 0
    try:
        while i < n or e.has_work():
            for _ in range(rng.randint(0, 4)):
                if i >= n:
                    break
                if done and rng.random() < 0.35:
                    p = rng.choice(done) + [rng.randrange(v) for _ in range(rng.randint(1, 8))]
                else:
                    p = rng.choice(systems) + [rng.randrange(v) for _ in range(rng.randint(1, 16))]
                p = p[-90:]
                kw: dict[str, Any] = {"max_new_tokens": rng.randint(1, 32)}
                if rng.random() < 0.3:
                    kw.update(temperature=0.9, seed=rng.randrange(1000))
                else:
                    kw["temperature"] = 0
                rid = f"r{i}"
                i += 1
                params[rid] = SamplingParams(**kw)
                e.add_request(rid, p, params[rid])
                prompts[rid], outs[rid] = p, []
                live.add(rid)
            if live and rng.random() < p_abort:
                e.abort(rng.choice(sorted(live)))
            for o in e.step():
                outs[o.rid] += o.token_ids
                if o.finished:
                    live.discard(o.rid)
                    if o.finish_reason != "abort":
                        done.append(prompts[o.rid] + outs[o.rid])
                    if o.finish_reason == "length" and params[o.rid].greedy:
                        full.add(o.rid)
            s = e.scheduler
            problems += [f"step {steps}: {x}" for x in e.mem.audit(s.running + list(s.waiting), check_locks)]
            if problems:
                break
            steps += 1
            assert steps < 20000
    except RuntimeError as err:  # the allocator's double-free check, an unlock below zero
        problems.append(f"step {steps}: {err}")
    if not problems:
        problems += e.mem.idle_problems()
    return problems, {r: (prompts[r], params[r], outs[r]) for r in sorted(full)}


@pytest.mark.parametrize("draft,page", [("none", 1), ("random:2", 1), ("none", 2)])
def test_no_leak_and_one_owner_per_page_under_random_load(draft: str, page: int) -> None:
    kw: dict[str, Any] = {"max_total_tokens": 256, "max_running_requests": 12, "chunked_prefill_size": 24,
                          "page_size": page, "max_context_len": 256}
    e = tiny_engine(draft, **kw)
    problems, finished = audited_load(e, 300, seed=11)
    assert not problems, problems[:5]
    # Whatever the cache served them, greedy answers equal the cache-off engine's, run alone.
    off = tiny_engine(draft, enable_prefix_cache=False, **kw)
    sample = list(finished.values())[::4]
    assert len(sample) >= 20
    for prompt, sp, toks in sample:
        assert len(toks) == sp.max_new_tokens and toks == run(off, [prompt], sp)[0]
    c = e.mem.cache
    assert c is not None and c.evicted_tokens > 0 and e.scheduler.prefix_hits > 0
    assert e.scheduler.num_preemptions > 0
    assert e.reset_prefix_cache() > 0
    a = e.allocator
    assert sorted(a.free_pages) == list(range(1, a.num_pages)) and c.cached_tokens == 0


def test_a_prefix_freed_while_in_use_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: the lock taken at admission (and its unlock) is skipped, so a running
    request's cached prefix stays evictable, and under pressure it is freed and handed to another
    request while the first still reads it. The per-step audit of the leak test reports it, also
    when it does not compare lock counts (what the bug does, not how), and the exactness test under
    pressure fails."""
    monkeypatch.setattr(RadixCache, "lock", lambda self, node: None)
    monkeypatch.setattr(RadixCache, "unlock", lambda self, node: None)
    kw: dict[str, Any] = {"max_total_tokens": 256, "max_running_requests": 12, "chunked_prefill_size": 24,
                          "max_context_len": 256}
    problems, _ = audited_load(tiny_engine(**kw), 300, seed=11)
    assert any("live requests use it" in p for p in problems), problems[:5]
    problems, _ = audited_load(tiny_engine(**kw), 300, seed=11, check_locks=False)
    assert any("freed while in use" in p or "two owners" in p for p in problems), problems[:5]
    assert pressure_problems("none") and pressure_problems("random:2")



def test_disable_flag_on_serve_generate_and_bench() -> None:
    from mleagle.daemon.cli import build_parser as serve_parser
    from mleagle.daemon.cli import make_config
    from mleagle.engine.entrypoints.bench import build_parser as bench_parser
    from mleagle.engine.entrypoints.generate import build_parser as generate_parser
    from mleagle.engine.entrypoints.generate import engine_overrides

    assert make_config(serve_parser().parse_args([])).engine.enable_prefix_cache is True
    assert make_config(serve_parser().parse_args(["--disable-prefix-cache"])).engine.enable_prefix_cache is False
    assert engine_overrides(generate_parser().parse_args(["--disable-prefix-cache"])) == {"enable_prefix_cache": False}
    assert "enable_prefix_cache" not in engine_overrides(generate_parser().parse_args([]))
    assert bench_parser().parse_args(["--disable-prefix-cache"]).disable_prefix_cache is True


@pytest.mark.parametrize("page_size", [1, 2, 16])
def test_page_slots_is_the_page_arithmetic(page_size: int) -> None:
    """Position p of a request holding `pages` is slot pages[p // page_size] * page_size + p % page_size,
    for every prefix length, on the page-is-a-slot path (page size 1) as on the others."""
    from mleagle.engine.memory.manager import page_slots

    rng = random.Random(page_size)
    pages = rng.sample(range(1, 500), 9)
    every = [pages[p // page_size] * page_size + p % page_size for p in range(len(pages) * page_size)]
    assert page_slots(pages, page_size).tolist() == every
    for n in range(len(every) + 1):
        got = page_slots(pages, page_size, n)
        assert got.dtype == np.int64 and got.tolist() == every[:n]
