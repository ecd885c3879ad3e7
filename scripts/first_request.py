"""How the first requests after ready compare with the rest: `python scripts/first_request.py [serve options]`.

Starts `mleagle serve` with the given options on a free port, waits for `/health`, then sends
`--requests` short streamed chat completions one after another (each a different question, greedy,
`--max-tokens` tokens) and records each one's time to first token, read off the SSE stream with the
standard library only (so it runs where the `openai` package is not installed). Prints and writes a
JSON line: every TTFT, the median of all but the first, and the first over that median, the figure the
warm-up before ready is for.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ttft(port: int, question: str, max_tokens: int) -> float:
    body = json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    first = None
    for raw in r:
        line = raw.decode().strip()
        if first is None and line.startswith("data: {"):
            delta = json.loads(line[6:])["choices"][0].get("delta", {})
            if delta.get("content"):
                first = time.perf_counter() - t0
    c.close()
    if first is None:
        raise RuntimeError(f"no content streamed for {question!r} (status {r.status})")
    return first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--out", default=None)
    a, serve = ap.parse_known_args()
    proc = subprocess.Popen([sys.executable, "-m", "mleagle.cli", "serve", "--port", "0", *serve], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    port = 0
    t_start = time.perf_counter()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("mleagle: serving"):
                port = int(line.split(" on ")[1].split()[0].rsplit(":", 1)[1].rstrip("/"))
                break
        if not port:
            raise RuntimeError("the server did not start")
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.perf_counter() - t_start > 600:
                raise RuntimeError("not healthy in 600 s")
            time.sleep(0.1)
        healthy_s = time.perf_counter() - t_start
        times = [ttft(port, f"Say something short about the number {i}.", a.max_tokens) for i in range(a.requests)]
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    rest = statistics.median(times[1:])
    res = {"serve": serve, "healthy_s": round(healthy_s, 2), "ttft_ms": [round(1e3 * t, 2) for t in times],
           "median_rest_ms": round(1e3 * rest, 2), "first_over_median": round(times[0] / rest, 2)}
    print(json.dumps(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
