"""Explicit binding of draft steps, the acceptance oracle, and the seed bug (issue 3, DESIGN §3).

Spies on every runner's forward, every KV pool's writes and every backend's plan/attend show that
draft step k touches only runner k's pool and backend, in eager prefill and eager decode; the
per-step batch views share positions, slots, sequence lengths and request indices; runners and
backends refuse batches that are not theirs. The oracle (constructed target + draft whose layers read
their own KV) reaches acceptance 1.0 at every depth. Re-introducing SGLang's bug — every step bound
to runner 0's pool and backend — makes the binding check, the pool-diff check and the oracle fail.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mleagle.engine.core.engine import Engine
from mleagle.engine.executor.forward_batch import BindingError, ForwardMode
from mleagle.engine.spec.checkpoint import save_draft
from tests.spec_helpers import (
    BindingSpy,
    DraftBatches,
    binding_ok,
    greedy,
    oracle_engine,
    pools_touched_ok,
    snapshot,
)

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11], list(range(20, 33)), [40]]
MODES = ["EXTEND", "DRAFT_EXTEND"]


def _names(e: Engine) -> list[str]:
    return [r.name for r in e.worker.drafts]


def _oracle_full(e: Engine) -> bool:
    st = e.worker.stats
    return st.num_verify > 0 and st.accepted_per_depth == [st.num_verify] * e.worker.steps


def _inject_seed_bug(e: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's eager draft-extend bug: steps k >= 1 run layer k's weights against runner 0's KV pool,
    request map and attention backend."""
    d0 = e.worker.drafts[0]
    for r in e.worker.drafts[1:]:
        monkeypatch.setattr(r, "_binding", d0.binding)  # bypasses the read-only property on purpose


def _step_until_decode(e: Engine) -> None:
    while e.has_work():
        e.step()
        if e.scheduler.last_mode == "DECODE":
            return
    raise AssertionError("no decode step happened")


# --- the oracle --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("s", "chunk"), [(1, 0), (2, 5), (3, 0), (4, 5), (4, 0)])
def test_oracle_acceptance_is_one_at_every_depth(s: int, chunk: int) -> None:
    e = oracle_engine(f"random:{s}", chunked_prefill_size=chunk)
    out = e.generate(PROMPTS, greedy(3 * (s + 1) + 1))
    assert _oracle_full(e)
    for c in out:
        assert c.spec is not None and c.spec.accepted_per_depth == [c.spec.num_verify] * s
        assert c.spec.accept_len == s + 1
    assert e.worker.boundary_kv_stale_positions >= 0


def test_oracle_draft_checkpoint_roundtrip(tmp_path: object) -> None:
    """The oracle draft saved in mleagle's own format and loaded by path keeps acceptance 1.0."""
    e = oracle_engine("random:3")
    save_draft(e.draft_stack, str(tmp_path))
    e2 = oracle_engine(str(tmp_path))
    e2.generate(PROMPTS, greedy(9))
    assert _oracle_full(e2)


# --- binding ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft", ["random:3", "random:4:0:nochain", "random:1"])
def test_each_step_touches_only_its_runner(draft: str) -> None:
    e = oracle_engine(draft, chunked_prefill_size=5)
    with BindingSpy(e.runners) as spy:
        e.generate(PROMPTS, greedy(9))
    assert binding_ok(spy, _names(e), MODES)
    # The target wrote and read only its own pool, every layer of it, in prefill and verify.
    tgt = [t for t in spy.touches if t.runner == "target"]
    assert {t.mode for t in tgt} == {"EXTEND", "TARGET_VERIFY"} and all(t.pool == "target" for t in tgt)
    # Step k's forwards ran in order 0..S-1 within each draft pass.
    order = [t.runner for t in spy.touches if t.kind == "plan" and t.runner != "target"]
    names = _names(e)
    assert order == names * (len(order) // len(names))


def test_pools_distinct_and_same_slot_space() -> None:
    e = oracle_engine("random:3")
    pools = [r.binding.kv_pool for r in e.runners]
    maps = [r.binding.req_to_token for r in e.runners]
    backends = [r.binding.backend for r in e.runners]
    for xs in (pools, maps, backends):
        assert len({id(x) for x in xs}) == len(xs)
    assert {p.num_slots for p in pools} == {e.target.binding.kv_pool.num_slots}
    assert all(m.req_to_token.shape == maps[0].req_to_token.shape for m in maps)
    e.generate(PROMPTS[:2], greedy(5))
    assert all(m.req_to_token.data_ptr() != maps[0].req_to_token.data_ptr() for m in maps[1:])
    assert len({m.req_to_token.data_ptr() for m in maps}) == len(maps)


def test_an_allocation_writes_the_draft_maps_in_one_operation() -> None:
    """The draft runners' maps are slices of one tensor (still distinct tensors and objects): a request's
    pages go into the target's map and all the draft maps in two writes, not one per runner, and every
    map holds the same slots after."""
    from mleagle.engine.core.request import Req
    from tests.spec_helpers import OpCount

    e = oracle_engine("random:3")
    maps = [r.binding.req_to_token for r in e.runners]
    group = maps[1].group
    assert group is not None and maps[0].group is None and all(m.group is group for m in maps[1:])
    req = Req("x", list(range(1, 40)), greedy(4), seed=0)
    with OpCount(lambda f: f.overloadpacket.__name__ == "copy_") as w:  # writes (a GPU's upload is `_to_copy`)
        assert e.mem.ensure(req, 39)
    assert w.n == 2, w.n
    row = req.req_pool_idx
    want = maps[0].req_to_token[row, :39]
    assert want.unique().numel() == 39
    for m in maps[1:]:
        assert torch.equal(m.req_to_token[row, :39], want), m.name
    e.mem.release(req)


@pytest.mark.parametrize("chain", [True, False])
def test_step_views_share_everything_but_ids_and_hidden(chain: bool) -> None:
    e = oracle_engine(f"random:3:0:{'chain' if chain else 'nochain'}", noise=0.12)
    for i, p in enumerate(PROMPTS):
        e.add_request(f"r{i}", p, greedy(12))
    with DraftBatches(e) as rec:
        e.step()  # prefill: every draft runner over the whole prompt
        pre = rec.last()
        _step_until_decode(e)
        dec = rec.last()
    for views, mode in ((pre, ForwardMode.EXTEND), (dec, ForwardMode.DRAFT_EXTEND)):
        assert len(views) == 3 and all(b.mode is mode for b in views)
        b0 = views[0]
        for b in views[1:]:
            for f in ("positions", "out_cache_loc", "seq_lens", "req_pool_indices", "logit_rows"):
                assert getattr(b, f) is getattr(b0, f), f
            assert b.extend_lens == b0.extend_lens and b.prefix_lens == b0.prefix_lens
        assert [b.binding for b in views] == [r.binding for r in e.worker.drafts]
        hid = [id(b.hidden_in) for b in views]
        assert (len(set(hid)) == 3) if chain else (len(set(hid)) == 1)
    # Decode rotation: within each request's W rows, step k+1's ids are step k's shifted left by one,
    # except at the request's last accepted row, which holds step k's new draft.
    sel = set(dec[0].logit_rows.tolist())
    w = dec[0].width
    for a, b in itertools.pairwise(dec):
        x, y = a.input_ids.tolist(), b.input_ids.tolist()
        assert all(y[i] == x[i + 1] for i in range(len(x)) if i % w < w - 1 and i not in sel)
        assert x != y


def test_runners_and_backends_refuse_foreign_batches() -> None:
    e = oracle_engine("random:3")
    for i, p in enumerate(PROMPTS[:2]):
        e.add_request(f"r{i}", p, greedy(12))
    with DraftBatches(e) as rec:
        _step_until_decode(e)
    views = rec.last()
    d = e.worker.drafts
    with pytest.raises(BindingError):
        d[1].forward(views[0])
    with pytest.raises(BindingError):
        e.target.forward(views[2])
    with pytest.raises(BindingError):
        d[2].binding.backend.plan(views[0])
    # A backend refuses to run a batch it did not plan (here: planned views[1], then asked for views[2]).
    be = d[1].binding.backend
    be.plan(views[1])
    h = e.arch.head_dim
    qkv = torch.zeros(views[1].num_tokens, (e.arch.num_attention_heads + 2 * e.arch.num_key_value_heads) * h)
    with pytest.raises(BindingError):
        be.forward(0, qkv, views[2].positions, e.model.rope, views[2])


# --- the seed bug ------------------------------------------------------------------------------------
@pytest.mark.parametrize("inject", [False, True])
@pytest.mark.parametrize("s", [2, 3])
def test_seed_bug_is_caught(s: int, inject: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    e = oracle_engine(f"random:{s}", chunked_prefill_size=5)
    if inject:
        _inject_seed_bug(e, monkeypatch)
    with BindingSpy(e.runners) as spy:
        e.generate(PROMPTS, greedy(12))
    ok_bind = binding_ok(spy, _names(e), MODES)
    st = e.worker.stats
    ok_oracle = _oracle_full(e)
    # One more decode iteration under a pool diff: every runner's pool changed, only at the step's slots.
    e2 = oracle_engine(f"random:{s}")
    pools = [r.binding.kv_pool for r in e2.runners]
    if inject:
        _inject_seed_bug(e2, monkeypatch)
    for i, p in enumerate(PROMPTS):
        e2.add_request(f"r{i}", p, greedy(12))
    _step_until_decode(e2)
    before = snapshot(pools)
    with DraftBatches(e2) as rec:
        _step_until_decode(e2)
    ok_pools = pools_touched_ok(before, pools, rec.last()[0].out_cache_loc)
    if inject:
        assert not ok_bind and not ok_pools and not ok_oracle
        assert min(st.accepted_per_depth[1:]) < st.num_verify  # lost acceptance at depth >= 1
    else:
        assert ok_bind and ok_pools and ok_oracle


def test_boundary_kv_positions_counted() -> None:
    """Accept-the-staleness policy: layer k's KV at the last min(k, n+1) committed positions was
    computed from unverified drafts (n = accepted drafts); the worker counts those positions."""
    e = oracle_engine("random:3", noise=0.12)
    for i, p in enumerate(PROMPTS):
        e.add_request(f"r{i}", p, greedy(12))
    expect = 0
    while e.has_work():
        e.step()
        if e.scheduler.last_mode == "DECODE":
            expect += sum(min(k, n + 1) for n in e.worker.last.accepted for k in range(3))
            assert e.worker.boundary_kv_stale_positions == expect
    assert 0 < expect
    # With every draft rejected (n = 0) step k >= 1 still reads a fresh draft at the last committed row.
    e2 = oracle_engine("random:3", noise=5.0)
    e2.generate(PROMPTS[:1], greedy(4))
    assert e2.worker.stats.num_accepted_tokens == 0
    assert e2.worker.boundary_kv_stale_positions == 2 * e2.worker.stats.num_verify


def test_runner_binding_is_read_only() -> None:
    e = Engine("tiny-dummy", draft="random:2")
    with pytest.raises(AttributeError):
        e.worker.drafts[1].binding = e.worker.drafts[0].binding  # type: ignore[misc]
