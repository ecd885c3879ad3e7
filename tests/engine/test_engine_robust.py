"""Nothing leaks and bad input harms nobody.

Leak tests pour hundreds of random requests (random prompt and answer lengths, greedy and seeded
sampling, stop token ids, random aborts, arrivals while others run) into an engine whose KV pool is far
smaller than the load, so admission waits and decode preempts. Every request must end with the right
finish reason and its full answer (equal to its output when run alone), and afterwards every KV page
and request slot is free. Bad-input tests check each refusal is a clear error raised before anything is
allocated, while requests already in flight finish exactly as they would have.
"""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine, EngineInputError
from tests.spec_helpers import TINY_TOK

pytestmark = pytest.mark.usefixtures("one_thread")


def assert_all_free(e: Engine) -> None:
    s = e.scheduler
    assert not s.running and not s.waiting and not s.reqs
    assert not e.mem.idle_problems()  # every page free or evictable in the prefix cache, no lock left
    e.reset_prefix_cache()  # then, the cache emptied, every page is back on the free list
    assert e.allocator.num_free_tokens == e.allocator.capacity_tokens
    assert sorted(e.allocator.free_pages) == list(range(1, e.allocator.num_pages))
    assert sorted(e.mem.free_reqs) == list(range(e.mem.max_reqs))


def alone(e: Engine, prompt: list[int], sp: SamplingParams) -> list[int]:
    rid = f"alone-{random.random()}"
    e.add_request(rid, prompt, sp)
    out: list[int] = []
    while e.has_work():
        for o in e.step():
            if o.rid == rid:
                out += o.token_ids
    return out


def random_load(e: Engine, n: int, vocab: int, max_prompt: int, max_new: int, seed: int,
                p_abort: float) -> tuple[dict[str, tuple[list[int], SamplingParams]], dict[str, list[int]],
                                         dict[str, str | None], set[str]]:
    """Drive `n` random requests through `e` with arrivals and aborts; returns what happened."""
    rng = random.Random(seed)
    reqs: dict[str, tuple[list[int], SamplingParams]] = {}
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))]
        kw: dict = {"max_new_tokens": rng.randint(1, max_new)}
        if rng.random() < 0.3:
            kw.update(temperature=0.8, top_k=rng.choice([-1, 5, 50]), seed=rng.randrange(1000))
        else:
            kw.update(temperature=0)
        if rng.random() < 0.2:
            kw["stop_token_ids"] = [rng.randrange(vocab) for _ in range(20)]  # enough that stops happen
        reqs[f"r{i}"] = (prompt, SamplingParams(**kw))
    pending = list(reqs)
    outs: dict[str, list[int]] = {r: [] for r in reqs}
    reasons: dict[str, str | None] = {}
    aborted: set[str] = set()
    live: set[str] = set()
    steps = 0
    while pending or e.has_work():
        for _ in range(rng.randint(0, 6)):  # arrivals while others run
            if pending:
                rid = pending.pop(0)
                e.add_request(rid, *reqs[rid])
                live.add(rid)
        if live and rng.random() < p_abort:
            rid = rng.choice(sorted(live))
            e.abort(rid)
            aborted.add(rid)
        for o in e.step():
            outs[o.rid] += o.token_ids
            if o.finished:
                assert o.rid not in reasons, "a request finished twice"
                reasons[o.rid] = o.finish_reason
                live.discard(o.rid)
        steps += 1
        assert steps < 20000
    return reqs, outs, reasons, aborted


def check_load(e: Engine, reqs, outs, reasons, aborted, n_alone: int) -> None:
    assert set(reasons) == set(reqs), "every request ends"
    checked = 0
    for rid, (prompt, sp) in reqs.items():
        got, why = outs[rid], reasons[rid]
        if why == "abort":
            assert rid in aborted
            assert len(got) <= sp.max_new_tokens
            continue
        stops = [j for j, t in enumerate(got) if t in sp.stop_token_ids]
        if why == "stop":
            assert stops == [len(got) - 1], "cut exactly at the first stop token"
        else:
            assert why == "length" and len(got) == sp.max_new_tokens and not stops
        if checked < n_alone:
            assert got == alone(e, prompt, sp), f"{rid}: output differs from its run alone"
            checked += 1
    assert checked == n_alone
    assert_all_free(e)


def test_leak_tiny_dummy_under_pressure() -> None:
    e = Engine("tiny-dummy", max_total_tokens=320, max_running_requests=12, chunked_prefill_size=48, threads=1)
    reqs, outs, reasons, aborted = random_load(e, 300, e.arch.vocab_size, 40, 48, seed=1, p_abort=0.15)
    assert e.scheduler.num_preemptions > 0
    assert any(r == "abort" for r in reasons.values()) and any(r == "stop" for r in reasons.values())
    check_load(e, reqs, outs, reasons, aborted, n_alone=60)


def test_leak_smollm2_under_pressure() -> None:
    e = Engine("smollm2-135m", max_total_tokens=128, max_running_requests=6, chunked_prefill_size=32, threads=1)
    reqs, outs, reasons, aborted = random_load(e, 16, 2000, 24, 32, seed=2, p_abort=0.1)
    assert e.scheduler.num_preemptions > 0
    check_load(e, reqs, outs, reasons, aborted, n_alone=4)


# --- bad input -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny() -> Engine:
    return Engine("tiny-dummy", max_total_tokens=1200, max_context_len=256, threads=1)


@pytest.mark.parametrize("kw", [
    {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"min_p": 1.5}, {"min_p": -0.1},
    {"max_new_tokens": 0}, {"logprobs": 21}, {"logprobs": -1}, {"repetition_penalty": 0.0},
    {"presence_penalty": 3.0}, {"frequency_penalty": -2.5}, {"seed": -1}, {"stop": [""]},
    {"stop_token_ids": [-3]}, {"min_new_tokens": 5, "max_new_tokens": 2}, {"no_such_field": 1},
])
def test_invalid_sampling_values_are_validation_errors(kw: dict) -> None:
    with pytest.raises(ValidationError) as ei:
        SamplingParams(**kw)
    assert next(iter(kw)) in str(ei.value) or "min_new_tokens" in str(ei.value)


def test_unknown_model_lists_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown model .no-such-model.*smollm2-135m.*tiny-dummy"):
        Engine("no-such-model")


def test_bad_requests_refused_while_others_complete(tiny: Engine) -> None:
    e = tiny
    sp = SamplingParams(temperature=0, max_new_tokens=20)
    good = {f"g{i}": [((i + 1) * 37 + j) % 512 for j in range(5 + 9 * i)] for i in range(3)}
    ref = {rid: alone(e, p, sp) for rid, p in good.items()}
    for rid, p in good.items():
        e.add_request(rid, p, sp)
    outs: dict[str, list[int]] = {rid: [] for rid in good}
    for o in e.step():
        outs[o.rid] += o.token_ids
    used = e.allocator.num_used_tokens
    bad = [
        ("g0", [1, 2], sp, "already in use"),  # duplicate rid of an in-flight request
        ("b1", [], sp, "empty"),
        ("b2", [1, 512], sp, "out of range"),
        ("b3", [-1, 4], sp, "out of range"),
        ("b4", [7] * 256, sp, "context limit"),  # prompt as long as the context
        ("b5", [7] * 300, sp, "context limit"),  # longer than the context
        ("b6", [7] * 200, SamplingParams(max_new_tokens=100), "exceeds the context limit"),
        ("b7", [7], SamplingParams(stop=["x"]), "tokenizer"),  # stop strings need a tokenizer
    ]
    for rid, p, s, msg in bad:
        with pytest.raises(EngineInputError, match=msg):
            e.add_request(rid, p, s)
        assert e.allocator.num_used_tokens == used  # refused before allocating anything
    while e.has_work():
        for o in e.step():
            outs[o.rid] += o.token_ids
    assert outs == ref
    assert_all_free(e)


def test_pool_too_small_for_one_request() -> None:
    e = Engine("tiny-dummy", max_total_tokens=64, threads=1)
    with pytest.raises(EngineInputError, match="KV slots"):
        e.add_request("x", [1] * 40, SamplingParams(max_new_tokens=40))
    assert_all_free(e)


def test_generate_with_one_bad_prompt_leaves_nothing_behind(tiny: Engine) -> None:
    sp = SamplingParams(temperature=0, max_new_tokens=8)
    with pytest.raises(EngineInputError, match="empty"):
        tiny.generate([[1, 2, 3], [4, 5], []], sp)
    assert_all_free(tiny)
    a = tiny.generate([[1, 2, 3]], sp)[0]
    assert len(a.token_ids) == 8 and a.finish_reason == "length"


def test_a_prompt_that_is_no_prompt_is_an_input_error(tmp_path) -> None:
    """None (or a number, or a list mixing ids and text) as a prompt of the offline API: an
    `EngineInputError` naming what a prompt is, not the chat template's (jinja's) or the tokenizer's
    own error; nothing is left behind, and a good prompt still runs."""
    cfg = tmp_path / "tiny-tok.toml"
    cfg.write_text(TINY_TOK)
    e = Engine(str(cfg))
    sp = SamplingParams(max_new_tokens=2, temperature=0)
    for bad in (None, 7, [1, "a"], [None], ["text"]):
        for chat in (False, True):
            with pytest.raises(EngineInputError, match="a prompt is text, a list of token ids or a list of chat"):
                e.generate(["Hello", bad], sp, chat=chat)
            with pytest.raises(EngineInputError, match="a prompt is text"):
                list(e.stream([bad], sp, chat=chat))
    assert_all_free(e)
    assert len(e.generate(["Hello"], sp, chat=True)[0].token_ids) == 2
    assert len(e.generate([[1, 2, 3]], sp)[0].token_ids) == 2
