"""Structured output through the official `openai` client against a real `mleagle serve` (SmolLM2 on the
CPU): JSON schemas whose outputs all parse and validate (`jsonschema`), regex and choice outputs that
match, greedy constrained output with the shipped draft equal to `--draft none`, `logit_bias` banning
and forcing tokens, forced tool calls returned as OpenAI `tool_calls`, and bad constraints refused with
a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from mleagle.engine.contract.config import load_config
from mleagle.engine.contract.tokenizer import Tokenizer
from tests.daemon_helpers import ServerProc

KEY = "k-structured"
DRAFT = "drafts/smollm2-135m-mtp3"

# Nested objects, arrays, enums, required fields, numbers with bounds; strings and arrays are bounded
# so that sampled outputs finish within the token budget (a JSON cut by `length` cannot validate).
SCHEMAS: list[tuple[str, dict]] = [
    ("Describe a person.", {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}),
    ("Give a product with a price.", {"type": "object", "properties": {
        "product": {"type": "string", "maxLength": 16},
        "price": {"type": "number", "minimum": 0, "maximum": 1000}}, "required": ["product", "price"]}),
    ("What is the weather like?", {"type": "object", "properties": {
        "sky": {"enum": ["sunny", "cloudy", "rainy"]},
        "temperature_c": {"type": "integer", "minimum": -40, "maximum": 50}}, "required": ["sky", "temperature_c"]}),
    ("List some colors.", {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]},
                   "minItems": 1, "maxItems": 4}}, "required": ["colors"]}),
    ("Describe a book.", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 20},
        "author": {"type": "object", "properties": {
            "first": {"type": "string", "maxLength": 12}, "last": {"type": "string", "maxLength": 12}},
            "required": ["first", "last"]},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2030}}, "required": ["title", "author", "year"]}),
    ("Give a point on a map.", {"type": "object", "properties": {
        "lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "minimum": -180, "maximum": 180}}, "required": ["lat", "lon"]}),
    ("Is this statement true: the sun is hot?", {"type": "object", "properties": {
        "answer": {"type": "boolean"}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["answer", "confidence"]}),
    ("Give three scores.", {"type": "object", "properties": {
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10},
                   "minItems": 3, "maxItems": 3}}, "required": ["scores"]}),
    ("Describe a team.", {"type": "object", "properties": {
        "team": {"type": "string", "maxLength": 16},
        "members": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 10}, "role": {"enum": ["lead", "dev", "qa"]}},
            "required": ["name", "role"]}}}, "required": ["team", "members"]}),
    ("Give an order status.", {"type": "object", "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "items": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 10}}},
        "required": ["order_id", "status", "items"]}),
]
N_PER_SCHEMA = 5  # 10 schemas x 5 sampled outputs = 50


def _serve(draft: str) -> ServerProc:
    s = ServerProc("--config", "smollm2-135m", "--max-total-tokens", "16384", "--max-running-requests", "64",
                   "--threads", "1", "--draft", draft, api_key=KEY)
    s.wait_healthy(60)
    return s


@pytest.fixture(scope="module")
def srv():
    s = _serve("none")
    yield s
    assert s.terminate() == 0, s.log()


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def msgs(q: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": q}]


def test_json_schemas_all_validate(srv):
    """50 sampled outputs over the schema set: every one finishes, parses and validates."""
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=600)

    async def one(i: int, q: str, schema: dict) -> list[tuple[str, str]]:
        r = await client.chat.completions.create(
            model="smollm2-135m", messages=msgs(q), max_tokens=160, temperature=0.8, seed=100 + i, n=N_PER_SCHEMA,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        return [(c.message.content, c.finish_reason) for c in r.choices]

    async def main() -> list[list[tuple[str, str]]]:
        try:
            return await asyncio.gather(*(one(i, q, sc) for i, (q, sc) in enumerate(SCHEMAS)))
        finally:
            await client.close()

    results = asyncio.run(main())
    n = 0
    for (_, schema), outs in zip(SCHEMAS, results):
        assert len({o for o, _ in outs}) > 1, outs  # sampled: not one output five times
        for text, finish in outs:
            assert finish == "stop", (text, finish)
            jsonschema.validate(json.loads(text), schema)
            n += 1
    assert n == 50


def test_json_object_and_structured_outputs_json(oai):
    r = oai.chat.completions.create(model="smollm2-135m", messages=msgs("Give me a JSON object about a cat."),
                                    max_tokens=120, temperature=0, response_format={"type": "json_object"})
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:  # cut by the budget: still a JSON object's beginning
        assert c.message.content.startswith("{")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = oai.completions.create(model="smollm2-135m", prompt="Answer in JSON:", max_tokens=20, temperature=0,
                               extra_body={"structured_outputs": {"json": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_openai_parse_with_a_pydantic_model(oai):
    """The client's own structured-output path: a pydantic model sent as a strict json_schema, parsed back."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population: int = Field(ge=0, le=50_000_000)

    r = oai.chat.completions.parse(model="smollm2-135m", messages=msgs("Describe Paris."), max_tokens=80,
                                   temperature=0, response_format=City)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and r.choices[0].finish_reason == "stop"


def test_regex_and_choice(oai):
    rx = r"\(\d{3}\) \d{3}-\d{4}"
    for body in ({"guided_regex": rx}, {"structured_outputs": {"regex": rx}}):
        r = oai.chat.completions.create(model="smollm2-135m", messages=msgs("Give me a phone number."), max_tokens=24,
                                        temperature=0.7, seed=3, extra_body=body)
        assert r.choices[0].finish_reason == "stop" and re.fullmatch(rx, r.choices[0].message.content), r
    options = ["Paris", "London", "Rome", "New York City"]
    for body in ({"guided_choice": options}, {"structured_outputs": {"choice": options}}):
        r = oai.chat.completions.create(model="smollm2-135m", messages=msgs("Which city is in Italy?"), max_tokens=8,
                                        temperature=0, n=3, extra_body=body)
        assert all(c.message.content in options and c.finish_reason == "stop" for c in r.choices), r
    g = 'root ::= "The answer is " ("yes" | "no") "."'
    r = oai.completions.create(model="smollm2-135m", prompt="Is water wet?", max_tokens=12, temperature=0,
                               extra_body={"guided_grammar": g})
    assert r.choices[0].text in ("The answer is yes.", "The answer is no."), r


def _greedy_requests() -> list[tuple[str, dict]]:
    schema = SCHEMAS[4][1]
    return [
        ("Describe a book.", {"response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": schema}}}),
        ("Describe a team.", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "t", "schema": SCHEMAS[8][1]}}}),
        ("Give me a JSON object about a dog.", {"response_format": {"type": "json_object"}}),
        ("Give me a phone number.", {"extra_body": {"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"}}),
        ("Name an animal.", {"extra_body": {"guided_choice": ["cat", "dog", "horse", "elephant"]}}),
        ("Tell me about the moon.", {}),  # unconstrained, in the same batch
    ]


def _run_greedy(url: str) -> list[tuple[str, str]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)

    async def one(q: str, kw: dict) -> tuple[str, str]:
        kw = dict(kw)
        r = await client.chat.completions.create(model="smollm2-135m", messages=msgs(q), max_tokens=64, temperature=0,
                                                 **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason

    async def main() -> list[tuple[str, str]]:
        try:
            return await asyncio.gather(*(one(q, kw) for q, kw in _greedy_requests()))
        finally:
            await client.close()

    return asyncio.run(main())


def test_greedy_constrained_equal_with_shipped_draft(srv):
    """Constrained greedy output with the shipped draft equals target-only, in a mixed batch."""
    ref = _run_greedy(srv.url)
    d = _serve(DRAFT)
    try:
        got = _run_greedy(d.url)
        r = openai.OpenAI(base_url=d.url + "/v1", api_key=KEY, max_retries=0, timeout=300).chat.completions.create(
            model="smollm2-135m", messages=msgs(SCHEMAS[8][0]), max_tokens=160, temperature=0.8, seed=7, n=4,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMAS[8][1]}})
        sampled = [(c.message.content, c.finish_reason) for c in r.choices]
        st, m = d.get("/metrics")
        assert st == 200
    finally:
        assert d.terminate() == 0, d.log()
    assert got == ref
    # Sampled constrained outputs with the draft (rejection sampling over masked distributions, a
    # reduced draft vocabulary) validate too.
    for text, finish in sampled:
        assert finish == "stop", (text, finish)
        jsonschema.validate(json.loads(text), SCHEMAS[8][1])
    accepted = re.search(r"^mleagle:spec_decode_num_accepted_tokens_total\S* (\S+)$", m, re.M)
    assert accepted is not None and float(accepted.group(1)) > 0  # the draft did propose accepted tokens
    jsonschema.validate(json.loads(ref[0][0]), SCHEMAS[4][1])
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", ref[3][0]) and ref[4][0] in ("cat", "dog", "horse", "elephant")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer.from_source(load_config("smollm2-135m").model)
    assert t is not None
    return t


def test_logit_bias_bans_and_forces(oai, tok):
    kw = dict(model="smollm2-135m", prompt="The capital of France is", max_tokens=6, temperature=0)
    free = oai.completions.create(**kw).choices[0].text
    first = tok.encode(free)[0]
    banned = oai.completions.create(**kw, logit_bias={str(first): -100}).choices[0].text
    assert first not in tok.encode(banned) and banned != free
    force = tok.encode(" banana")
    assert len(force) == 1
    forced = oai.completions.create(**kw, logit_bias={str(force[0]): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == " banana" * 6


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                                       "required": ["zone"]}}}


def test_forced_tool_calls(oai):
    q = msgs("What is the weather in Paris?")
    r = oai.chat.completions.create(model="smollm2-135m", messages=q, max_tokens=60, temperature=0, tools=[WEATHER, TIME],
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    r = oai.chat.completions.create(model="smollm2-135m", messages=msgs("What time is it in London?"), max_tokens=80,
                                    temperature=0, tools=[WEATHER, TIME], tool_choice="required")
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
        spec = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
    r = oai.chat.completions.create(model="smollm2-135m", messages=msgs("Weather in Rome and the time in Tokyo?"),
                                    max_tokens=80, temperature=0.9, seed=1, tools=[WEATHER, TIME],
                                    tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    # Streamed: the call arrives as one tool_calls delta, then the finish reason.
    chunks = list(oai.chat.completions.create(model="smollm2-135m", messages=q, max_tokens=60, temperature=0,
                                              tools=[WEATHER], stream=True,
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [ch.choices[0].delta.tool_calls for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0][0].function.name == "get_weather"
    json.loads(deltas[0][0].function.arguments)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


@pytest.mark.parametrize("body,path,status,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "/v1/chat/completions", 400, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "/v1/chat/completions", 400,
     "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "/v1/chat/completions", 400, "response_format.type"),
    ({"guided_json": "{not json"}, "/v1/completions", 400, "guided_json"),
    ({"guided_regex": "a("}, "/v1/completions", 400, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "/v1/chat/completions", 400,
     "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "/v1/chat/completions", 400, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "/v1/chat/completions", 400, "guided_regex"),
    ({"guided_choice": []}, "/v1/completions", 400, "guided_choice"),
    ({"tools": [WEATHER]}, "/v1/chat/completions", 400, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "/v1/chat/completions", 400, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "/v1/chat/completions",
     400, "tool_choice"),
    ({"logit_bias": {"99999999": 1}}, "/v1/completions", 400, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "/v1/completions", 422, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "/v1/completions", 422, "logit_bias"),
    ({"guided_regex": "a", "min_tokens": 2}, "/v1/completions", 400, "min_tokens"),
])
def test_bad_constraints_refused(srv, oai, body, path, status, param):
    import urllib.error
    import urllib.request

    base = {"messages": msgs("hi")} if path.endswith("chat/completions") else {"prompt": "hi"}
    req = urllib.request.Request(srv.url + path, data=json.dumps({**base, "max_tokens": 4, **body}).encode(),
                                 headers={**srv.headers, "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=60)
    err = json.loads(ei.value.read())["error"]
    assert ei.value.code == status and err["param"] == param, err


def test_generate_sampling_params(srv):
    """The native route takes the engine's SamplingParams as they are, constraints included."""
    import urllib.error
    import urllib.request

    def post(sp: dict) -> tuple[int, dict]:
        req = urllib.request.Request(srv.url + "/generate", data=json.dumps({"text": "Pick:", "sampling_params": sp}).encode(),
                                     headers={**srv.headers, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    st, out = post({"max_new_tokens": 8, "temperature": 0, "structured_outputs": {"choice": ["alpha", "beta"]}})
    assert st == 200 and out["text"] in ("alpha", "beta") and out["meta_info"]["finish_reason"] == "stop"
    st, out = post({"max_new_tokens": 8, "structured_outputs": {"regex": "(x"}})
    assert st == 400 and out["error"]["param"] == "sampling_params.structured_outputs.regex"
    st, out = post({"max_new_tokens": 8, "min_new_tokens": 2, "structured_outputs": {"regex": "a+"}})
    assert st == 400 and out["error"]["param"] == "sampling_params.min_new_tokens"
    assert out["error"]["message"].startswith("sampling_params.min_new_tokens: ")
    st, out = post({"max_new_tokens": 8, "logit_bias": {"5": 101}})
    assert st == 422 and out["error"]["param"].startswith("sampling_params.logit_bias")
