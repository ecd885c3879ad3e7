"""Stop conditions on the real SmolLM2, each with its finish reason and exact cut: EOS, stop token ids,
stop strings spanning tokens, max new tokens, the context limit; plus sampling checks that need a
peaked real distribution (top-p / min-p draws inside the allowed set, seeds in a batch) and the
`mleagle generate` CLI end to end.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine, EngineInputError
from mleagle.engine.entrypoints.generate import main as generate_main

PROMPT = "Write a short poem about the sea."


@pytest.fixture(scope="module")
def engine() -> Engine:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine("smollm2-135m", max_total_tokens=2048, max_context_len=100, threads=1)
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def base(engine: Engine) -> tuple[list[int], list[int]]:
    """A prompt and its 40 greedy tokens without any stop."""
    ids = engine.encode_prompt(PROMPT, chat=True)
    c = engine.generate([ids], SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))[0]
    return ids, c.token_ids


def test_eos_stop(engine: Engine) -> None:
    c = engine.generate(["What is the capital of France? Answer in one sentence."],
                        SamplingParams(temperature=0, max_new_tokens=40), chat=True)[0]
    assert c.finish_reason == "stop" and c.matched_stop == 2
    assert c.token_ids[-1] == 2 and 2 not in c.token_ids[:-1]
    assert "Paris" in c.text and "<|im_end|>" not in c.text


def test_stop_token_ids_cut_at_first(engine: Engine, base) -> None:
    ids, gen = base
    stop_tok = gen[7]
    k = gen.index(stop_tok)
    c = engine.generate([ids], SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=[stop_tok, 49000]))[0]
    assert c.finish_reason == "stop" and c.matched_stop == stop_tok
    assert c.token_ids == gen[: k + 1]


def test_stop_string_spanning_tokens(engine: Engine, base) -> None:
    ids, gen = base
    tok = engine.tokenizer
    assert tok is not None
    # a stop string made of the end of token 10 and the start of token 11
    a, b = tok.decode(gen[10:11]), tok.decode(gen[11:12])
    assert a and b
    stop = a[-2:] + b[:2] if len(a) >= 2 and len(b) >= 2 else a + b
    full = tok.decode(gen)
    at = full.index(stop)
    keep = next(k for k in range(1, len(gen) + 1) if stop in tok.decode(gen[:k]))
    sp = SamplingParams(temperature=0, max_new_tokens=40, stop=[stop, "never-appears-xyz"])
    c = engine.generate([ids], sp)[0]
    assert c.finish_reason == "stop" and c.matched_stop == stop
    assert c.token_ids == gen[:keep]  # cut on the token that completed the stop string
    assert c.text == full[:at]  # the stop string itself is not part of the text
    # the streaming path returns the same tokens
    toks = [t for _, o in engine.stream([ids], sp) for t in o.token_ids]
    assert toks == gen[:keep]


def test_max_new_tokens_exact(engine: Engine, base) -> None:
    ids, gen = base
    for n in (1, 13):
        c = engine.generate([ids], SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))[0]
        assert c.finish_reason == "length" and c.token_ids == gen[:n]


def test_context_limit(engine: Engine, base) -> None:
    ids, gen = base
    room = engine.max_context_len - len(ids)
    assert 40 < room < 100
    c = engine.generate([ids], SamplingParams(temperature=0, max_new_tokens=room, ignore_eos=True))[0]
    assert c.finish_reason == "length" and len(c.token_ids) == room
    assert c.token_ids[:40] == gen
    with pytest.raises(EngineInputError, match="context limit"):
        engine.add_request("over", ids, SamplingParams(max_new_tokens=room + 1))
    with pytest.raises(EngineInputError, match="context limit"):
        engine.add_request("long", [100] * engine.max_context_len, SamplingParams(max_new_tokens=1))
    assert not engine.scheduler.reqs


def test_top_p_min_p_draw_inside_allowed_set(engine: Engine) -> None:
    """On the real (peaked) distribution: each drawn token's rank and probability obey the filter."""
    prompts = [engine.encode_prompt(p, chat=True) for p in ("Tell me a joke.", "Name a colour.", "Say hello.")]
    for kw in ({"top_p": 0.6}, {"min_p": 0.3}):
        sp = SamplingParams(temperature=1.0, max_new_tokens=32, logprobs=20, ignore_eos=True, seed=5, **kw)
        n = 0
        for c in engine.generate(prompts, sp):
            for lp in c.logprobs or []:
                top = lp.top
                ids = [t for t, _ in top]
                if "top_p" in kw:
                    # allowed: the mass of the better tokens is still below p (beyond the top-20, so is theirs)
                    r = ids.index(lp.token_id) if lp.token_id in ids else len(ids)
                    assert sum(math.exp(v) for _, v in top[:r]) < kw["top_p"] + 1e-5
                    assert r < len(ids) or lp.logprob <= top[-1][1]
                else:
                    assert lp.logprob >= math.log(kw["min_p"]) + top[0][1] - 1e-5
                n += 1
        assert n == 96


def test_seeded_sampling_same_alone_and_in_batch(engine: Engine, base) -> None:
    ids, _ = base
    sp = SamplingParams(temperature=0.8, top_k=40, max_new_tokens=20, seed=2024, ignore_eos=True)
    alone = engine.generate([ids], sp)[0].token_ids
    other = engine.encode_prompt("Explain gravity.", chat=True)
    batch = engine.generate([other, ids, ids[:9]], [SamplingParams(temperature=1.0, max_new_tokens=30), sp,
                                                     SamplingParams(temperature=0, max_new_tokens=5)])
    assert batch[1].token_ids == alone


def test_generate_cli_json_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    rc = generate_main(["--prompt", "What is 2+2?", "--prompt", "Name a fruit.", "--chat", "--max-new-tokens", "6",
                        "--max-total-tokens", "512", "--json", "--logprobs", "2", "--threads", "1", "--no-progress"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and len(out) == 2
    rows = [json.loads(x) for x in out]
    for i, r in enumerate(rows):
        # The default config speculates with its 5-step draft (spec stats once a request verified).
        assert r["index"] == i and r["finish_reason"] in ("stop", "length")
        assert r["spec"] is None or len(r["spec"]["accepted_per_depth"]) == 5
        assert len(r["token_ids"]) == r["num_output_tokens"] == len(r["logprobs"]) <= 6
        assert all(len(lp["top"]) == 2 and isinstance(lp["token"], str) for lp in r["logprobs"])
    for argv, msg in [(["--model", "nope", "--prompt", "x"], "unknown model"),
                      (["--prompt", "x", "--top-p", "0"], "top_p"),
                      (["--prompt", ""], "empty"),
                      (["--prompt", "x " * 300, "--max-context-len", "64", "--max-total-tokens", "512"], "context limit")]:
        assert generate_main(argv + ["--no-progress", "--threads", "1"]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
