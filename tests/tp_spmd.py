"""The tensor-parallel checks that run inside the ranks: `python -m tests.tp_spmd RANK WORLD PORT OUT`.

`tests/engine/test_tp.py` starts WORLD processes of this module, joined by gloo over loopback (as torchrun
would, so the engine adopts the group), and asserts on the JSON each rank writes to OUT/rank{R}.json.
Every rank runs the same calls in the same order (the collectives inside the forwards pair up); rank 0
also builds the TP=1 reference engines and drives generation, while the other ranks follow its schedule
through the engine's control channel (`engine/service/ranks.py`), exactly as in serving.

Checks (one result key each): the logits of every forward of a speculative run (prefill, verify and
every draft-extend step, target and draft runners) equal TP=1's in both layouts, with a replicated KV
head, with replicated draft layers, with a reduced draft vocabulary and with a draft reading fused
target features through two blocks per step; greedy speculative output equals
TP=1 target-only output, eagerly and through emulated graphs (whole-iteration and per-forward), with
overlap scheduling forced on too (target-only: fused mixed steps), and with the speculation policy switching depth every iteration
(`cycle`) or choosing it (`auto`, overlap on: rank 0's timings published to every rank), every rank
running the same depths and catch-ups, and every pool of every rank is free afterwards; the prefix cache's hits, and a reset of it, are the same on every rank; the seed
regression; grammar-constrained output (the masked graph and its split halves) equals TP=1's: an
un-pruned draft-extend graph in the token-scattered layout records bs·W logprob rows
(padded, split over the ranks) and its gathered logits equal eager; with `[bs]` injected into a
graph's counts after its capture (what the capture check exists to stop) the gathered logits at the
selected rows come out wrong; injected before, the capture check refuses the graph.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
import zlib
from typing import Any

import torch
import torch.distributed as dist

from mleagle.engine.contract.event_bus import EventBus
from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine
from mleagle.engine.executor.capture import MetaMismatch
from mleagle.engine.executor.forward_batch import ForwardMode
from mleagle.engine.executor.graph_runner import GraphRunner
from mleagle.engine.service.telemetry import Telemetry
from mleagle.engine.service.tp_driver import driver_of, start_engine
from tests.spec_helpers import all_free, chaos, tiny_cfg

PROMPTS = [[5, 17, 30, 2], [9, 9, 1], list(range(40, 52)), [3], [100, 7, 7, 7, 8]]
LENS = [14, 6, 17, 1, 11]
LAYOUTS = ("all_reduce", "scattered")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n)


def engine(draft: str, kv: int = 2, vocab: int = 256, **over: Any) -> Engine:
    over.setdefault("spec_policy", "always")  # the full depth, unless a check is about the policy
    over.setdefault("max_running_requests", 12)
    e = start_engine(tiny_cfg(kv=kv, vocab=vocab), draft=draft, **over)
    chaos(e)
    return e


def record(e: Engine) -> list[tuple[str, str, torch.Tensor]]:
    """Every forward's (runner, mode, logits), in order."""
    seen: list[tuple[str, str, torch.Tensor]] = []
    for r in e.runners:
        prev = r.observer

        def obs(runner: Any, batch: Any, out: Any, prev: Any = prev) -> None:
            seen.append((runner.name, batch.mode.value, out.logits.detach().clone()))
            if prev is not None:
                prev(runner, batch, out)
        r.observer = obs
    return seen


def drive(e: Engine, rank: int, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]] | None:
    """Rank 0 generates (every step broadcast first); the others follow until rank 0 stops them."""
    if rank == 0:
        out = [c.token_ids for c in e.generate(prompts, params)]
        driver_of(e).pause()  # the engine stays usable: a pause, not a close
        return out
    driver_of(e).follow(e)
    return None


def pause(e: Engine, rank: int) -> None:
    """Bring every rank to the same scheduler state: rank 0's queued messages, then a stop."""
    if rank == 0:
        driver_of(e).pause()
    else:
        driver_of(e).follow(e)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def digest(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().numpy().tobytes())


def fused_draft(outdir: str, rank: int) -> str:
    """A 2-layer draft whose layer 0 reads fused target features (the stream after target layer 0) through
    two blocks per step, random weights from fixed seeds: the same folder contents on every rank."""
    from mleagle.engine.spec import train as T
    from mleagle.engine.spec.checkpoint import save_draft

    path = os.path.join(outdir, f"random_fused{rank}")
    save_draft(T.init_stack(engine("none").model, 2, "random", 11, blocks=2, aux_layers=(0,)), path, torch.float32)
    return path


def check_logits(rank: int, res: dict[str, Any], fused: str) -> None:
    """Every forward of one speculative run: TP=2 logits vs TP=1 (rank 0), and identical on every rank."""
    sps = [greedy(n) for n in LENS]
    # One request asks for prompt logprobs: an EXTEND whose logit rows are every prompt token.
    sps[2] = SamplingParams(temperature=0.0, max_new_tokens=LENS[2], prompt_logprobs=2)
    # A reduced draft vocabulary with ids in both vocab shards (its head rows collected from both ranks).
    sub = torch.arange(1, 256, 3)
    for layout in LAYOUTS:
        # vocab 255: shards of 128 rows, the last one with a padding row the head must cut off.
        for draft, kv, draft_tp, vocab, dv in (("random:2", 2, "shard", 256, None), ("random:2", 1, "shard", 255, None),
                                               ("random:2", 2, "replicate", 256, None), ("none", 1, "shard", 256, None),
                                               ("random:2", 2, "shard", 256, sub), (fused, 2, "shard", 256, None)):
            name = "random_fused" if draft == fused else draft
            key = f"{layout}/{name}/kv{kv}/v{vocab}{'' if dv is None else f'/dv{dv.numel()}'}/{draft_tp}"
            e = engine(draft, kv=kv, vocab=vocab, tp_size=2, tp_layout=layout, draft_tp=draft_tp)
            if dv is not None:
                e.draft_stack.set_vocab(dv)
            got = record(e)
            toks = drive(e, rank, PROMPTS, sps)
            res.setdefault("digests", {})[key] = [digest(x) for _, _, x in got]
            if rank == 0:
                ref = engine(draft, kv=kv, vocab=vocab)
                if dv is not None:
                    ref.draft_stack.set_vocab(dv)
                want = record(ref)
                ref_toks = [c.token_ids for c in ref.generate(PROMPTS, sps)]
                same_plan = [(n, m) for n, m, _ in got] == [(n, m) for n, m, _ in want]
                errs = [rel_err(a, b) for (_, _, a), (_, _, b) in zip(got, want)] if same_plan else [1.0]
                res.setdefault("logits", {})[key] = {
                    "forwards": len(got), "same_plan": same_plan, "max_rel_err": max(errs),
                    "modes": sorted({f"{n}:{m}" for n, m, _ in got}), "tokens_equal": toks == ref_toks,
                    "vocab_out": int(got[0][2].shape[1]), "head_rows_per_rank": int(e.model.lm_head.weight.shape[0]),
                    "draft_vocab_out": sorted({int(x.shape[1]) for n, _, x in got if n.startswith("draft")}),
                    "kv_heads_per_rank": int(e.target.binding.kv_pool.k[0].shape[1]),
                    "draft_kv_heads_per_rank": int(e.runners[-1].binding.kv_pool.k[0].shape[1]),
                    "pool_slots": [r.binding.kv_pool.num_slots for r in e.runners],
                    "ref_pool_slots": [r.binding.kv_pool.num_slots for r in ref.runners]}


def check_exact(rank: int, res: dict[str, Any], outdir: str, fused: str) -> None:
    """Greedy speculative output equals TP=1 target-only output, eager and through graph runners. The
    eager runs also record rank 0's state events (what the daemon relays and the TUI shows)."""

    from mleagle.engine.contract.events import write_recording

    sps = [greedy(n) for n in LENS]
    want = None
    if rank == 0:
        want = [c.token_ids for c in engine("none").generate(PROMPTS, sps)]
    out: dict[str, Any] = {}
    # A small pool and 4-token prefill chunks: chunked prefills and preemptions (the LIFO victim must be
    # the same on every rank), still exact.
    tight = {"max_total_tokens": 48, "chunked_prefill_size": 4}
    for layout in LAYOUTS:
        # Emulated graphs: plain greedy steps replay whole-iteration graphs, or (iteration_graph off) each
        # forward's own graph.
        # Overlap scheduling (on by default on CUDA only) forced on: step N+1 launched before step N is
        # finished, with preemptions, on every rank alike.
        for draft, emulate, tag, extra in (("random:3", False, "", {}), ("random:2:5:nochain", True, "", {}),
                                           ("none", True, "", {}), ("random:2", False, "/tight", tight),
                                           ("random:2", True, "/per_forward", {"iteration_graph": False}),
                                           ("none", True, "/per_forward", {"iteration_graph": False}),
                                           ("random:2", False, "/tight_overlap", tight),
                                           ("random:2", True, "/overlap", {}), (fused, True, "", {}),
                                           ("random:3", False, "/cycle", {"spec_policy": "cycle"}),
                                           ("random:2", True, "/auto_overlap", {"spec_policy": "auto"}),
                                           # target-only, two request slots: later prompts arrive while
                                           # others decode, in fused mixed steps staged into the graph
                                           ("none", True, "/fused_overlap", {"max_running_requests": 2})):
            name = "random_fused" if draft == fused else draft
            if layout == "scattered" and (tag in ("/tight", "/tight_overlap", "/cycle", "/auto_overlap")
                                          or (tag == "/per_forward" and draft == "none")):
                continue  # scheduling variants (tight pools, preemption, policies) are layout-blind: one layout
            e = engine(draft, tp_size=2, tp_layout=layout, graph_emulate=emulate, **extra)
            e.scheduler.overlap = tag.endswith("overlap")
            # Rank 0's events of an eager run, and of a run whose decode steps are whole-iteration replays.
            ev_key = "events" if not emulate else "events_iter" if name.startswith("random:") else None
            bus = None
            if rank == 0 and ev_key is not None and not extra and not tag:
                bus = EventBus()
                Telemetry.attach(e, bus)
            toks = drive(e, rank, PROMPTS, sps)
            if bus is not None:
                evs = bus.drain()
                if ev_key == "events":
                    write_recording(os.path.join(outdir, f"events_{layout}.jsonl"), evs, source="tests/tp_spmd.py")
                res.setdefault(ev_key, {})[layout] = [
                    [x.runner, x.mode, x.bs, x.width, x.logit_rows, x.global_num_tokens,
                     x.global_num_tokens_for_logprob, x.tp_size, x.layout, x.agree]
                    for x in evs if x.type == "logprob_meta"]
            replays = sum(sum(r.graphs.stats.replays.values()) for r in e.runners if r.graphs is not None)
            it = e.worker.iter_graph
            out[f"{layout}/{name}/{'graphs' if emulate else 'eager'}{tag}"] = {
                "equal": toks == want if rank == 0 else None, "free": all_free(e), "replays": replays,
                "iter_replays": sum(it.stats.replays.values()) if it is not None else 0,
                "preemptions": e.scheduler.num_preemptions,
                # The speculation policy's choices (rank 0's timings reach every rank): the same everywhere.
                "depths": list(e.worker.policy.stats.iterations_by_depth) if hasattr(e.worker, "policy") else [],
                "catch_ups": e.worker.policy.stats.catch_ups if hasattr(e.worker, "policy") else 0,
                "graph_fused": e.stats()["graph_fused_steps"]}
    res["exact"] = out


def check_prefix(rank: int, res: dict[str, Any]) -> None:
    """The prefix cache under TP: prompts sharing a prefix, run twice (the second run hits), then again
    after `reset_prefix_cache()` on rank 0 (a control message: the followers' caches empty too, or their
    admissions would differ from rank 0's). Output equals TP=1 target-only; hits are equal on both ranks."""
    base = list(range(60, 84))
    prompts = [base + [5, 6], base + [7], base[:13] + [9, 9, 9], base + [5, 6, 8]]
    sps = [greedy(n) for n in (9, 5, 7, 6)]
    want = [c.token_ids for c in engine("none").generate(prompts, sps)] if rank == 0 else None
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        e = engine("random:2", tp_size=2, tp_layout=layout)
        runs: list[Any] = []
        hits = []
        for i in range(3):
            if rank == 0 and i == 2:
                e.reset_prefix_cache()
            runs.append(drive(e, rank, prompts, sps))
            hits.append(e.scheduler.prefix_hits)
        out[layout] = {"equal": [r == want for r in runs] if rank == 0 else None, "hits": hits, "free": all_free(e)}
    res["prefix"] = out


def check_constrained(rank: int, res: dict[str, Any]) -> None:
    """Structured output under TP: grammar-constrained greedy requests, target-only and with a draft
    (`auto`), through emulated graphs with overlap forced on (the grammar-masked graph and its split
    halves), equal TP=1 constrained target-only output; every rank builds the same matchers from the
    same requests, so every rank replays the same graphs."""
    from mleagle.engine.contract.sampling_params import StructuredOutputs
    from tests.engine.test_constrain_engine import CASES, constrained

    gram = [(p, so) for p, so in CASES if so]
    prompts = [p for p, _ in gram]
    sps = [SamplingParams(temperature=0, max_new_tokens=16, structured_outputs=StructuredOutputs(**so)) for _, so in gram]
    want = [c.token_ids for c in constrained(engine("none")).generate(prompts, sps)] if rank == 0 else None
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        for draft, policy in (("none", "always"), ("random:2", "auto")):
            e = constrained(engine(draft, tp_size=2, tp_layout=layout, graph_emulate=True, spec_policy=policy))
            e.scheduler.overlap = True
            toks = drive(e, rank, prompts, sps)
            out[f"{layout}/{draft}"] = {
                "equal": toks == want if rank == 0 else None, "free": all_free(e),
                "masked": {str(d): n for d, n in e.graph_counts().get("masked", {}).get("by_depth", {}).items()}}
    res["constrained"] = out


def live_draft_batch(e: Engine, bs: int, width: int) -> Any:
    """A real un-pruned DRAFT_EXTEND view of `bs` running requests (as the worker builds its verify view)."""
    w = e.worker
    reqs = [r for r in e.scheduler.running if not r.prefilling][:bs]
    for r in reqs:
        assert e.mem.ensure(r, r.kv_len + width)
    rpi = w.rpi_of(reqs)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, e.arch.vocab_size, (bs, width), generator=g)
    v = w.view(ForwardMode.TARGET_VERIFY, rpi, ids, width, torch.arange(bs * width), w.host_view(reqs))
    hid = torch.randn(bs * width, e.arch.hidden_size, generator=g)
    v = dataclasses.replace(v, mode=ForwardMode.DRAFT_EXTEND, pruned=False, hidden_in=hid)
    return e.runners[1].bind(v)


def check_seed_regression(rank: int, res: dict[str, Any]) -> None:
    """Un-pruned draft-extend graphs in the token-scattered layout: metadata, gathered logits, faults."""
    e = engine("random:2", tp_size=2, tp_layout="scattered", graph_emulate=True)
    if rank == 0:
        for i, p in enumerate(PROMPTS):
            e.add_request(f"q{i}", p, greedy(64))
        while any(r.prefilling for r in e.scheduler.running) or e.scheduler.waiting:
            e.step()
    else:
        pass
    pause(e, rank)  # every rank now holds the same five running requests
    d0 = e.runners[1]
    width = d0.graphs.width
    out: dict[str, Any] = {}

    real_views = GraphRunner._views

    def faulty_views(self: GraphRunner, pbs: int) -> Any:
        """SGLang's #26416: the bucket's logprob counts written as [bs] per rank where the forward makes bs·W."""
        v = real_views(self, pbs)
        m = dataclasses.replace(v.row_meta, global_num_tokens_for_logprob=(pbs,) * 2)
        return dataclasses.replace(v, row_meta=m)

    def run(fault: str, bs: int) -> dict[str, Any]:
        """fault: "" (healthy), "capture" (injected before capture: the check must refuse the graph) or
        "unchecked" (injected into a captured graph's views: the gathers inside run by the wrong counts)."""
        g = GraphRunner(d0, mode=ForwardMode.DRAFT_EXTEND, width=width, buckets=[1, 2, 4, 6],
                        hidden_size=e.arch.hidden_size, dtype=e.dtype, pruned=False, emulate=True,
                        tp_size=2, layout="scattered")
        refused = False
        try:
            if fault == "capture":
                GraphRunner._views = faulty_views  # type: ignore[method-assign]
            g.capture()
        except MetaMismatch:
            refused = True
        finally:
            GraphRunner._views = real_views  # type: ignore[method-assign]
        sel = [i * width + i % width for i in range(bs)]
        r: dict[str, Any] = {"refused": refused, "bucket": g.bucket(bs), "sel": sel}
        if refused:
            return r
        if fault == "unchecked":
            for pbs in list(g._bucket_views):
                g._bucket_views[pbs] = faulty_views(g, pbs)
        r["metas"] = {pbs: list(g._views(pbs).row_meta.global_num_tokens_for_logprob) for pbs in g.caps}
        batch = live_draft_batch(e, bs, width)
        eager = d0.forward_eager(batch, observe=False).logits
        saved, d0.graphs = d0.graphs, g
        try:
            got = d0.forward(batch).logits
        finally:
            d0.graphs = saved
        # The selected rows: each request's last accepted row i·W + n_i (n_i = i mod W, every offset).
        r["max_rel_err_sel"] = rel_err(got[sel], eager[sel])
        r["bad_sel_rows"] = [s for s in sel if rel_err(got[s], eager[s]) > 1e-5]
        r["rows"] = int(got.shape[0])
        return r

    for bs in (3, 5):
        out[f"healthy/bs{bs}"] = run("", bs)
        out[f"fault_unchecked/bs{bs}"] = run("unchecked", bs)
        out[f"fault_capture/bs{bs}"] = run("capture", bs)
    out["width"] = width
    res["seed"] = out
    e.scheduler.running.clear()


def main() -> int:
    rank, world, port, outdir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res: dict[str, Any] = {"rank": rank}
    try:
        fused = fused_draft(outdir, rank)
        res["seconds"] = secs = {}
        for check, args in ((check_logits, (fused,)), (check_exact, (outdir, fused)), (check_prefix, ()),
                            (check_constrained, ()), (check_seed_regression, ())):
            t0 = time.perf_counter()
            check(rank, res, *args)  # type: ignore[operator]
            secs[check.__name__] = round(time.perf_counter() - t0, 2)
    except Exception:
        res["error"] = traceback.format_exc()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    if "error" in res:
        print(res["error"], file=sys.stderr, flush=True)
        os._exit(1)  # a failed rank: the others would wait on its collectives
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
