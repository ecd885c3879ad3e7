"""The graph path's bookkeeping on the CPU: metadata checked at capture, padding, binding refusal, exactness.

The graph runners run emulated here (`graph_emulate`): the same fixed buffers, bucket padding, row
metadata and binding checks as on CUDA, with an eager forward in place of the replay. So these tests
prove everything about the graph path except the CUDA graph itself (the GPU tests replay real graphs):
the captured row metadata equals the rule's for every bucket, mode and layout and live batches replay
through it; a draft-extend graph that records `[bs]` logprob rows where the forward makes bs·W, and a
whole-iteration graph whose forwards disagree with the rule, fail at capture; padded rows write only
the pad slot and no padding survives into a later, smaller batch; a graph runner refuses a batch
bound to another runner; greedy speculative output through the graph path equals eager target-only
output, and a seeded sampled request is the same alone and in a batch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine
from mleagle.engine.executor.capture import MetaMismatch, default_buckets
from mleagle.engine.executor.forward_batch import BindingError, ForwardMode, row_meta
from mleagle.engine.executor.graph_runner import GraphRunner
from mleagle.engine.executor.iteration_graph import IterationGraph
from mleagle.engine.executor.slot_state import PLAIN
from tests.spec_helpers import (
    all_free,
    check_extend_buckets,
    check_fill_buckets,
    greedy,
    run,
    tiny_cfg,
    tiny_engine,
)

PROMPTS = [[5, 17, 30, 2], [9, 9, 1], list(range(40, 52)), [3], [100, 7, 7, 7, 8]]


def _engine(draft: str = "random:3", **over) -> Engine:
    return tiny_engine(draft, cfg=tiny_cfg(), graph_emulate=True, max_running_requests=12, **over)


def _live_batch(e: Engine, runner_idx: int, bs: int):
    """A real DECODE/VERIFY/DRAFT_EXTEND view for bs running requests, built as the worker builds it."""
    w = e.worker
    reqs = [r for r in e.scheduler.running if not r.prefilling][:bs]
    for r in reqs:
        assert e.mem.ensure(r, r.kv_len + e.runners[runner_idx].graphs.width)
    rpi = w.rpi_of(reqs)
    g = e.runners[runner_idx].graphs
    width = g.width
    ids = torch.zeros(bs, width, dtype=torch.int64)
    rows = torch.arange(bs * width) if not g.pruned else torch.arange(bs) * width
    v = w.view(g.mode if g.mode is not ForwardMode.DRAFT_EXTEND else ForwardMode.TARGET_VERIFY, rpi, ids,
               width, rows, w.host_view(reqs))
    if g.mode is ForwardMode.DRAFT_EXTEND:
        v = dataclasses.replace(v, mode=ForwardMode.DRAFT_EXTEND, pruned=g.pruned,
                                hidden_in=torch.zeros(bs * width, e.arch.hidden_size))
    return e.runners[runner_idx].bind(v), reqs


def _admit(e: Engine, n: int) -> None:
    for i in range(n):
        e.add_request(f"q{i}", PROMPTS[i % len(PROMPTS)] + [i], greedy(64))
    while any(r.prefilling for r in e.scheduler.running) or e.scheduler.waiting:
        e.step()


@pytest.mark.parametrize("layout,tp", [("all_reduce", 1), ("scattered", 1), ("all_reduce", 2), ("scattered", 2),
                                       ("scattered", 4)])
def test_capture_and_replay_metadata_agree(layout: str, tp: int) -> None:
    """Every bucket of every mode: the live batch after padding reproduces the captured metadata."""
    e = _engine()
    _admit(e, 9)
    for ri, r in enumerate(e.runners):
        for pruned in (True, False) if r.graphs.mode is ForwardMode.DRAFT_EXTEND else (False,):
            g = GraphRunner(r, mode=r.graphs.mode, width=r.graphs.width, buckets=[1, 2, 4, 8, 12],
                            hidden_size=e.arch.hidden_size, dtype=e.dtype, pruned=pruned, emulate=True,
                            tp_size=tp, layout=layout)  # type: ignore[arg-type]
            g.capture()
            for pbs, cap in g.caps.items():
                want = row_meta(g.mode, pbs, g.width, pruned=pruned, tp_size=tp, layout=layout)  # type: ignore[arg-type]
                assert cap.meta == want and cap.meta.agree
                if g.mode is ForwardMode.DRAFT_EXTEND and not pruned:
                    assert cap.meta.global_num_tokens_for_logprob[0] * (tp if layout == "scattered" else 1) >= pbs * g.width
            r.graphs, saved = g, r.graphs
            try:
                for bs in range(1, 10):
                    batch, _ = _live_batch(e, ri, bs)
                    out = r.forward(batch)
                    assert out.graph_bs == g.bucket(bs)
                    assert out.logits.shape[0] == row_meta(g.mode, bs, g.width, pruned=pruned).logit_rows
            finally:
                r.graphs = saved


@pytest.mark.parametrize("tp,layout", [(1, "all_reduce"), (2, "scattered")])
def test_wrong_logprob_rows_fail_at_capture(monkeypatch: pytest.MonkeyPatch, tp: int, layout: str) -> None:
    """The seeds' bug: an un-pruned draft-extend graph recording [bs] logprob rows where the forward
    makes bs·W. The capture check compares with a live batch of the bucket and refuses it."""
    e = _engine()
    d0 = e.runners[1]

    def graph() -> GraphRunner:
        return GraphRunner(d0, mode=ForwardMode.DRAFT_EXTEND, width=d0.graphs.width, buckets=[1, 4],
                           hidden_size=e.arch.hidden_size, dtype=e.dtype, pruned=False, emulate=True, tp_size=tp,
                           layout=layout)  # type: ignore[arg-type]

    graph().capture()  # healthy
    real = GraphRunner._views

    def faulty(self: GraphRunner, pbs: int):  # type: ignore[no-untyped-def]
        v = real(self, pbs)
        m = dataclasses.replace(v.row_meta, global_num_tokens_for_logprob=(pbs,) * tp)
        return dataclasses.replace(v, row_meta=m)

    monkeypatch.setattr(GraphRunner, "_views", faulty)
    with pytest.raises(MetaMismatch, match="a live batch needs"):
        graph().capture()


def test_padded_rows_touch_only_the_pad_slot() -> None:
    """A big batch, then a small one in a bigger bucket: only live rows' slots and the pad slot change,
    and the buffers' padded tails hold the pad template again (no leak from the larger batch)."""
    e = _engine("none")
    _admit(e, 9)
    target = e.runners[0]
    g = target.graphs
    big, _ = _live_batch(e, 0, 9)
    target.forward(big)
    small, reqs = _live_batch(e, 0, 3)  # bucket 4: one padded row
    pool = target.binding.kv_pool
    live = set(small.out_cache_loc.tolist())
    for t in pool.k + pool.v:
        t[[0, *live]] = 7.0  # poison the pad slot and the live slots: the forward must overwrite them
    before = [t.clone() for t in pool.k + pool.v]
    out = target.forward(small)
    assert out.graph_bs == 4
    changed = set()
    for b, a in zip(before, pool.k + pool.v):
        changed |= set(torch.nonzero((b != a).flatten(1).any(1)).flatten().tolist())
    assert changed <= live | {0} and 0 in changed  # the padded row wrote the pad slot, nothing else
    assert live <= changed
    w = g.width
    # the bucket's padded tail (row 3 of 4) was rewritten from the template; rows past the bucket are not
    # read by this bucket's graph
    for k in ("req_pool_indices", "seq_lens"):
        assert torch.equal(g.buf[k][3:4], g.pad[k][3:4])
    for k in ("out_cache_loc", "positions", "input_ids"):
        assert torch.equal(g.buf[k][3 * w : 4 * w], g.pad[k][3 * w : 4 * w])
    assert int(g.buf["req_pool_indices"][3]) == target.binding.req_to_token.pad_row
    assert not target.binding.req_to_token.req_to_token[g.pad_row].any()
    del reqs


def test_graph_runner_refuses_a_foreign_binding() -> None:
    e = _engine()
    _admit(e, 2)
    batch, _ = _live_batch(e, 1, 2)  # bound to draft0
    with pytest.raises(BindingError):
        e.runners[2].graphs.run(batch)  # draft1's graph runner
    with pytest.raises(BindingError):
        e.runners[2].forward(batch)
    with pytest.raises(BindingError):
        e.runners[0].graphs.run(batch)


@pytest.mark.parametrize("draft", ["random:1", "random:3", "random:2:5:nochain"])
def test_graph_path_speculation_equals_eager_target_only(draft: str) -> None:
    cfg = tiny_cfg()
    ref = tiny_engine("none", cfg=cfg)
    sps = [greedy(24), greedy(9), greedy(30), greedy(1), greedy(17)]
    want = run(ref, PROMPTS, sps)
    e = tiny_engine(draft, cfg=cfg, graph_emulate=True)
    assert run(e, PROMPTS, sps) == want  # plain greedy: whole-iteration graphs
    assert sum(e.worker.iter_graph.stats.replays.values()) > 0
    # with logprobs the batch is not plain: each forward replays its own runner's graph
    lp = [sp.model_copy(update={"logprobs": 1}) for sp in sps]
    assert run(e, PROMPTS, lp) == want
    assert all(sum(r.graphs.stats.replays.values()) > 0 for r in e.runners)
    assert all_free(e)
    g = tiny_engine("none", cfg=cfg, graph_emulate=True)
    assert run(g, PROMPTS, sps) == want
    assert sum(g.worker.iter_graph.stats.replays.values()) > 0


def test_seeded_sampling_is_batch_invariant_through_graphs() -> None:
    e = _engine("random:2")
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_new_tokens=20)
    alone = run(e, [PROMPTS[0]], [sp])[0]
    batch = run(e, [PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                [SamplingParams(temperature=1.0, seed=3, max_new_tokens=12), sp, greedy(7)])
    assert batch[1] == alone
    assert all_free(e)


def test_buckets_cover_max_running() -> None:
    assert default_buckets(64)[-1] == 64 and default_buckets(5) == [1, 2, 4, 5]
    e = Engine(tiny_cfg(), graph_emulate=True, max_running_requests=20)
    assert e.runners[0].graphs.buckets[-1] == 20 and "emulated" in e.graph_report


def test_iteration_graph_padding_leaves_the_pad_row_and_other_slots_alone() -> None:
    """A whole speculative iteration replayed for 3 requests in the bucket of 4: the pad row's state is
    unchanged, and in every runner's pool only the live requests' window slots and the pad slot change."""
    e = _engine()
    _admit(e, 3)
    e.step()  # one iteration through the graph path, so the slot state is warm
    st, w = e.worker.state, e.worker
    reqs = e.scheduler.running[:3]
    for r in reqs:
        assert e.mem.ensure(r, r.kv_len + w.lookahead)
    pad = st.pad_row
    before_state = {k: getattr(st, k)[pad].clone() for k in ("kv_len", "last_tok", "n_out", "iters", "drafts")}
    pools = [r.binding.kv_pool for r in e.runners]
    live_slots = set()
    for r in reqs:
        live_slots |= set(e.runners[0].binding.req_to_token.req_to_token[r.req_pool_idx, r.kv_len : r.kv_len + w.lookahead].tolist())
    for pool in pools:
        for t in pool.k + pool.v:
            t[0] = 7.0
    before = [[t.clone() for t in pool.k + pool.v] for pool in pools]
    _, pbs = w.iter_graph.run(w.rpi_of(reqs), 3)
    assert pbs == 4
    for k, v in before_state.items():
        assert torch.equal(getattr(st, k)[pad], v), k
    for pool, old in zip(pools, before):
        changed = set()
        for b, a in zip(old, pool.k + pool.v):
            changed |= set(torch.nonzero((b != a).flatten(1).any(1)).flatten().tolist())
        assert changed <= live_slots | {0} and 0 in changed, (pool.name, changed - live_slots)


def test_iteration_graph_metadata_mismatch_fails_at_capture() -> None:
    """A whole-iteration graph whose rule says the draft-extend forwards are un-pruned (bs·W logprob rows)
    while the body runs them pruned: its forwards disagree with the rule at capture, which refuses it."""
    e = _engine()
    w = e.worker
    g = w.iter_graph
    assert g is not None and all(m.agree for cap in g.caps.values() for m in cap.meta)

    def body(rpi: torch.Tensor, live: torch.Tensor):  # type: ignore[no-untyped-def]
        return w._body(rpi, live, PLAIN, w.capture_view(int(rpi.shape[0])), True, None)

    real = w.iteration_meta
    bad = IterationGraph("bad", body, lambda pbs: real(pbs)[:1] + [row_meta(ForwardMode.DRAFT_EXTEND, pbs, 4)] * 3,
                         [1, 4], w.target.binding.req_to_token.pad_row, e.device, emulate=True)
    with pytest.raises(MetaMismatch, match="a live batch of the bucket needs"):
        bad.capture()
    ok = IterationGraph("ok", body, real, [1, 4], w.target.binding.req_to_token.pad_row, e.device, emulate=True)
    ok.capture()


@pytest.mark.parametrize("draft", ["none", "random:3"])
def test_prefill_graphs_replay_equals_eager_at_every_token_bucket(draft: str) -> None:
    """Emulated prefill graphs: padded to every token bucket (padding tokens and zero-length padding
    requests), each request extending a prefix it holds, the forward equals the unpadded one; the
    runner counts the replays, and every pool comes back free."""
    e = _engine(draft, prefill_graph_max_tokens=64)
    n = check_extend_buckets(e)
    assert n == len(e.runners) * 3  # buckets 16, 32, 64
    assert all(sum(r.extend_graphs.stats.replays.values()) >= 3 for r in e.runners)
    assert all_free(e)


def test_a_prefill_replay_fills_its_buffers_in_one_copy_and_pads_the_rest() -> None:
    """A prefill graph's inputs, padding included, go over in one copy from the host values the batch
    was built with; the KV slots are read from the request-to-token map by the graph itself. A draft
    runner's batch, whose input ids and hidden states were replaced after it was built, copies those
    from the device too. A smaller batch after a larger one in the same bucket leaves nothing of it: the
    rows past its own are position 0 on the pad row (so the pad slot), the request slots past its own
    the pad row with no rows (each bucket has its own buffer, so the copy is the bucket's size)."""
    from mleagle.engine.executor.forward_batch import build_batch
    from tests.spec_helpers import OpCount

    def kernels() -> OpCount:  # what computes or copies (a host tensor built from values is neither)
        return OpCount(lambda f: f.overloadpacket.__name__ != "lift_fresh")

    e = _engine("random:2", prefill_graph_max_tokens=64, max_total_tokens=4096)
    for i in range(2):
        e.add_request(f"a{i}", list(range(1 + i, 8 + i)), greedy(4))
    e.step()
    reqs = e.scheduler.running[:2]
    for r in reqs:
        assert e.mem.ensure(r, r.kv_len + 40)
    target, draft = e.runners[0], e.runners[1]
    g = target.extend_graphs

    def batch(lens: list[int], rs: list) -> object:
        ids = list(range(100, 100 + sum(lens)))
        return build_batch(ForwardMode.EXTEND, input_ids=ids, req_pool_indices=[r.req_pool_idx for r in rs],
                           prefix_lens=[r.kv_len for r in rs], extend_lens=lens, req_to_token=e.worker.r2t,
                           device=e.device)

    big, small = target.bind(batch([30, 30], reqs)), target.bind(batch([40], reqs[1:]))
    assert g.bucket(60, 2) == g.bucket(40, 1) == 64
    g.static_batch(big, 64)
    with kernels() as k:
        g.static_batch(small, 64)
    assert k.n == 1, k.n  # the packed copy
    f = g.fields(64)
    ids, pos, row_req = (f[k] for k in ("input_ids", "positions", "row_req"))
    assert ids[:40].tolist() == list(range(100, 140)) and not ids[40:].any()
    assert torch.equal(pos[:40], small.positions) and not pos[40:].any()
    assert row_req.tolist() == [reqs[1].req_pool_idx] * 40 + [g.pad_row] * 24
    with pytest.raises(ValueError, match="host rows"):  # (its rows are what the graph's KV lookup reads)
        g.static_batch(dataclasses.replace(small, host=None), 64)
    g.static_batch(small, 64)
    g.run(small)  # the graph's own KV slots: the batch's, then the pad slot
    assert torch.equal(g.loc[:40], small.out_cache_loc) and not g.loc[40:64].any()
    r = g.slots(64)
    assert f["rpi"].tolist() == [reqs[1].req_pool_idx] + [g.pad_row] * (r - 1)
    assert f["logit_rows"].tolist() == [39] + [0] * (r - 1)
    assert f["meta"][:, :2].tolist() == [[reqs[1].kv_len + 40, 0], [0, 40], [40, 0]]
    # A draft runner's batch as the speculative worker makes it: its ids and hidden states replaced.
    hidden = int(getattr(draft.model, "hidden_in_size", 0))
    d = dataclasses.replace(draft.bind(batch([40], reqs[1:])), input_ids=torch.arange(7, 47, device=e.device),
                            hidden_in=torch.randn(40, hidden, dtype=e.dtype, device=e.device))
    with kernels() as k:
        draft.extend_graphs.static_batch(d, 64)
    assert k.n == 3, k.n  # the packed copy, then the ids and the hidden states
    assert draft.extend_graphs.fields(64)["input_ids"][:40].tolist() == list(range(7, 47))
    assert torch.equal(draft.extend_graphs.hidden_in[:40], d.hidden_in)
    for i in range(2):
        e.abort(f"a{i}")
    while e.has_work():
        e.step()
    assert all_free(e)


def test_prefill_graph_refuses_a_foreign_binding_and_counts_what_it_cannot_hold() -> None:
    from mleagle.engine.executor.forward_batch import build_batch

    e = _engine("random:3", prefill_graph_max_tokens=32, max_total_tokens=4096)
    e.add_request("a", list(range(1, 8)), greedy(4))
    e.step()
    req = e.scheduler.running[0]
    assert e.mem.ensure(req, req.kv_len + 40)
    b = build_batch(ForwardMode.EXTEND, input_ids=list(range(5)), req_pool_indices=[req.req_pool_idx],
                    prefix_lens=[req.kv_len], extend_lens=[5], req_to_token=e.worker.r2t)
    target, draft = e.runners[0], e.runners[1]
    with pytest.raises(BindingError):
        target.extend_graphs.run(draft.bind(b))
    with pytest.raises(BindingError):
        draft.extend_graphs.run(target.bind(b))
    big = build_batch(ForwardMode.EXTEND, input_ids=list(range(40)), req_pool_indices=[req.req_pool_idx],
                      prefix_lens=[req.kv_len], extend_lens=[40], req_to_token=e.worker.r2t)
    assert target.extend_graphs.fits(target.bind(big)) == "tokens>max_bucket"
    lp = dataclasses.replace(target.bind(b), all_logit_rows=True)
    assert target.extend_graphs.fits(lp) == "prompt logprobs"
    before = target.eager["tokens>max_bucket"]
    target.forward(target.bind(big))
    assert target.eager["tokens>max_bucket"] == before + 1
    e.abort("a")
    while e.has_work():
        e.step()
    assert all_free(e)


@pytest.mark.parametrize("policy", ["always", "auto"])
def test_chunked_prefill_on_prefill_graphs_fills_the_draft_pools_as_eager(policy: str) -> None:
    """A long prompt prefilled in chunks on (emulated) prefill graphs, whose outputs are rewritten by the
    next replay as a real graph's are: the draft layers' KV and the first drafts equal an eager
    engine's, so nothing kept a graph's output past the step (the target's hidden states of each chunk,
    stashed for the draft prefill)."""
    prompt = [(13 * i + 5) % 250 + 1 for i in range(70)]
    es = [tiny_engine("random:3", cfg=tiny_cfg(), chunked_prefill_size=24, spec_policy=policy, **over)
          for over in ({}, {"graph_emulate": True, "prefill_graph_max_tokens": 32})]
    for e in es:
        e.add_request("a", prompt, greedy(8))
        while not e.scheduler.reqs["a"].output_ids:
            e.step()
    (ra,), (rb,) = es[0].scheduler.running, es[1].scheduler.running
    assert sum(es[1].runners[0].extend_graphs.stats.replays.values()) >= 3  # every chunk on a graph
    assert torch.equal(es[0].worker.state.drafts[ra.req_pool_idx], es[1].worker.state.drafts[rb.req_pool_idx])
    slots = es[0].worker.r2t[ra.req_pool_idx, : len(prompt)]
    assert torch.equal(slots, es[1].worker.r2t[rb.req_pool_idx, : len(prompt)])
    for da, db in zip(es[0].runners[1:], es[1].runners[1:]):
        for ka, kb in zip(da.binding.kv_pool.k, db.binding.kv_pool.k):
            assert torch.allclose(ka[slots], kb[slots], atol=1e-5)


@pytest.mark.parametrize("policy", ["always", "cycle"])
def test_the_draft_fill_graph_fills_every_layer_as_the_per_layer_path(policy: str) -> None:
    """The draft fill as one (emulated) graph per token bucket — every layer's EXTEND, the id windows and
    the greedy drafts from one packed upload — against the same engine filling layer by layer: a batch
    of prompts (one hitting another's cached prefix), then, under `cycle`, catch-ups after plain steps.
    Every draft pool's KV, every draft and every output are equal, and the fills replayed the graph;
    a sampled request keeps the per-layer path."""
    prompts = [[(11 * i + j) % 250 + 1 for j in range(5 + 3 * i)] for i in range(4)]
    prompts.append(prompts[3][:14] + [7, 8, 9])  # a prefix-cache hit past the prefix margin
    es = [tiny_engine("random:3", cfg=tiny_cfg(), spec_policy=policy, graph_emulate=True, prefill_graph_max_tokens=64)
          for _ in range(2)]
    es[1].worker.fill_graph = None  # the reference: the per-layer path, on the same prefill graphs
    assert es[0].worker.fill_graph is not None
    outs = []
    for e in es:
        outs.append([c.token_ids for c in e.generate(prompts[:4], greedy(12))])
        got: dict[str, list[int]] = {"hit": [], "sampled": []}
        for rid, p, sp in (("hit", prompts[4], greedy(9)),
                           ("sampled", prompts[0], SamplingParams(temperature=0.9, seed=3, max_new_tokens=5))):
            e.add_request(rid, p, sp)
            while e.has_work():
                for o in e.step():
                    got[o.rid] += o.token_ids
        outs.append(got)
    assert outs[0] == outs[2] and outs[1] == outs[3]
    fills = es[0].stats()["graphs"]["draft_fill"]["replays"]
    assert sum(fills.values()) >= 2, fills
    for da, db in zip(es[0].runners[1:], es[1].runners[1:]):  # every slot but the pad slot (0)
        for ka, kb in zip([*da.binding.kv_pool.k, *da.binding.kv_pool.v], [*db.binding.kv_pool.k, *db.binding.kv_pool.v]):
            assert torch.allclose(ka[1:], kb[1:], atol=1e-5)
    assert all_free(es[0])


@pytest.mark.parametrize("policy", ["always", "auto"])
def test_the_emulated_draft_fill_graph_equals_the_per_layer_fill_at_every_token_bucket(policy: str) -> None:
    """`check_fill_buckets` on the CPU: the fill graph's packing, padding and id windows (emulated
    replays run its body on the same buffers) against the per-layer path, with the prefill's stashed
    hidden states (`always`) and with the hidden-state pool (`auto`, whose input rows the caller passes)."""
    e = tiny_engine("random:3", cfg=tiny_cfg(), spec_policy=policy, graph_emulate=True, prefill_graph_max_tokens=128)
    assert check_fill_buckets(e) == 4
    assert all_free(e)


@pytest.mark.parametrize("draft", ["none", "random:3"])
def test_a_prefill_graph_commits_plain_first_tokens_as_the_host_does(draft: str) -> None:
    """Plain greedy prompts on an (emulated) prefill graph get their first token from the graph itself
    (sampled, committed and their KV lengths set inside it, `TargetWorker.graph_tail`); the rest keep
    the host's sampling after the replay: `check_graph_first_tokens` against the same engine without
    prefill graphs."""
    common = dict(graph_emulate=True, chunked_prefill_size=48, max_total_tokens=420)
    cfg = tiny_cfg()
    check_graph_first_tokens(tiny_engine(draft, cfg=cfg, prefill_graph_max_tokens=0, **common),
                             tiny_engine(draft, cfg=cfg, prefill_graph_max_tokens=64, **common))


def check_graph_first_tokens(ref: Engine, eng: Engine, exact_count: bool = True) -> None:
    """`eng` (prefill graphs up to 64 tokens, chunks of 48, a pool of 420 tokens) against `ref` (the same
    without prefill graphs): the slot state a plain prefill step leaves, then outputs and logprobs for
    plain batches, a seeded top-p request with logprobs, min_new_tokens, a repetition penalty, prompt
    logprobs (eager), a plain and a sampled prompt in one batch, a prompt prefilled in two chunks, a
    prefix-cache hit, and a batch large enough for the pool to preempt and resume requests (a resumed
    prefill sets its KV length in the graph and samples nothing). Every plain greedy prompt's first
    token came from the graph, no other's (`exact_count`; else at least those: under overlap a request
    preempted before its first token may prefill twice)."""
    long = [(7 * i + 3) % 250 + 1 for i in range(90)]
    groups: list[tuple[list[list[int]], list[SamplingParams]]] = [
        (PROMPTS[:3], [greedy(12)] * 3),
        ([PROMPTS[3]], [SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_new_tokens=10, logprobs=2)]),
        ([PROMPTS[4]], [greedy(9, min_new_tokens=4)]),
        ([PROMPTS[0]], [SamplingParams(temperature=0.0, max_new_tokens=8, repetition_penalty=1.2)]),
        ([PROMPTS[1]], [SamplingParams(temperature=0.0, max_new_tokens=6, prompt_logprobs=1)]),
        (PROMPTS[2:4], [greedy(7), SamplingParams(temperature=0.9, seed=2, max_new_tokens=7)]),
        ([long], [greedy(10)]),
        ([PROMPTS[2] + [11, 12, 13]], [greedy(8)]),  # PROMPTS[2] is cached: a hit
        ([[(3 * i + j) % 250 + 1 for j in range(30)] for i in range(12)], [greedy(24)] * 12),  # preemption
    ]
    outs = []
    for e in (ref, eng):
        # The slot state a plain prefill step leaves (its next input, count and KV length per request).
        for i, p in enumerate(PROMPTS):
            e.add_request(f"s{i}", p, greedy(4))
        e.step()
        st = e.worker.state
        rows = [e.scheduler.reqs[f"s{i}"].req_pool_idx for i in range(len(PROMPTS))]
        got: list[object] = [[t[rows].tolist() for t in (st.last_tok, st.n_out, st.kv_len)]]
        for i in range(len(PROMPTS)):
            e.abort(f"s{i}")
        while e.has_work():
            e.step()
        for prompts, sps in groups:
            for c in e.generate(prompts, sps):
                got.append((c.token_ids, [(lp.token_id, round(lp.logprob, 4)) for lp in c.logprobs or []],
                            [None if lp is None else round(lp.logprob, 4) for lp in c.prompt_logprobs or []]))
        outs.append(got)
    assert outs[0] == outs[1]
    assert ref.stats()["graph_first_tokens"] == 0
    # The state check's 5, the first group's 3, the chunked one, the hit, the last group's 12.
    n = eng.stats()["graph_first_tokens"]
    assert n == 5 + 3 + 1 + 1 + 12 if exact_count else n >= 5 + 3 + 1 + 1 + 12, n
    assert eng.scheduler.num_preemptions > 0
    assert all_free(eng) and all_free(ref)
