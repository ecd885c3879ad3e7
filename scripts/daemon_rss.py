"""The daemon's resident memory, idle and under streaming load (the README's figure comes from here).

Starts `mleagle serve` (default: SmolLM2 on the CPU, one thread, an API key), samples the daemon
process's VmRSS from /proc every 0.2 s, and records it once the engine is ready (idle: the daemon with
the tokenizer loaded), during `mleagle bench serve` runs of streaming chat requests at a fixed
concurrency, and after them; the peak is the kernel's VmHWM. Prints a table and writes JSON.

    python scripts/daemon_rss.py --out results/daemon_rss.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="bench serve runs, one after another")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    key = "daemon-rss-key"
    cmd = [sys.executable, "-m", "mleagle.cli", "serve", "--config", a.config, "--port", "0", "--threads",
           str(a.threads), "--max-running-requests", str(a.concurrency)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "MLEAGLE_API_KEY": key, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    url = ""
    for line in proc.stdout:
        if line.startswith("mleagle: serving"):
            url = line.split(" on ")[1].split()[0]
            break
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    samples: list[tuple[float, str, int]] = []
    phase = ["starting"]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            try:
                samples.append((time.monotonic(), phase[0], status_kb(proc.pid, "VmRSS")))
            except (OSError, KeyError):
                return

    try:
        t0 = time.monotonic()
        while True:
            try:
                req = urllib.request.Request(url + "/health")
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - t0 > 300 or proc.poll() is not None:
                raise RuntimeError("the server did not become healthy")
            time.sleep(0.2)
        threading.Thread(target=sample, daemon=True).start()
        phase[0] = "idle"
        time.sleep(3)
        runs = []
        for i in range(a.rounds):
            phase[0] = "load"
            out = ROOT / f".daemon_rss_bench_{i}.json"
            subprocess.run([sys.executable, "-m", "mleagle.cli", "bench", "serve", "--url", url, "--api-key", key,
                            "--dataset", "mt_bench", "--num-prompts", str(a.num_prompts), "--concurrency",
                            str(a.concurrency), "--max-tokens", str(a.max_tokens), "--seed", str(i), "--output",
                            str(out)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            runs.append(json.loads(out.read_text()))
            out.unlink()
        phase[0] = "after"
        time.sleep(3)
        hwm = status_kb(proc.pid, "VmHWM")
    finally:
        stop.set()
        proc.terminate()
        proc.wait(60)

    def mb(phase_name: str) -> list[float]:
        return [kb / 1024 for _, p, kb in samples if p == phase_name]

    res: dict[str, Any] = {"command": ["python", *cmd[1:]], "rounds": a.rounds, "num_prompts": a.num_prompts,
                           "concurrency": a.concurrency, "max_tokens": a.max_tokens,
                           "requests_ok": sum(r.get("completed", 0) for r in runs), "peak_rss_mb": round(hwm / 1024, 1)}
    print("| phase | samples | RSS min MB | median | max |\n|---|---:|---:|---:|---:|")
    for ph in ("idle", "load", "after"):
        v = mb(ph)
        res[ph] = {"samples": len(v), "min_mb": round(min(v), 1), "median_mb": round(statistics.median(v), 1),
                   "max_mb": round(max(v), 1)}
        print(f"| {ph} | {len(v)} | {min(v):.0f} | {statistics.median(v):.0f} | {max(v):.0f} |")
    print(f"peak (VmHWM) {hwm / 1024:.0f} MB; requests completed {res['requests_ok']}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
