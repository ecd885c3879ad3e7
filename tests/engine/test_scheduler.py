"""Continuous batching (`Scheduler`) on a small built model: prefill goes first and is chunked to the
token budget, admission stops at `max_running_requests`, a short pool preempts the newest request
(LIFO) and resumes it with nothing lost or repeated, and each step's `StepReport` says what the step
was (mode, forwards, prompt tokens, requests added) for the engine's observers."""

from __future__ import annotations

import itertools

from mleagle.engine.contract.outputs import RequestOutput, SpecStats, StepOutput, TokenOutput
from mleagle.engine.contract.protocol import Outputs, decode_engine_msg, encode
from mleagle.engine.core.request import SpecCounts
from mleagle.engine.core.scheduler import StepReport
from tests.spec_helpers import all_free, greedy, run, tiny_engine


def test_prefill_goes_first_and_is_chunked() -> None:
    e = tiny_engine("none", chunked_prefill_size=5)
    e.add_request("a", [1, 2, 3], greedy(20))
    e.step()
    assert e.scheduler.last_mode == "EXTEND"
    e.step()
    assert e.scheduler.last_mode == "DECODE"
    e.add_request("b", list(range(10, 22)), greedy(4))  # 12 tokens: chunks of 5, 5, 2
    modes, kv = [], []
    for _ in range(3):
        e.step()
        modes.append(e.scheduler.last_mode)
        kv.append(e.scheduler.reqs["b"].kv_len)
    assert modes == ["EXTEND"] * 3 and kv == [5, 10, 12]  # the arrival's chunks before any decode
    while e.has_work():
        e.step()
    assert all_free(e)


def test_admission_stops_at_max_running() -> None:
    e = tiny_engine("none", max_running_requests=2)
    for i in range(3):
        e.add_request(f"r{i}", [5 + i, 6, 7], greedy(6))
    e.step()
    s = e.scheduler
    assert [r.rid for r in s.running] == ["r0", "r1"] and [r.rid for r in s.waiting] == ["r2"]
    while e.has_work():
        e.step()
    assert all_free(e)


def test_short_pool_preempts_the_newest_and_loses_nothing() -> None:
    prompts = [[1, 2, 3, 4], [9, 8, 7], [20, 21], [30, 31, 32, 33, 34]]
    want = run(tiny_engine("none"), prompts, greedy(24))
    e = tiny_engine("none", max_total_tokens=64)  # 4 x (prompt + 24) does not fit: someone is preempted
    got = run(e, prompts, greedy(24))
    assert got == want and e.scheduler.num_preemptions > 0
    assert all_free(e)


def test_step_report_says_what_the_step_did() -> None:
    e = tiny_engine("random:2")
    seen: list[tuple[list[StepOutput], StepReport]] = []
    e.observers.append(lambda outs, rep: seen.append((outs, rep)))
    e.add_request("a", [1, 2, 3, 4], greedy(8))
    e.step()
    outs, rep = seen[-1]
    assert rep.mode == "EXTEND" and rep.prefill_tokens == 4 and rep.added == [("a", 4)]
    assert [f.runner for f in rep.forwards] == ["target"] and rep.forwards[0].mode == "EXTEND"
    assert outs and outs[0].token_ids  # the first token comes with the prefill
    e.step()
    _, rep = seen[-1]
    assert rep.mode == "DECODE" and rep.added == [] and rep.finished is not None
    assert [f.runner for f in rep.forwards] == ["target", "draft0", "draft1"]
    assert [f.mode for f in rep.forwards] == ["TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_EXTEND"]
    assert rep.finished.iteration_miss == "no iteration graph"  # the CPU runs eager forwards
    assert e.last_report is rep and rep.step == e.scheduler.num_steps - 1


def test_a_delta_that_is_new_tokens_only_is_a_token_output() -> None:
    """A running request's steps hand back `TokenOutput`s (no pydantic model per request per step); its
    first delta (the TTFT marks), any delta with logprobs and its last are whole `RequestOutput`s. The
    engine's message carries the former as `TokenDelta`s, and the request's tokens and counts read the
    same from either."""
    from mleagle.engine.contract.sampling_params import SamplingParams

    e = tiny_engine("random:2")
    e.add_request("plain", [1, 2, 3], greedy(12))
    e.add_request("lp", [4, 5, 6], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, logprobs=1))
    got: dict[str, list[StepOutput]] = {"plain": [], "lp": []}
    wire: list[int] = []
    while e.has_work():
        outs = e.step()
        for o in outs:
            got[o.rid].append(o)
        msg = decode_engine_msg(encode(Outputs.of(outs)))
        assert isinstance(msg, Outputs)
        wire += [t for rid, ids, *_ in msg.tokens if rid == "plain" for t in ids]
    plain = got["plain"]
    assert isinstance(plain[0], RequestOutput) and plain[0].timing is not None
    assert isinstance(plain[-1], RequestOutput) and plain[-1].finished and plain[-1].spec is not None
    # its speculation counts, kept in plain slots while it ran, reach its last delta whole
    assert set(SpecCounts.__slots__) == set(SpecStats.model_fields)
    assert plain[-1].spec.num_verify == len(plain) - 1 and plain[-1].spec.num_draft_tokens == 2 * plain[-1].spec.num_verify
    middle = plain[1:-1]
    assert middle and all(isinstance(o, TokenOutput) and not o.finished and o.logprobs is None for o in middle)
    assert [o.num_output_tokens for o in plain] == list(itertools.accumulate(len(o.token_ids) for o in plain))
    assert all(o.num_prompt_tokens == 3 for o in plain)
    assert wire == [t for o in middle for t in o.token_ids]  # only the middle ones travel as token deltas
    assert all(isinstance(o, RequestOutput) and o.logprobs for o in got["lp"])
    assert all_free(e)


def test_aborts_end_waiting_and_running_requests() -> None:
    e = tiny_engine("none", max_running_requests=1)
    e.add_request("run", [1, 2], greedy(30))
    e.add_request("wait", [3, 4], greedy(30))
    e.step()
    e.abort("run")
    e.abort("wait")
    outs: list[StepOutput] = []
    while e.has_work():
        outs += e.step()
    assert {o.rid: o.finish_reason for o in outs if o.finished} == {"run": "abort", "wait": "abort"}
    assert all_free(e)


def test_warm_up_leaves_no_trace() -> None:
    """`Engine.warm_up` (run before the engine reports ready) leaves the engine as it found it: pools free,
    the prefix cache empty, counters at zero, request seeds starting over, so what users get afterwards
    is what an engine without it gives (greedy and engine-seeded sampling alike)."""
    from mleagle.engine.contract.sampling_params import SamplingParams

    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    sps = [greedy(10), SamplingParams(temperature=0.9, max_new_tokens=10)]  # the second: an engine seed
    want = run(tiny_engine("random:2"), prompts, sps)
    e = tiny_engine("random:2")
    assert e.warm_up(lengths=(8, 24)) > 0
    s = e.scheduler
    assert (s.num_steps, s.prefix_queries, s.prefix_hits) == (0, 0, 0)
    assert e.worker.stats.num_verify == 0 and e.worker.boundary_kv_stale_positions == 0  # type: ignore[attr-defined]
    assert e.mem.cache is not None and e.mem.cache.cached_tokens == 0 and all_free(e)
    assert run(e, prompts, sps) == want
