"""CUDA graphs on a real GPU (`pytest -m gpu`; skipped without CUDA): replay equals eager, exactness.

For every runner (target decode or verify, each draft-extend step) and every captured bucket, a live
batch one short of the bucket (so one row is padding) is replayed and also run eagerly on the same
inputs: the logits agree to float32 rounding and the argmax is identical. Through the whole engine,
speculative greedy output with graphs equals target-only greedy output (float32; also with a draft
reading fused target features through two blocks per step, with a five-step draft whose last steps run
earlier blocks under `auto` with a depth in between, and with the speculation policy switching depth
every iteration, and after the warm-up has timed `auto`'s depths at every batch size), a seeded
sampled request gives the same tokens alone and in a batch, and every pool is free afterwards.
"""

from __future__ import annotations

import time

import pytest
import torch

from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine
from tests.spec_helpers import (
    all_free,
    chaos,
    check_extend_buckets,
    check_fill_buckets,
    greedy,
    run,
    tiny_cfg,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 17, 30, 2], [9, 9, 1], list(range(40, 52)), [3], [100, 7, 7, 7, 8], [1, 2], [60, 61, 62],
           [200, 3, 4, 5, 6, 7], [11] * 9, [33, 34]]


def _engine(draft: str = "none", **over) -> Engine:
    over.setdefault("spec_policy", "always")
    e = Engine(tiny_cfg(), device="cuda", dtype="float32", draft=draft, max_running_requests=16, **over)
    chaos(e)
    return e


@pytest.mark.parametrize(("draft", "policy"), [("none", "always"), ("random:3", "always"), ("random:3", "cycle")])
def test_replay_equals_eager_at_every_bucket(draft: str, policy: str) -> None:
    """Every captured shape of every runner: under the `cycle` policy that is the decode, verify and
    draft-extend graphs of every depth 0..S, not only the full one."""
    import dataclasses

    from mleagle.engine.executor.forward_batch import ForwardMode

    e = _engine(draft, spec_policy=policy)
    assert all(r.graphs is not None for r in e.runners), e.graph_report
    if policy == "cycle":  # target: decode + verify at W = 2..4; draft k: extend at W = k+2..4
        assert [1 + len(r.more_graphs) for r in e.runners] == [4, 3, 2, 1], e.graph_report
    for i in range(12):
        e.add_request(f"q{i}", PROMPTS[i % len(PROMPTS)] + [i], greedy(40))
    while any(r.prefilling for r in e.scheduler.running) or e.scheduler.waiting:
        e.step()
    w = e.worker
    for runner, g in [(r, g) for r in e.runners for g in [r.graphs, *r.more_graphs]]:
        for pbs in g.buckets:
            bs = max(1, min(pbs - 1, 12)) if pbs > 1 else 1
            reqs = e.scheduler.running[:bs]
            for r in reqs:
                assert e.mem.ensure(r, r.kv_len + g.width)
            rpi = w.rpi_of(reqs)
            ids = torch.randint(0, e.arch.vocab_size, (bs, g.width), device="cuda")
            rows = torch.arange(bs, device="cuda") * g.width if g.pruned else torch.arange(bs * g.width, device="cuda")
            mode = g.mode if g.mode is not ForwardMode.DRAFT_EXTEND else ForwardMode.TARGET_VERIFY
            rows = torch.arange(bs, device="cuda") if g.mode is ForwardMode.DECODE else rows
            v = w.view(mode, rpi, ids, g.width, rows, w.host_view(reqs))
            if g.mode is ForwardMode.DRAFT_EXTEND:
                v = dataclasses.replace(v, mode=g.mode, pruned=True,
                                        hidden_in=torch.randn(bs * g.width, e.arch.hidden_size, device="cuda"))
            b = runner.bind(v)
            if g.bucket(bs) != pbs:
                continue
            rep = runner.forward(b)
            assert rep.graph_bs == pbs
            got = rep.logits.clone()
            ref = runner.forward_eager(b, observe=False).logits
            assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), (runner.name, pbs, (got - ref).abs().max())
            assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("draft", ["random:1", "random:3", "random:2:5:nochain"])
def test_speculative_greedy_with_graphs_equals_target_only(draft: str) -> None:
    ref = _engine("none", cuda_graph=False)
    sps = [greedy(24), greedy(9), greedy(30), greedy(1), greedy(17), greedy(40), greedy(5), greedy(12), greedy(8), greedy(3)]
    want = run(ref, PROMPTS, sps)
    e = _engine(draft)
    assert run(e, PROMPTS, sps) == want  # plain greedy: whole-iteration graphs
    assert sum(e.worker.iter_graph.stats.replays.values()) > 0
    lp = [sp.model_copy(update={"logprobs": 1}) for sp in sps]  # not plain: every forward replays its own graph
    assert run(e, PROMPTS, lp) == want
    assert all(sum(r.graphs.stats.replays.values()) > 0 for r in e.runners)
    assert all_free(e)
    t = _engine("none")
    assert run(t, PROMPTS, sps) == want
    assert all_free(t)


@pytest.mark.parametrize("draft", ["random:3", "random:2:5:nochain"])
def test_every_depth_replays_its_iteration_graph_and_stays_exact(draft: str) -> None:
    """The policy forced to switch depth every iteration (`cycle`), overlap scheduling on: each depth's
    whole-iteration graph replays (plain decode steps, shallow verifies, the full depth), the draft
    layers catch up between them, and greedy output equals target-only's; with logprobs (not plain)
    every runner's graph of every shape replays instead; pools free afterwards."""
    ref = _engine("none", cuda_graph=False)
    sps = [greedy(24), greedy(9), greedy(30), greedy(1), greedy(17), greedy(40), greedy(5), greedy(12), greedy(8), greedy(3)]
    want = run(ref, PROMPTS, sps)
    e = _engine(draft, spec_policy="cycle")
    assert e.scheduler.overlap
    s = e.worker.steps
    assert sorted(e.worker.iter_graphs) == list(range(s + 1)), e.graph_report
    assert run(e, PROMPTS, sps) == want
    assert all(sum(g.stats.replays.values()) > 0 for g in e.worker.iter_graphs.values())
    assert e.worker.policy.stats.catch_ups > 0
    lp = [sp.model_copy(update={"logprobs": 1}) for sp in sps]
    assert run(e, PROMPTS, lp) == want
    assert all(sum(g.stats.replays.values()) > 0 for r in e.runners for g in [r.graphs, *r.more_graphs])
    assert all_free(e)
    auto = _engine(draft, spec_policy="auto")
    assert run(auto, PROMPTS, sps) == want and all_free(auto)


def _saved_draft(path, layers: int, seed: int, **init) -> str:
    """A random draft for the tiny target, its weights moved off their init (non-trivial norms and
    mixing), saved in float32 to `path`; `init` as `train.init_stack` takes it."""
    from mleagle.engine.spec import train as T
    from mleagle.engine.spec.checkpoint import save_draft

    stack = T.init_stack(Engine(tiny_cfg(), draft="none").model, layers, "random", seed, **init)
    with torch.no_grad():
        for p in T.trainable(stack):
            p.add_(torch.randn_like(p) * 0.05)
    save_draft(stack, path, torch.float32)
    return str(path)


def test_fused_two_block_draft_with_graphs_equals_target_only(tmp_path) -> None:
    """A draft whose layer 0 reads fused target features (the target's output widens to [T, 2H]) and whose
    steps run two blocks each: whole-iteration and per-forward graphs keep greedy output exact."""
    draft = _saved_draft(tmp_path / "fused", 3, 9, blocks=2, aux_layers=(0,))
    ref = _engine("none", cuda_graph=False)
    sps = [greedy(24), greedy(9), greedy(30), greedy(1), greedy(17), greedy(40), greedy(5), greedy(12), greedy(8), greedy(3)]
    want = run(ref, PROMPTS, sps)
    e = _engine(draft)
    assert e.model.aux_layers == (0,) and e.worker.iter_graph is not None, e.graph_report
    assert run(e, PROMPTS, sps) == want
    assert sum(e.worker.iter_graph.stats.replays.values()) > 0
    lp = [sp.model_copy(update={"logprobs": 1}) for sp in sps]
    assert run(e, PROMPTS, lp) == want
    assert all(sum(r.graphs.stats.replays.values()) > 0 for r in e.runners)
    assert all_free(e)


def test_tied_five_step_draft_with_depths_between_equals_target_only(tmp_path) -> None:
    """A 5-step draft whose last two steps run the blocks of steps 2 and 3 (stored once, loaded as
    copies), under `auto` choosing among depths 0, 2 and 5: each depth has its whole-iteration graph and
    greedy output equals target-only's; pools free afterwards."""
    draft = _saved_draft(tmp_path / "tied", 5, 11, tied={3: 1, 4: 2})
    ref = _engine("none", cuda_graph=False)
    sps = [greedy(24), greedy(9), greedy(30), greedy(1), greedy(17), greedy(40), greedy(5), greedy(12), greedy(8), greedy(3)]
    want = run(ref, PROMPTS, sps)
    e = _engine(draft, spec_policy="auto", spec_depths=[2])
    assert e.worker.steps == 5 and sorted(e.worker.iter_graphs) == [0, 2, 5], e.graph_report
    assert run(e, PROMPTS, sps) == want
    assert all_free(e)


@pytest.mark.parametrize("draft", ["none", "random:2"])
def test_seeded_sampling_is_batch_invariant_on_the_gpu(draft: str) -> None:
    e = _engine(draft)
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_new_tokens=24)
    alone = run(e, [PROMPTS[0]], [sp])[0]
    batch = run(e, PROMPTS[1:6] + [PROMPTS[0]], [SamplingParams(temperature=1.0, max_new_tokens=15, seed=i) for i in range(5)] + [sp])
    assert batch[-1] == alone
    assert all_free(e)


def test_overlap_scheduling_matches_and_frees() -> None:
    on = _engine("random:3")
    assert on.scheduler.overlap
    off = _engine("random:3", overlap_schedule=False)
    sps = [greedy(20 + i) for i in range(len(PROMPTS))]
    assert run(on, PROMPTS, sps) == run(off, PROMPTS, sps)
    assert all_free(on) and all_free(off)


def test_the_host_wait_for_the_device_is_counted() -> None:
    """A step whose result waits behind tens of milliseconds of device work adds them to `device_wait_s`
    (the loop's `device_wait` share in `bench serve`), and steps the device has finished add ~nothing."""
    e = _engine()
    e.add_request("a", PROMPTS[0], greedy(8))
    e.step()  # the prefill
    torch.cuda.synchronize()
    w0 = e.stats()["device_wait_s"]
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # 20 float32 GEMMs of 137 GFLOP each: tens of milliseconds queued on the stream
        x = x @ x / 64
    e.step()  # launches behind the GEMMs; under overlap the wait is in the next step's finish
    while e.has_work():
        e.step()
    waited = e.stats()["device_wait_s"] - w0
    assert waited >= 0.02, waited
    torch.cuda.synchronize()
    w1 = e.stats()["device_wait_s"]
    e.add_request("b", PROMPTS[1], greedy(1))
    while e.has_work():
        torch.cuda.synchronize()  # everything done before each step: its waits find the copies there
        e.step()
    assert e.stats()["device_wait_s"] - w1 < 0.03


def test_the_device_time_of_iterations_is_counted_without_the_work_queued_before_them() -> None:
    """`device_busy_s` grows by each decode iteration's device time, read once its results are back:
    less than the steps' wall, and not the tens of milliseconds of other work the stream held before an
    iteration's launch (its first mark fires when the stream reaches the iteration)."""
    e = _engine()
    e.add_request("a", PROMPTS[0], greedy(24))
    e.step()  # the prefill
    torch.cuda.synchronize()
    s0 = e.stats()
    t0 = time.perf_counter()
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # tens of milliseconds queued ahead of the next iteration
        x = x @ x / 64
    while e.has_work():
        e.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    s1 = e.stats()
    busy, n = s1["device_busy_s"] - s0["device_busy_s"], s1["device_busy_iterations"] - s0["device_busy_iterations"]
    assert n >= 20 and 0 < busy < wall, (n, busy, wall)
    assert busy / n < 0.005, busy / n  # a tiny model's iteration, not the GEMMs' milliseconds


def test_the_warm_up_times_auto_at_every_batch_size_and_output_stays_exact() -> None:
    """On a GPU the warm-up's timing of `auto` covers every batch-size bucket up to the running limit
    within its default budget (graph replays take milliseconds), keeps only the timings, and the engine
    serves target-only's greedy output afterwards with every pool free."""
    from mleagle.engine.spec.policy import size_bucket

    want = run(_engine(), PROMPTS, greedy(24))
    e = _engine("random:3", spec_policy="auto")
    e.warm_up(lengths=(8, 24))
    p = e.worker.policy  # type: ignore[attr-defined]
    assert all(p.timed(b) for b in {size_bucket(n) for n in range(1, 17)}), p.samples
    assert sum(p.stats.iterations_by_depth) == 0 and all_free(e)
    assert run(e, PROMPTS, greedy(24)) == want
    assert all_free(e)


@pytest.mark.parametrize("draft", ["none", "random:3"])
def test_prefill_graph_replay_equals_eager_at_every_token_bucket(draft: str) -> None:
    """Every runner's prefill graphs (target, each draft layer), every token bucket up to 512, float32."""
    e = _engine(draft, prefill_graph_max_tokens=512)
    assert check_extend_buckets(e) == len(e.runners) * 6
    assert all_free(e)


@pytest.mark.parametrize("draft", ["none", "random:3"])
def test_a_prefill_graph_commits_plain_first_tokens_on_cuda(draft: str) -> None:
    """`check_graph_first_tokens` on real CUDA graphs (overlap on), float32: the prefill graph's
    first-token tail against the same engine with eager prefill."""
    from tests.engine.test_graph_runner import check_graph_first_tokens

    common = dict(chunked_prefill_size=48, max_total_tokens=420)
    check_graph_first_tokens(_engine(draft, prefill_graph_max_tokens=0, **common),
                             _engine(draft, prefill_graph_max_tokens=64, **common), exact_count=False)


def test_a_prefill_on_its_own_stream_equals_one_behind_the_iteration() -> None:
    """Target-only on real CUDA graphs (overlap on), float32: arrivals every other step while others
    decode, greedy and seeded, a stop string's worth of stop tokens, aborts, and a pool small enough to
    preempt; without fused mixed steps, the prefill stream (`prefill_side_stream`, on by default) gives
    the output of the engine that runs each prefill behind the iteration in flight, ran its prefills
    there, and every pool and held free comes back."""
    import random

    over = dict(max_total_tokens=500, chunked_prefill_size=48)
    side = _engine("none", fuse_mixed_steps=False, **over)
    behind = _engine("none", fuse_mixed_steps=False, prefill_side_stream=False, **over)
    assert side.worker.side is not None and behind.worker.side is None and side.mem.held is not None
    rng = random.Random(5)
    script = []
    for i in range(48):
        p = [rng.randrange(1, 250) for _ in range(rng.randint(3, 90))]
        sp = SamplingParams(temperature=0, max_new_tokens=rng.randint(4, 40), stop_token_ids=[7])
        if i % 5 == 2:
            sp = SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_new_tokens=20, logprobs=1)
        script.append((f"r{i}", p, sp, i % 9 == 4))
    from tests.engine.test_overlap import _scripted

    assert _scripted(behind, script, back=2) == _scripted(side, script, back=2)
    st = side.stats()
    assert st["side_stream_prefills"] >= 40 and behind.stats()["side_stream_prefills"] == 0
    assert st["mixed_steps"] > 10 and side.scheduler.num_preemptions > 0, (st["mixed_steps"], side.scheduler.num_preemptions)
    assert all_free(side) and all_free(behind) and not side.mem.held


def test_prefill_graphs_keep_greedy_output_exact() -> None:
    """Through the engine: prompts of many lengths, cached prefixes and chunked prefill, every prefill
    on its graph where it fits; the output equals an engine with no graphs at all."""
    ref = _engine("none", cuda_graph=False)
    e = _engine("random:3", prefill_graph_max_tokens=64, chunked_prefill_size=48)
    prompts = PROMPTS + [list(range(1, 70)), list(range(1, 70)) + [5, 6], [7] * 130]
    sps = [greedy(12)] * len(prompts)
    assert run(e, prompts, sps) == run(ref, prompts, sps)
    for p in prompts:
        assert run(e, [p], greedy(8)) == run(ref, [p], greedy(8))
    assert sum(e.runners[0].extend_graphs.stats.replays.values()) > len(prompts)
    assert all_free(e)


@pytest.mark.parametrize(("draft", "policy"), [("none", "always"), ("random:2:1", "auto"), ("random:3:2", "always")])
def test_grammar_masked_graph_equals_eager(draft: str, policy: str) -> None:
    """Greedy iterations with grammars replay the grammar-masked graphs on the GPU (decode steps: the
    forward, then mask + sample; drafting iterations: the verify forward, then the chain of accept,
    draft forwards and masked selects, the host filling each step's masks between them): the output
    equals an engine without graphs, float32, and overlap (on on CUDA) splits them."""
    from mleagle.engine.contract.sampling_params import StructuredOutputs
    from tests.engine.test_constrain_engine import CASES, constrained

    gram = [(p, so) for p, so in CASES if so]
    params = [SamplingParams(temperature=0, max_new_tokens=20, structured_outputs=StructuredOutputs(**so)) for _, so in gram]
    ref = constrained(_engine("none", cuda_graph=False))
    e = constrained(_engine(draft, spec_policy=policy))
    depth = 0 if draft == "none" else e.worker.full_depth
    assert depth in e.worker.masked_graphs, e.graph_report
    assert run(e, [p for p, _ in gram], params) == run(ref, [p for p, _ in gram], params)
    assert sum(m.replays for m in e.worker.masked_graphs.values()) > 0
    if policy == "always":
        assert e.worker.masked_graphs[depth].replays > 0
    assert all_free(e)


def test_the_draft_fill_graph_equals_the_per_layer_fill_at_every_token_bucket() -> None:
    """The draft fill as one graph against the per-layer path, every token bucket up to 512, float32."""
    e = _engine("random:3", prefill_graph_max_tokens=512)
    assert check_fill_buckets(e) == 6


@pytest.mark.parametrize("sampled", [True, False])
def test_a_fused_mixed_step_equals_two_forwards_on_cuda(sampled: bool) -> None:
    """On real CUDA graphs (overlap on), arrivals every other step while others decode: the fused mixed
    step (one EXTEND on a prefill graph for the arrivals and the decoding rows' next tokens, their ids
    read from the device; staged whole into the graph where every row is plain greedy) gives the same
    greedy (and with `sampled`, seeded) output as the two-forward mixed step, float32, the slot state's
    output counts agree with the host's after every step, and every pool comes back free."""
    from tests.engine.test_overlap import _counts_agree, _staggered

    two = _engine("none", fuse_mixed_steps=False)
    one = _engine("none")  # the default
    assert one.scheduler.overlap and two.scheduler.overlap
    prompts = [*PROMPTS, list(range(60, 110)), list(range(5, 40))]
    sps = [SamplingParams(temperature=0, max_new_tokens=12 + 3 * i) for i in range(len(prompts))]
    if sampled:
        sps[2] = SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_new_tokens=30, logprobs=1)
    want, _ = _staggered(two, prompts, sps, every=2)
    got, _ = _staggered(one, prompts, sps, every=2, after_step=lambda: _counts_agree(one))
    assert got == want
    st = one.stats()
    assert st["fused_mixed_steps"] >= len(prompts) // 2 and two.stats()["fused_mixed_steps"] == 0
    assert (st["graph_fused_steps"] < st["fused_mixed_steps"]) if sampled else \
        (st["graph_fused_steps"] == st["fused_mixed_steps"]), st
    assert all_free(one) and all_free(two)
