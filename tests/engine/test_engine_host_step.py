"""scripts/engine_host_step.py end to end on the CPU: a decode step's host time beside the forward, the
step's message and state events apart, a lone arrival's prefill, each a positive figure per repeat, and
an arrival's cost to a running batch (the script wraps `ModelRunner.forward`, `Engine.step` and the
prefill step's parts; a rename there must not leave it measuring nothing)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_engine_host_step_splits_a_step_into_forward_and_host(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "engine_host_step.py"), "--batch-sizes", "4",
                        "--repeats", "2", "--prefills", "5", "--events", "--cache", "full", "--pool-tokens", "4096",
                        "--arrivals", "5", "--output", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert row["batch"] == 4 and len(row["runs"]) == 2 and res["events"] is True
    for run in row["runs"]:
        # Every request decodes 64-256 tokens: as many decode steps, each with a forward and host work.
        assert 63 <= run["decode_steps"] <= 256 and 0 < run["mean_rows"] <= 4
        assert run["forward_us"] > 0 and run["host_us"] > 0 and run["message_us"] > 0 and run["events_us"] > 0
    pre = res["prefill_one"]
    assert len(pre["runs"]) == 2 and pre["host_us"]["median"] > 0 and pre["forward_us"]["median"] > 0
    # `--cache full`: the pool was filled with cached prompts first, so the arrivals evicted.
    assert 4000 < res["pool_tokens"] <= 4096 and all(run["cached_nodes"] >= 4096 // 61 - 2 for run in pre["runs"])
    assert pre["runs"][-1]["evicted_tokens"] > 0
    # The prefill step in its parts: each wrapped method was called (a rename must not leave a part at
    # zero), and the top-level parts with the forward and the rest add up to the step.
    parts = pre["runs"][0]["parts_us"]
    assert all(v > 0 for k, v in parts.items() if k != "rest"), parts
    top = sum(parts[k] for k in ("schedule", "input", "first token", "settle"))
    assert parts["kv pages"] < parts["schedule"] < pre["runs"][0]["host_us"]
    # (no prefill graphs on a CPU: both run inside `input`; each part is a median over the prefills, so
    # only each nested part, not their sum, is bound by its parent's median)
    assert parts["admit"] < parts["input"] and parts["build batch"] < parts["input"]
    assert abs(top + parts["rest"] + pre["runs"][0]["forward_us"] - pre["runs"][0]["step_us"]) < 0.2 * pre["runs"][0]["step_us"]
    # Its torch operations by part, counted as dispatched: the forward and the first token compute, and
    # the top-level parts with the forward and the rest are the step's.
    ops = pre["ops"]
    assert ops["forward"]["kernels"] > 0 and ops["first token"]["kernels"] > 0 and ops["admit"]["host tensors"] > 0
    for k in ("kernels", "views", "host tensors"):
        top = sum(ops[n][k] for n in ("schedule", "input", "first token", "settle", "forward", "rest"))
        assert top == ops["step"][k] and ops["rest"][k] >= 0, (k, ops)
    # Arrivals into a running batch of 3: every phase made its 20 iterations with an arrival before every
    # 4th (the script refuses a batch that shrank), warm-up and three timed phases a repeat.
    arr = res["arrival_into_batch"]
    assert len(arr["runs"]) == 2 and all(a["rows"] == 3 and a["arrivals"] == 4 * 5 for a in arr["runs"])
    assert arr["iteration_us"] > 0 and math.isfinite(arr["arrival_us"])
    assert 0 < arr["iteration_host_us"] < arr["iteration_us"] and math.isfinite(arr["arrival_host_us"])
    assert all(a["fused_steps"] == 0 for a in arr["runs"])  # a CPU engine: each arrival a prefill step of its own
    assert "one 60-token arrival into 3 decoding requests" in r.stdout
    assert "its parts (us" in r.stdout and "its torch operations" in r.stdout
    assert "host us/step" in r.stdout and "prefill of one 60-token arrival" in r.stdout and "every arrival evicts" in r.stdout


def test_scheduled_as_a_gpu_engine_each_arrival_rides_a_fused_step(tmp_path: Path) -> None:
    """`--overlap --emulate-graphs`: the CPU engine scheduled as a CUDA one (overlap, the fused mixed step
    staged into its emulated graph), so every timed arrival into the running batch rode in a fused step,
    and the host's part of an iteration is what is left once the emulated replays are taken out."""
    out = tmp_path / "host.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "engine_host_step.py"), "--batch-sizes", "4",
                        "--repeats", "1", "--prefills", "2", "--arrivals", "5", "--overlap", "--emulate-graphs",
                        "--output", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["overlap"] is True and res["emulate_graphs"] is True
    (run,) = res["arrival_into_batch"]["runs"]
    assert run["arrivals"] == 20 and run["fused_steps"] == 3 * 5  # the three timed arrival phases' arrivals
    assert 0 < run["iteration_host_us"] < run["iteration_us"]
    assert "the host's part (the forwards left out)" in r.stdout


def test_host_op_cost_times_each_operation_idle_and_busy() -> None:
    """scripts/host_op_cost.py on a GPU: every operation timed with the device idle and busy, each a
    positive median; without CUDA it says so and exits non-zero."""
    import pytest
    import torch

    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_op_cost.py")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    if not torch.cuda.is_available():
        assert r.returncode != 0 and "needs CUDA" in r.stderr
        pytest.skip("needs CUDA for the figures")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if "median" in ln]
    assert len(lines) == 10 and sum("busy:" in ln for ln in lines) == 5
    assert all(float(ln.split("median")[1].split()[0]) > 0 for ln in lines)
