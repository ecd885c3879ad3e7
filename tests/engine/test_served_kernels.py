"""scripts/served_kernels.py end to end on the CPU with the embedded SmolLM2 (CPU operators instead of
CUDA kernels: the plumbing, not a figure): the static batch and the offline replay's closed loop both
profiled over the engine's own iterations, and the table and the JSON written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_served_kernels_profiles_the_static_batch_and_the_closed_loop(tmp_path: Path) -> None:
    out = tmp_path / "k.json"
    turns = ["Name a colour.", "Count to three.", "What is a cat?", "Say hello in French."]
    (tmp_path / "mt_bench.jsonl").write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in turns))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "served_kernels.py"), "--config", "smollm2-135m",
                        "--serve-flags", "--draft none --threads 2", "--concurrency", "2", "--requests-per-concurrency",
                        "2", "--warmup", "2", "--max-tokens", "4", "--data-dir", str(tmp_path), "--output", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    st, sv = res["static"], res["served"]
    # The static batch: 2 requests decoding together, 4 tokens each (the first from the prefill).
    assert st["iterations"] >= 3 and st["rows"] == 2 * st["iterations"]
    # The closed loop: 4 requests, at most 2 at a time, each 1 to 4 tokens.
    assert res["served_requests"] == 4 and sv["iterations"] >= 2 and sv["rows"] <= 2 * sv["iterations"]
    for ph in (st, sv):
        assert any("mm" in k and us > 0 for k, us in ph["kernel_us"].items())  # the model's matrix products ran
    assert "| gemm |" in r.stdout and "served - static" in r.stdout
