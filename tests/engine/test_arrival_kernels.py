"""scripts/arrival_kernels.py end to end on the CPU (CPU operators instead of CUDA kernels: the plumbing,
not a figure): both phases profiled over the model's forwards, their time a step positive, and the
JSON and the table written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_arrival_kernels_profiles_both_phases(tmp_path: Path) -> None:
    out = tmp_path / "k.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "arrival_kernels.py"), "--config", "tiny-dummy",
                        "--device", "cpu", "--batch", "4", "--prompt", "12", "--steps", "3", "--output", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["unit"] == "CPU operators" and res["batch"] == 4 and res["steps"] == 3
    alone, mixed = res["alone"], res["with_arrivals"]
    assert alone["us_per_step"] > 0 and mixed["us_per_step"] > 0
    assert res["arrival_us_per_step"] == mixed["us_per_step"] - alone["us_per_step"]
    assert all(k["calls_per_step"] > 0 and k["us_per_step"] > 0 for k in alone["kernels"] + mixed["kernels"])
    # Each phase profiled the model's forwards (a step without them would be a profile of nothing):
    # its matrix products ran at least once a step.
    for ph in (alone, mixed):
        assert any(("linear" in k["name"] or "mm" in k["name"]) and k["calls_per_step"] >= 1 for k in ph["kernels"]), ph
    assert "an arrival adds" in r.stdout and "decoding alone" in r.stdout
