"""Fast daemon checks without a server: the wire protocol round-trips and refuses anything else, the
daemon's modules never pull in torch, text assembly is chunking-independent (multi-byte characters,
stop strings across tokens) on the real SmolLM2 tokenizer, and errors map to OpenAI bodies."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from pydantic import ValidationError

from mleagle.daemon.detok import TextAssembler
from mleagle.daemon.errors import from_validation
from mleagle.daemon.openai_api import ChatRequest, CompletionRequest, to_sampling_params
from mleagle.engine.contract.config import load_config
from mleagle.engine.contract.outputs import RequestOutput, TokenLogprob
from mleagle.engine.contract.protocol import (
    AbortRequest,
    AddRequest,
    Outputs,
    Ping,
    Pong,
    Ready,
    RequestError,
    Shutdown,
    decode_daemon_msg,
    decode_engine_msg,
    encode,
)
from mleagle.engine.contract.sampling_params import SamplingParams


def test_protocol_round_trip():
    msgs = [AddRequest(rid="a", prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=3, stop=["x"])),
            AbortRequest(rid="a"), Ping(seq=3), Shutdown()]
    for m in msgs:
        assert decode_daemon_msg(encode(m)) == m
    outs = [Ready(model_name="m", max_context_len=16, pid=1),
            Outputs(outputs=[RequestOutput(rid="a", token_ids=[5], logprobs=[TokenLogprob(token_id=5, logprob=-0.5,
                                                                                        top=[(5, -0.5), (7, -1.0)])])]),
            RequestError(rid="a", message="too long"), Pong(seq=1, pool_usage=[{"runner": "target", "kv_used": 0}])]
    for m in outs:
        assert decode_engine_msg(encode(m)) == m
    assert json.loads(encode(Shutdown())) == {"type": "shutdown"}  # plain JSON on the wire
    # A step's deltas: one that is new tokens only travels as an array, the others whole; nothing is lost.
    deltas = [RequestOutput(rid="r", token_ids=[5, 6], num_prompt_tokens=3, num_output_tokens=9, num_cached_tokens=2),
              RequestOutput(rid="l", token_ids=[5], logprobs=[TokenLogprob(token_id=5, logprob=-0.5)]),
              RequestOutput(rid="p", token_ids=[], prompt_logprobs=[None, TokenLogprob(token_id=1, logprob=-1.0)]),
              RequestOutput(rid="f", token_ids=[7], finished=True, finish_reason="stop", matched_stop="x")]
    wire = json.loads(encode(Outputs.of(deltas)))
    assert wire["tokens"] == [["r", [5, 6], 3, 9, 2]] and [o["rid"] for o in wire["outputs"]] == ["l", "p", "f"]
    m = decode_engine_msg(encode(Outputs.of(deltas)))
    assert m.outputs == deltas[1:]
    assert [RequestOutput(rid=r, token_ids=t, num_prompt_tokens=p, num_output_tokens=n, num_cached_tokens=c)
            for r, t, p, n, c in m.tokens] == deltas[:1]


@pytest.mark.parametrize("data", [b"", b"not json", b"[]", b'{"type": "exec", "code": "1"}',
                                  b'{"type": "add", "rid": "a"}', b'{"type": "abort", "rid": "a", "x": 1}',
                                  b"\x80\x04\x95"])  # the last: a pickle header
def test_protocol_refuses_garbage(data):
    with pytest.raises(ValueError):
        decode_daemon_msg(data)


def test_daemon_never_imports_torch():
    code = (
        "import sys, asyncio\n"
        "from mleagle.daemon import cli, server, lifecycle, bench_serve, events_relay\n"
        "from mleagle.engine.contract.config import load_config\n"
        "app = server.create_app(load_config('smollm2-135m'), start_engine=False)\n"
        "async def go():\n"
        "    from aiohttp import web\n"
        "    r = web.AppRunner(app); await r.setup(); await r.cleanup()\n"
        "asyncio.run(go())\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.fixture(scope="module")
def tok():
    from mleagle.engine.contract.tokenizer import Tokenizer

    return Tokenizer.from_source(load_config("smollm2-135m").model)


def assemble(tok, ids, stops, rng):
    a = TextAssembler(tok, [], stops, True)
    parts, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        parts.append(a.push(ids[i : i + n]))
        i += n
    parts.append(a.finish())
    return parts, a


def test_streamed_text_is_chunking_independent(tok):
    text = "Héllo wörld — 日本語のテキスト 🎉🎉 done. Stop here: END and after"
    ids = tok.encode(text)
    rng = random.Random(0)
    for stops in ([], ["END"], ["ere: E", "zzz"], ["🎉"]):
        results = set()
        for _ in range(20):
            parts, a = assemble(tok, ids, stops, rng)
            assert all("\ufffd" not in p for p in parts)  # never half a character
            joined = "".join(parts)
            assert joined == a.text
            results.add(joined)
        assert len(results) == 1
        want = text
        for s in stops:
            if s in want:
                want = want[: want.index(s)]
        assert results.pop() == want
    # a byte-level token that splits a character is held until the character completes
    emoji = tok.encode("🎉")
    assert len(emoji) > 1
    a = TextAssembler(tok, [], [], True)
    assert a.push(emoji[:1]) == "" and a.push(emoji[1:]) == "🎉"


def test_byte_level_text_is_the_incremental_detokenizers(tok):
    """`ByteLevelText` (the daemon's detokenizer for a byte-level tokenizer) against the engine's
    `IncrementalDetokenizer` on random token runs (characters split over tokens, special tokens, both
    skip settings, random pushes): after each push it has sent at least as much and never half a
    character, and in the end exactly the same text, the tokenizer's decode of the whole run."""
    from mleagle.daemon.detok import ByteLevelText, byte_level
    from mleagle.engine.contract.detokenizer import IncrementalDetokenizer

    assert byte_level(tok)
    rng = random.Random(1)
    words = tok.encode("Héllo wörld — 日本語のテキスト 🎉 😀👍🏽 and plain words")
    specials = [i for i in range(tok.vocab_size) if tok.is_special(i)]
    for _ in range(500):
        ids = [rng.choice([rng.randrange(tok.vocab_size), rng.choice(words), rng.choice(specials), rng.randrange(260)])
               for _ in range(rng.randint(1, 30))]
        for skip in (False, True):
            ref, fast, a, b, i = IncrementalDetokenizer(tok, [1, 2], skip), ByteLevelText(tok, skip), "", "", 0
            while i < len(ids):
                n = rng.randint(1, 4)
                a, b = a + ref.push(ids[i : i + n]), b + fast.push(ids[i : i + n])
                assert b.startswith(a) and not b.endswith("\ufffd"), (ids, skip)
                i += n
            assert a + ref.flush() == b + fast.flush() == tok.decode(ids, skip_special_tokens=skip), (ids, skip)


def test_a_stream_that_fell_behind_gets_its_deltas_coalesced(tok):
    """Outputs that waited in a generation's queue come out as one delta per choice, with the same
    text and tokens as one by one; an error after them comes after what arrived before it."""
    import asyncio

    from mleagle.daemon.errors import APIError
    from mleagle.daemon.generation import Generation
    from mleagle.daemon.metrics import Metrics

    ids = tok.encode("Héllo wörld — 日本語のテキスト 🎉 and more words after it")

    async def go(error: bool) -> list[tuple[int, str, list[int], bool]]:
        g = Generation(None, Metrics("m"), tok)  # type: ignore[arg-type]  # nothing is submitted here
        for _ in range(2):
            g.add([], SamplingParams(max_new_tokens=64))
        for i in range(0, len(ids), 2):  # the engine stepped on while the route was busy: all waiting
            for c in g.choices:
                last = i + 2 >= len(ids)
                g.sink.put_nowait((c.index, RequestOutput(rid=c.rid, token_ids=ids[i : i + 2], finished=last and not error,
                                                          finish_reason="length" if last and not error else None)))
        if error:
            g.sink.put_nowait((1, APIError(503, "gone", code="engine_dead")))
        out = []
        try:
            async for d in g.deltas():
                out.append((d.choice.index, d.text, d.token_ids, d.finished))
        except APIError as e:
            out.append((-1, e.message, [], True))
        return out

    got = asyncio.run(go(False))
    assert [(i, t, f) for i, t, _, f in got] == [(0, tok.decode(ids), True), (1, tok.decode(ids), True)]
    assert got[0][2] == ids == got[1][2]
    got = asyncio.run(go(True))
    assert [i for i, *_ in got] == [0, 1, -1] and got[1][1] == tok.decode(ids)[: len(got[1][1])] and got[-1][1] == "gone"


def test_request_mapping_and_validation():
    r = CompletionRequest.model_validate({"prompt": "a", "n": 2, "seed": 5, "stop": "x", "logprobs": 2,
                                          "temperature": 0.5, "top_k": 3, "max_tokens": 9})
    p0, p1 = to_sampling_params(r, 9, 0), to_sampling_params(r, 9, 1)
    assert (p0.seed, p1.seed) == (5, 6) and p0.stop == ["x"] and p0.logprobs == 2 and p0.top_k == 3
    c = ChatRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                    "logprobs": True, "top_logprobs": 3})
    assert c.messages_dicts() == [{"role": "user", "content": "hi"}] and to_sampling_params(c, 4, 0).logprobs == 3
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": ["a", 1]})
    err = from_validation(e.value)
    assert err.status == 422 and err.param == "prompt" and err.body()["error"]["type"] == "invalid_request_error"


def test_body_parsing_refuses_hostile_json_with_the_param():
    from mleagle.daemon.body import HUGE, MAX_DEPTH, parse_json
    from mleagle.daemon.errors import APIError

    def err(raw: bytes) -> APIError:
        with pytest.raises(APIError) as e:
            parse_json(raw)
        return e.value

    e = err(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert (e.status, e.code) == (400, "json_too_deep")
    e = err(b'{"tools": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}")
    assert (e.status, e.code, e.param) == (400, "json_too_deep", "tools")
    assert parse_json(b'{"tools": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}")
    e = err(b'{"messages": [{"content": "ok"}, {"content": "x\\ud800"}]}')
    assert (e.status, e.code, e.param) == (400, "invalid_unicode", "messages.1.content")
    assert parse_json('{"a": "\\ud83d\\ude00 é"}'.encode()) == {"a": "😀 é"}  # a valid pair is fine
    for raw in (b'{"t": NaN}', b'{"t": Infinity}', b'{"t": -Infinity}'):
        assert err(raw).code == "invalid_json"
    assert parse_json(b'{"n": ' + b"7" * 5000 + b', "m": -' + b"1" * 65 + b', "k": 12}') == {"n": HUGE, "m": -HUGE, "k": 12}
    assert parse_json(b'{"x": 1e999}')["x"] == float("inf")  # finite-only fields refuse it, with their name
    assert err(b"[1]").code == "invalid_json" and err(b"\xff").code == "invalid_utf8"


def test_sampling_params_are_strict_and_safe():
    from mleagle.engine.contract.sampling_params import GREEDY_TEMPERATURE

    for t in (1e-38, 5e-324, GREEDY_TEMPERATURE / 2, 0):
        assert SamplingParams(temperature=t).temperature == 0.0 and SamplingParams(temperature=t).greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE).temperature == GREEDY_TEMPERATURE
    bad = [{"temperature": "0.5"}, {"temperature": True}, {"temperature": float("nan")}, {"top_p": float("inf")},
           {"repetition_penalty": 5e-324}, {"repetition_penalty": 11.0}, {"top_k": 2**31}, {"max_new_tokens": 4.0},
           {"stop_token_ids": [-1]}, {"stop_token_ids": [2**31]}, {"ignore_eos": "yes"}, {"seed": 2**63}]
    for kw in bad:
        with pytest.raises(ValidationError):
            SamplingParams.model_validate(kw)
    # the wire protocol still round-trips (JSON numbers stay numbers)
    p = SamplingParams(temperature=0.7, top_p=0.9, stop=["x"], stop_token_ids=[5], seed=3)
    assert decode_daemon_msg(encode(AddRequest(rid="r", prompt_ids=[1], params=p))).params == p


def test_config_for_engine_has_no_secret():
    from mleagle.engine.contract.config import MleagleConfig

    cfg = load_config("tiny-dummy").model_copy(deep=True)
    cfg = MleagleConfig.model_validate({**cfg.model_dump(), "server": {"api_key": "s3cret-key"}})
    assert cfg.server.key() == "s3cret-key"
    assert "s3cret-key" not in cfg.model_dump_json() and "s3cret-key" not in repr(cfg)
    out = cfg.for_engine()
    assert "s3cret-key" not in out and "api_key" not in out
    assert MleagleConfig.model_validate_json(out).server.api_key is None


def test_token_series_scrape_as_prometheus_client_histogram_and_counter():
    """`TokenSeries` (observed per streamed token) lists the same lines as prometheus_client's
    Histogram and Counter fed the same observations (its sum adds `itl * n`, so only float rounding
    may differ there)."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from mleagle.daemon.metrics import LAT_BUCKETS, P, TokenSeries

    ref = CollectorRegistry()
    h = Histogram(P + "inter_token_latency_seconds", "Latency per output token after the first", ["model_name"],
                  buckets=LAT_BUCKETS, registry=ref).labels("m")
    c = Counter(P + "generation_tokens", "Generated tokens", ["model_name"], registry=ref).labels("m")
    mine = CollectorRegistry()
    t = TokenSeries("m")
    mine.register(t)
    rng = random.Random(0)
    for itl in [None, 0.005, 0.0049, 0.0, 80.0, 100.0, None] + [rng.expovariate(100) for _ in range(500)]:
        n = rng.randint(1, 3)
        for _ in range(n if itl is not None else 0):
            h.observe(itl)
        c.inc(n)
        t.observe(n, itl)
    a, b = generate_latest(ref).decode().splitlines(), generate_latest(mine).decode().splitlines()
    assert len(a) == len(b) > 20
    for x, y in zip(a, b):
        if "_sum{" in x:
            name, v = x.rsplit(" ", 1)
            assert y.startswith(name + " ") and float(y.rsplit(" ", 1)[1]) == pytest.approx(float(v))
        else:
            assert x == y
