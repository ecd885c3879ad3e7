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
