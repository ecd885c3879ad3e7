"""scripts/daemon_alone.py end to end: the daemon's real app and a scripted engine process on the real
engine channel, `bench serve` as the client; the report is what the clients got against what the
engine sent, with the daemon's TTFT split."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_daemon_alone_streams_what_the_scripted_engine_sends(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, data = tmp_path / "alone.json", tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"turns": [f"Tell me about the number {i}."]}) + "\n" for i in range(16)))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "daemon_alone.py"), "--dataset", str(data),
                        "--step-ms", "4", "--concurrency", "4",
                        "--repeats", "1", "--max-tokens", "16", "--port", str(port), "--output", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    (run,) = res["runs"]
    assert run["failed"] == 0 and run["concurrency"] == 4 and run["engine_tok_s"] == pytest.approx(1000)
    # A step every 4 ms for 4 streams: the clients get most of the 1,000 tokens a second (a request's
    # slot is idle from its end to the next one's first token), never more.
    assert 0.3 < run["kept_up"] <= 1.05, run
    assert run["tokens_per_chunk"] >= 1 and isinstance(run["coalesced"], int)
    # The scripted engine stamps the first delta: the split has every phase, its prefill is nothing.
    ph = run["ttft_phases"]
    assert set(ph) >= {"daemon_in", "to_engine", "to_daemon", "daemon_out", "write", "total"}
    assert ph["prefill"]["mean_ms"] == 0 and ph["daemon_in"]["mean_ms"] > 0
    assert "kept up" in r.stdout and res["table"][0]["output_tok_s"]["median"] == pytest.approx(run["output_tok_s"])
