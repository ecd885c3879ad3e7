"""Client side of scripts/docker_smoke.sh: talks to a running mleagle server through the `openai` client.

  wait-healthy URL [--timeout S]            poll /health until 200; print the seconds it took
  greedy URL --key K --out FILE             streamed greedy chat completions of fixed prompts -> JSON
  structured URL --key K --out FILE         greedy chat completions under response_format (json_object,
                                            json_schema): each a JSON object (of the schema) -> JSON
  compare A.json B.json                     the same prompts answered with the same text? (exit 1 if not)
  metrics URL --key K [--min-requests N]    /metrics needs the key and counts the requests served
  drain URL --key K --stop-cmd CMD [--n 8]  N streams in flight, then CMD (e.g. docker stop): all finish?

Exit status 0 when the check holds, 1 when it does not (with the reason on stderr).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
]


def client(url: str, key: str) -> openai.OpenAI:
    # No retries: a failure must show, not be papered over by the client.
    return openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=key, max_retries=0, timeout=300)


def model_id(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


def stream_chat(c: openai.OpenAI, model: str, prompt: str, max_tokens: int, **extra: object) -> dict:
    """One streamed chat completion: its text, finish reason, usage and time to the first chunk."""
    t0 = time.perf_counter()
    ttft = None
    text, finish, usage = [], None, None
    stream = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body=extra or None)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for ch in chunk.choices:
            if ch.delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(ch.delta.content)
            if ch.finish_reason:
                finish = ch.finish_reason
    return {"text": "".join(text), "finish_reason": finish, "completion_tokens": usage,
            "ttft_s": ttft, "total_s": time.perf_counter() - t0}


def cmd_wait_healthy(a: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    last = ""
    while time.perf_counter() - t0 < a.timeout:
        try:
            with urllib.request.urlopen(a.url.rstrip("/") + "/health", timeout=2) as r:
                if r.status == 200:
                    print(f"{time.perf_counter() - t0:.2f}")
                    return 0
        except (urllib.error.URLError, OSError) as e:  # not listening yet, or 503 while the engine starts
            last = str(e)
        time.sleep(0.1)
    print(f"not healthy after {a.timeout:.0f}s (last: {last})", file=sys.stderr)
    return 1


def cmd_greedy(a: argparse.Namespace) -> int:
    c = client(a.url, a.key)
    m = model_id(c)
    out = {"model": m, "max_tokens": a.max_tokens, "answers": {}}
    for p in PROMPTS:
        r = stream_chat(c, m, p, a.max_tokens)
        out["answers"][p] = r
        print(f"  {p!r}: {r['completion_tokens']} tokens, {r['finish_reason']}, {r['total_s']:.1f}s: "
              f"{r['text'][:70]!r}...")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


# Structured output (the engine's xgrammar path): any JSON object, and a JSON schema, greedy. Prompts and
# bounds chosen so that SmolLM2-135M closes its object well inside max_tokens (an unbounded integer or an
# open-ended prompt runs it to the limit, which would be a valid prefix but no JSON document).
CITY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20},
                   "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
    "required": ["name", "country", "population"],
    "additionalProperties": False,
}
STRUCTURED = {
    'json_object: Return a JSON object with the keys "city" and "country" for Paris.': {"type": "json_object"},
    "json_schema city: Describe Paris as JSON.": {
        "type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}},
}


def cmd_structured(a: argparse.Namespace) -> int:
    c = client(a.url, a.key)
    m = model_id(c)
    out = {"model": m, "max_tokens": a.max_tokens, "answers": {}}
    ok = True
    for label, rf in STRUCTURED.items():
        r = stream_chat(c, m, label.split(": ", 1)[1], a.max_tokens, response_format=rf)
        out["answers"][label] = r
        why = ""
        try:
            obj = json.loads(r["text"])
            if not isinstance(obj, dict):
                why = "not a JSON object"
            elif rf["type"] == "json_schema":
                props = CITY_SCHEMA["properties"]
                if set(obj) != set(props) or not isinstance(obj["population"], int) \
                        or not all(isinstance(obj[k], str) and len(obj[k]) <= 20 for k in ("name", "country")):
                    why = "does not follow the schema"
        except ValueError as e:
            why = f"not JSON ({e})"
        if r["finish_reason"] != "stop":
            why = why or f"finish_reason {r['finish_reason']!r}, not 'stop'"
        ok &= not why
        print(f"  {label.split(':')[0]}: {r['completion_tokens']} tokens, {r['finish_reason']}, {r['total_s']:.1f}s: "
              f"{'valid' if not why else 'INVALID: ' + why}: {r['text'][:100]!r}")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0 if ok else 1


def cmd_compare(a: argparse.Namespace) -> int:
    x, y = (json.load(open(p))["answers"] for p in (a.a, a.b))
    keys = list(x)
    bad = [p for p in keys if p not in y or x[p]["text"] != y[p]["text"]
           or x[p]["completion_tokens"] != y[p]["completion_tokens"]]
    for p in keys:
        print(f"  {'equal' if p not in bad else 'DIFFERENT'} ({x[p]['completion_tokens']} tokens): {p!r}")
    if bad:
        for p in bad:
            print(f"{a.a}: {x[p]['text']!r}\n{a.b}: {y.get(p, {}).get('text')!r}", file=sys.stderr)
        return 1
    return 0


def cmd_metrics(a: argparse.Namespace) -> int:
    url = a.url.rstrip("/") + "/metrics"
    try:
        urllib.request.urlopen(url, timeout=10)
        print("/metrics answered without the API key", file=sys.stderr)
        return 1
    except urllib.error.HTTPError as e:
        if e.code != 401:
            print(f"/metrics without the key: {e.code}, expected 401", file=sys.stderr)
            return 1
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {a.key}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read().decode()
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)

    def total(name: str) -> float:  # summed over its labels
        return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))

    n = total("mleagle:e2e_request_latency_seconds_count")
    print(f"  401 without the key; {len(samples)} samples; e2e_request_latency_seconds_count {n:.0f}; "
          f"time_to_first_token_seconds_count {total('mleagle:time_to_first_token_seconds_count'):.0f}; "
          f"generation_tokens_total {total('mleagle:generation_tokens_total'):.0f}")
    if n < a.min_requests:
        print(f"/metrics counts {n:.0f} requests, expected at least {a.min_requests}", file=sys.stderr)
        return 1
    return 0


def cmd_drain(a: argparse.Namespace) -> int:
    c = client(a.url, a.key)
    m = model_id(c)
    results: list[dict | None] = [None] * a.n
    counts = [0] * a.n  # content chunks received so far, per stream
    started = [threading.Event() for _ in range(a.n)]

    def one(i: int) -> None:
        try:
            t0 = time.perf_counter()
            finish, usage = None, None
            # ignore_eos: every stream runs to max_tokens, so all are still going when the stop comes.
            stream = c.chat.completions.create(
                model=m, messages=[{"role": "user", "content": f"Tell me a long story about a lighthouse, #{i}."}],
                max_tokens=a.max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                for ch in chunk.choices:
                    if ch.delta.content:
                        counts[i] += 1
                        started[i].set()
                    if ch.finish_reason:
                        finish = ch.finish_reason
            results[i] = {"finish_reason": finish, "completion_tokens": usage, "chunks": counts[i],
                          "s": round(time.perf_counter() - t0, 1)}
        except Exception as e:  # an error event in the stream, a cut connection: the check fails
            results[i] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            started[i].set()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(a.n)]
    for t in threads:
        t.start()
    for ev in started:
        ev.wait(600)
    t_stop = time.perf_counter()
    print(f"  {a.n} streams in flight (content chunks so far: {counts}, of {a.max_tokens} each); "
          f"running: {a.stop_cmd}", flush=True)
    stopper = subprocess.run(shlex.split(a.stop_cmd), capture_output=True, text=True)
    for t in threads:
        t.join(600)
    print(f"  stop command returned {stopper.returncode} after {time.perf_counter() - t_stop:.1f}s")
    ok = stopper.returncode == 0
    for i, r in enumerate(results):
        good = bool(r) and "error" not in r and r["finish_reason"] == "length" and r["completion_tokens"] == a.max_tokens
        ok &= good
        print(f"  stream {i}: {'finished' if good else 'FAILED'}: {r}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("wait-healthy")
    p.add_argument("url")
    p.add_argument("--timeout", type=float, default=300)
    p = sub.add_parser("greedy")
    p.add_argument("url")
    p.add_argument("--key", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p = sub.add_parser("structured")
    p.add_argument("url")
    p.add_argument("--key", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    p = sub.add_parser("metrics")
    p.add_argument("url")
    p.add_argument("--key", required=True)
    p.add_argument("--min-requests", type=int, default=1)
    p = sub.add_parser("drain")
    p.add_argument("url")
    p.add_argument("--key", required=True)
    p.add_argument("--stop-cmd", required=True)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    a = ap.parse_args()
    return {"wait-healthy": cmd_wait_healthy, "greedy": cmd_greedy, "structured": cmd_structured, "compare": cmd_compare,
            "metrics": cmd_metrics, "drain": cmd_drain}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
