"""The OpenAI-compatible API end to end: a real `mleagle serve` (SmolLM2 on the CPU, API key on) driven
by aiohttp and by the official `openai` client. Completions and chat, streamed and not; logprobs, stop
strings, seeds, n>1, the native /generate, /v1/models, /metrics, and a table of bad inputs that each
get the right status and OpenAI error body while a stream keeps being served."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest

from tests.daemon_helpers import ServerProc

KEY = "test-key-123"
MT = 8  # small max_tokens everywhere: CPU decoding is slow on a shared 2-core machine


@pytest.fixture(scope="module")
def srv():
    s = ServerProc("--config", "smollm2-135m", "--max-total-tokens", "8192", "--max-running-requests", "16",
                   "--max-body-bytes", "65536", "--threads", "1", api_key=KEY)
    s.healthy_s = s.wait_healthy(60)
    yield s
    assert s.terminate() == 0, s.log()


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def chat_msgs(q: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": q}]


def test_health_models_and_no_torch(srv, oai):
    st, body = srv.get("/health")
    assert st == 200 and body["status"] == "ok"
    ids = [m.id for m in oai.models.list().data]
    assert ids == ["smollm2-135m"]
    d = srv.engine()
    assert d["daemon"]["torch_loaded"] is False, "the daemon process imported torch"
    assert d["daemon"]["max_rss_mb"] < 200
    assert d["pid"] != d["daemon"]["pid"]


def test_completion_stream_equals_full(oai):
    kw = dict(model="smollm2-135m", prompt="The three primary colors are", max_tokens=MT, temperature=0)
    full = oai.completions.create(**kw)
    c = full.choices[0]
    assert c.finish_reason == "length" and full.usage.completion_tokens == MT
    assert full.usage.prompt_tokens > 0 and full.usage.total_tokens == full.usage.prompt_tokens + MT
    chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == c.text and len(text) > 0
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MT


def test_chat_stream_equals_full(oai):
    kw = dict(model="smollm2-135m", messages=chat_msgs("Name a fruit."), max_tokens=MT, temperature=0)
    full = oai.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == msg.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_logprobs(oai):
    r = oai.completions.create(model="smollm2-135m", prompt="1, 2, 3,", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for _tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(v, abs=1e-5)  # greedy: the chosen token is the best
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    c = oai.chat.completions.create(model="smollm2-135m", messages=chat_msgs("Hi"), max_tokens=5, temperature=0,
                                    logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 and e.bytes for e in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob, abs=1e-5)
    s = list(oai.chat.completions.create(model="smollm2-135m", messages=chat_msgs("Hi"), max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for ch in s if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_stop_strings(oai):
    kw = dict(model="smollm2-135m", prompt="Count: 1, 2, 3,", max_tokens=10, temperature=0)
    text = oai.completions.create(**kw).choices[0].text
    assert len(text) > 8
    stop = text[4:7]  # spans tokens in general: the tokenizer does not cut here
    want = text[: text.index(stop)]
    r = oai.completions.create(**kw, stop=[stop, "never-there"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(oai.completions.create(**kw, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_and_n(oai):
    kw = dict(model="smollm2-135m", prompt="Once upon a time", max_tokens=MT, temperature=1.0)
    a = oai.completions.create(**kw, seed=1234).choices[0].text
    b = oai.completions.create(**kw, seed=1234).choices[0].text
    assert a == b
    assert oai.completions.create(**kw, seed=99).choices[0].text != a
    r = oai.completions.create(**kw, seed=7, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    rc = oai.chat.completions.create(model="smollm2-135m", messages=chat_msgs("Tell me a word."), max_tokens=4,
                                     temperature=0, n=2)
    assert len(rc.choices) == 2 and rc.choices[0].message.content == rc.choices[1].message.content
    streamed = list(oai.chat.completions.create(model="smollm2-135m", messages=chat_msgs("Tell me a word."),
                                                max_tokens=4, temperature=0, n=2, stream=True))
    for i in range(2):
        t = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices and ch.choices[0].index == i)
        assert t == rc.choices[i].message.content


def test_penalties_and_spec_stats_field(srv, oai):
    r = oai.completions.create(model="smollm2-135m", prompt="a a a a a", max_tokens=6, temperature=0,
                               frequency_penalty=1.5, presence_penalty=0.5, extra_body={"repetition_penalty": 1.3,
                                                                                         "spec_stats": True})
    c = r.choices[0].model_dump()
    assert "spec_stats" in c  # None without a draft; the per-request summary with one


def test_prefix_cache_usage_and_metrics(srv, oai):
    """A second turn resending the first hits the prefix cache: OpenAI's usage block reports the cached
    prompt tokens, and /metrics counts prefix-cache queries and hits in tokens (vLLM's names)."""
    m1 = chat_msgs("Name three rivers in Europe.")
    r1 = oai.chat.completions.create(model="smollm2-135m", messages=m1, max_tokens=MT, temperature=0)
    m2 = [*m1, {"role": "assistant", "content": r1.choices[0].message.content}, *chat_msgs("And in Asia?")]
    chunks = list(oai.chat.completions.create(model="smollm2-135m", messages=m2, max_tokens=MT, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    u = chunks[-1].usage
    assert r1.usage.prompt_tokens_details.cached_tokens < r1.usage.prompt_tokens
    # All of the first turn is cached (its draft layers caught up at release) but the last token, and the
    # last S = 5 positions, which a hit recomputes for the default config's 5-step draft (`prefix_margin`).
    assert r1.usage.prompt_tokens + r1.usage.completion_tokens - 1 - 5 <= u.prompt_tokens_details.cached_tokens
    assert u.prompt_tokens_details.cached_tokens < u.prompt_tokens
    st, text = srv.get("/metrics")
    assert st == 200
    vals = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln.startswith("mleagle:prefix_cache_")}
    assert vals["mleagle:prefix_cache_queries_total"] >= r1.usage.prompt_tokens + u.prompt_tokens
    assert vals["mleagle:prefix_cache_hits_total"] >= u.prompt_tokens_details.cached_tokens
    assert 'mleagle:kv_pool_cached_tokens{runner="target"}' in text


async def test_native_generate_and_metrics(srv):
    async with aiohttp.ClientSession(headers=srv.headers) as s:
        async with s.post(srv.url + "/generate", json={"text": "1, 2, 3,", "sampling_params": {
                "max_new_tokens": 8, "temperature": 0, "stop": [" 6"]}}) as r:
            assert r.status == 200
            body = await r.json()
        assert body["meta_info"]["finish_reason"] == "stop" and body["meta_info"]["matched_stop"] == " 6"
        assert " 6" not in body["text"] and body["token_ids"]
        async with s.post(srv.url + "/generate", json={"input_ids": body["token_ids"][:3], "stream": True,
                                                        "sampling_params": {"max_new_tokens": 4, "temperature": 0}}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            events = [ln[6:] for ln in (await r.text()).splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        parts = [json.loads(e) for e in events[:-1]]
        assert sum(len(p["token_ids"]) for p in parts) == 4 and parts[-1]["finished"]
        async with s.get(srv.url + "/metrics") as r:
            text = await r.text()
    for name in ("mleagle:time_to_first_token_seconds_bucket", "mleagle:inter_token_latency_seconds_bucket",
                 "mleagle:e2e_request_latency_seconds_count", "mleagle:num_requests_running",
                 "mleagle:num_requests_waiting", 'mleagle:kv_cache_usage_perc{runner="target"}',
                 "mleagle:spec_decode_num_drafts_total", "mleagle:spec_decode_num_draft_tokens_total",
                 "mleagle:spec_decode_num_accepted_tokens_total", "mleagle:spec_accept_length",
                 'mleagle:request_success_total{finished_reason="stop"', "mleagle:generation_tokens_total",
                 "mleagle:engine_up 1.0"):
        assert name in text, name


BIG = b'{"prompt": "' + b"x" * 70000 + b'"}'
CASES = [
    # (name, method, path, auth, body, status, code or param check)
    ("invalid json", "POST", "/v1/completions", True, b'{"prompt": ', 400, "invalid_json"),
    ("not an object", "POST", "/v1/completions", True, b"[1, 2]", 400, "invalid_json"),
    ("invalid utf-8", "POST", "/v1/completions", True, b'{"prompt": "\xff\xfe"}', 400, "invalid_utf8"),
    ("prompt wrong type", "POST", "/v1/completions", True, b'{"prompt": 12}', 422, "prompt"),
    ("missing prompt", "POST", "/v1/completions", True, b'{"max_tokens": 3}', 422, "prompt"),
    ("max_tokens string", "POST", "/v1/completions", True, b'{"prompt": "a", "max_tokens": "ten"}', 422, "max_tokens"),
    ("stream not bool", "POST", "/v1/completions", True, b'{"prompt": "a", "stream": "yes"}', 422, "stream"),
    ("temperature range", "POST", "/v1/completions", True, b'{"prompt": "a", "temperature": 5}', 422, "temperature"),
    ("top_p zero", "POST", "/v1/completions", True, b'{"prompt": "a", "top_p": 0}', 422, "top_p"),
    ("n zero", "POST", "/v1/completions", True, b'{"prompt": "a", "n": 0}', 422, "n"),
    ("max_tokens zero", "POST", "/v1/completions", True, b'{"prompt": "a", "max_tokens": 0}', 422, "max_tokens"),
    ("logprobs range", "POST", "/v1/completions", True, b'{"prompt": "a", "logprobs": 50}', 422, "logprobs"),
    ("max_tokens > context", "POST", "/v1/completions", True, b'{"prompt": "a", "max_tokens": 100000}', 400,
     "context_length_exceeded"),
    ("token id out of vocab", "POST", "/v1/completions", True, b'{"prompt": [1, 99999999]}', 400, "prompt"),
    ("empty prompt", "POST", "/v1/completions", True, b'{"prompt": ""}', 400, "prompt"),
    ("unknown model", "POST", "/v1/completions", True, b'{"model": "gpt-9", "prompt": "a"}', 404, "model_not_found"),
    ("empty stop string", "POST", "/v1/completions", True, b'{"prompt": "a", "stop": [""]}', 422, "stop"),
    ("n too large", "POST", "/v1/completions", True, b'{"prompt": "a", "n": 1000}', 422, "n"),
    ("logit_bias range", "POST", "/v1/completions", True, b'{"prompt": "a", "logit_bias": {"1": 500}}', 422, "logit_bias"),
    ("empty messages", "POST", "/v1/chat/completions", True, b'{"messages": []}', 422, "messages"),
    ("messages wrong type", "POST", "/v1/chat/completions", True, b'{"messages": "hi"}', 422, "messages"),
    ("bad role", "POST", "/v1/chat/completions", True, b'{"messages": [{"role": "wizard", "content": "x"}]}', 422,
     "messages.0.role"),
    ("top_logprobs range", "POST", "/v1/chat/completions", True,
     b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 30}', 422, "top_logprobs"),
    ("image part", "POST", "/v1/chat/completions", True,
     b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400, "messages"),
    ("generate bad param", "POST", "/generate", True, b'{"text": "a", "sampling_params": {"temperature": -1}}', 422,
     "sampling_params.temperature"),
    ("generate unknown param", "POST", "/generate", True, b'{"text": "a", "sampling_params": {"tempo": 1}}', 422,
     "sampling_params.tempo"),
    ("oversized body", "POST", "/v1/completions", True, BIG, 413, "body_too_large"),
    ("missing api key", "POST", "/v1/completions", False, b'{"prompt": "a"}', 401, "invalid_api_key"),
    ("wrong api key", "POST", "/v1/completions", "wrong", b'{"prompt": "a"}', 401, "invalid_api_key"),
    ("metrics need key", "GET", "/metrics", False, None, 401, "invalid_api_key"),
    ("events need key", "GET", "/v1/events", False, None, 401, "invalid_api_key"),
    ("unknown route", "GET", "/v1/nothing", True, None, 404, "not_found"),
    ("wrong method", "GET", "/v1/completions", True, None, 405, "method_not_allowed"),
]


async def test_bad_inputs_table(srv):
    async with aiohttp.ClientSession() as s:
        # A long stream runs through the whole table: bad requests must not disturb it.
        bg = asyncio.create_task(_stream_text(s, srv, "Write a long story about a dragon.", 16))
        for name, method, path, auth, body, status, check in CASES:
            h = {"Content-Type": "application/json"}
            if auth is True:
                h.update(srv.headers)
            elif isinstance(auth, str):
                h["Authorization"] = f"Bearer {auth}"
            async with s.request(method, srv.url + path, data=body, headers=h) as r:
                raw = await r.read()
                assert r.status == status, (name, r.status, raw[:300])
                err = json.loads(raw)["error"]
                assert set(err) == {"message", "type", "param", "code"}, name
                assert isinstance(err["message"], str) and err["message"] and err["type"], name
                assert check in (err["code"], err["param"]), (name, err)
            async with s.get(srv.url + "/health") as r:  # no key needed, still healthy
                assert r.status == 200, name
        text, finish = await bg
        assert finish == "length" and len(text) > 10
        ok = await _stream_text(s, srv, "Say yes.", 4)
        assert ok[1] == "length"


async def _stream_text(s: aiohttp.ClientSession, srv: ServerProc, q: str, n: int) -> tuple[str, str | None]:
    body = {"messages": chat_msgs(q), "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True}
    text, finish = "", None
    async with s.post(srv.url + "/v1/chat/completions", json=body, headers=srv.headers) as r:
        assert r.status == 200
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ch = json.loads(line[6:])
            for c in ch["choices"]:
                text += c["delta"].get("content") or ""
                finish = c["finish_reason"] or finish
    return text, finish


async def test_ttft_is_split_into_phases_that_add_up_within_what_the_client_saw(srv):
    """Each request's TTFT split by the marks the daemon and the engine stamp (`metrics.TtftPhases`):
    one record per request, every phase non-negative, a prefill that took time, and a total inside the
    TTFT the client measured around it (the client's clock starts before the daemon's first mark and
    stops after its last). /metrics counts them per phase; a bad `phases_since` is a 400."""
    st, d = srv.get("/debug/engine?phases_since=1000000000")
    assert st == 200
    seq0 = d["daemon"]["ttft_phases"]["seq"]
    assert d["daemon"]["ttft_phases"]["recent"] == []
    seen: list[float] = []
    ids: list[str] = []
    async with aiohttp.ClientSession(headers=srv.headers) as s:
        for q in ("Name a color.", "Name a planet.", "Name a bird."):
            t0 = asyncio.get_running_loop().time()
            sent = time.monotonic()
            async with s.post(srv.url + "/v1/chat/completions", json={
                    "model": "smollm2-135m", "messages": chat_msgs(q), "max_tokens": 4, "temperature": 0,
                    "stream": True}) as r:
                assert r.status == 200
                first = None
                async for line in r.content:
                    if first is None and line.startswith(b"data: {") and b'"content"' in line:
                        first = asyncio.get_running_loop().time() - t0
                        got = time.monotonic()
                        ids.append(json.loads(line[6:])["id"])
            seen.append(first)
    st, d = srv.get(f"/debug/engine?phases_since={seq0}")
    ph = d["daemon"]["ttft_phases"]
    assert ph["names"] == ["daemon_in", "to_engine", "queue", "prefill", "engine_out", "to_daemon", "daemon_out",
                           "write"]
    assert [r[0] for r in ph["recent"]] == [seq0 + 1, seq0 + 2, seq0 + 3]
    n = len(ph["names"])
    # Each record names its response and carries the daemon's first and last mark (monotonic, this
    # host's clock): the route began after the client sent and before it read its first token; the
    # last mark is taken just after the frame's write, which the client may read before it (by as
    # long as the daemon waits for a core once its write woke the client: more than the 1 ms this
    # allowed before, on a loaded 2-core machine; the bound says it is this request's mark, this clock).
    assert [rec[1 + n] for rec in ph["recent"]] == ids
    assert all(len(rec) == n + 4 and sent < rec[2 + n] < got and rec[2 + n] < rec[3 + n] < got + 0.1
               for rec in ph["recent"][-1:])
    for rec, client_ttft in zip(ph["recent"], seen):
        parts = rec[1:1 + n]
        assert all(x >= 0 for x in parts), parts
        assert parts[3] > 0, "the prefill took no time"
        assert parts[7] > 0, "a stream's first frame was written in no time"
        # Every mark up to the delta being taken comes before the frame's write, so before the client
        # read it; the last (after the write) can come after the client's read where this process is
        # descheduled between the write and the mark (a loaded 2-core machine: 4 ms once).
        assert sum(parts[:7]) <= client_ttft, (parts, client_ttft)
    st, text = srv.get("/metrics")
    counts = {ln.split('phase="')[1].split('"')[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
              if ln.startswith("mleagle:time_to_first_token_phase_seconds_count")}
    assert set(counts) == set(ph["names"]) and min(counts.values()) >= seq0 + 3
    st, body = srv.get("/debug/engine?phases_since=soon")
    assert st == 400 and body["error"]["param"] == "phases_since"
