"""Tensor parallelism on the CPU: two gloo ranks against TP=1, both layouts, the seeds' regression.

The rank-side checks live in `tests/tp_spmd.py` (one run of two processes, joined like torchrun joins
them, serves every test here; see its docstring). Asserted here: logits of every forward (prefill with
prompt logprobs, decode, verify, each draft-extend step) equal TP=1's to 1e-5 relative in both layouts,
also with one KV head replicated over the ranks and with replicated draft layers, and the ranks hold
bit-identical logits (what their identical sampling rests on); greedy speculative output equals TP=1
target-only output eagerly and through the (emulated) graph runners, with every pool of every rank free
afterwards; the seeds' regression; and start-up validation that names what does not divide.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mleagle.engine.core.engine import Engine, EngineInputError, tp_shape_errors
from mleagle.engine.executor.forward_batch import ForwardMode, row_meta
from tests.spec_helpers import tiny_cfg

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_spmd(tmp: Path, world: int = 2, timeout: float = 300) -> list[dict[str, Any]]:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.tp_spmd", str(r), str(world), str(port), str(tmp)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    out = []
    for r, p in enumerate(procs):
        f = tmp / f"rank{r}.json"
        assert p.returncode == 0 and f.is_file(), f"rank {r} failed ({p.returncode}):\n{logs[r][-4000:]}"
        out.append(json.loads(f.read_text()))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_spmd(tmp_path_factory.mktemp("tp"))


def test_logits_equal_tp1_in_both_layouts(ranks: list[dict[str, Any]]) -> None:
    res = ranks[0]["logits"]
    assert {k.split("/")[0] for k in res} == {"all_reduce", "scattered"}
    for key, r in res.items():
        assert r["same_plan"] and r["forwards"] > 10, key
        assert r["max_rel_err"] < 1e-5, (key, r["max_rel_err"])
        assert r["tokens_equal"], key
        modes = set(r["modes"])
        if "random" in key:
            assert {"target:EXTEND", "target:TARGET_VERIFY", "draft0:DRAFT_EXTEND", "draft1:DRAFT_EXTEND"} <= modes
        else:
            assert {"target:EXTEND", "target:DECODE"} <= modes
        # KV pools hold this rank's heads: one of two, or one replicated head (kv=1); a replicated draft all.
        assert r["kv_heads_per_rank"] == 1, key
        assert r["draft_kv_heads_per_rank"] == (2 if key.endswith("replicate") else 1), key
        assert r["pool_slots"] == r["ref_pool_slots"], key


def test_ranks_hold_identical_logits(ranks: list[dict[str, Any]]) -> None:
    d0, d1 = ranks[0]["digests"], ranks[1]["digests"]
    assert d0.keys() == d1.keys() and all(d0[k] == d1[k] for k in d0)


def test_greedy_speculation_equals_tp1_target_only_and_pools_free(ranks: list[dict[str, Any]]) -> None:
    r0, r1 = ranks[0]["exact"], ranks[1]["exact"]
    assert len(r0) == 6
    for key, r in r0.items():
        assert r["equal"], key
        assert r["free"] and r1[key]["free"], key
        if key.endswith("graphs"):
            assert r["replays"] > 0 and r1[key]["replays"] == r["replays"], key


def test_seed_regression_draft_extend_logprob_rows_under_scattered_tp(ranks: list[dict[str, Any]]) -> None:
    """The un-pruned draft-extend graph carries bs·(S+1) logprob rows, padded to the TP size and split
    over the ranks; its gathered logits equal eager at every request's selected row. Fault-injecting
    `[bs]` (SGLang's #26416) at capture makes the metadata check fail and the gathered logits at the
    selected rows wrong; injected at replay only, the capture-vs-replay parity check refuses the replay."""
    s = ranks[0]["seed"]
    w = s["width"]
    for bs in (3, 5):
        healthy, fault, replay = s[f"healthy/bs{bs}"], s[f"fault_capture/bs{bs}"], s[f"fault_replay/bs{bs}"]

        def rule(pbs: int) -> list[int]:
            return list(row_meta(ForwardMode.DRAFT_EXTEND, pbs, w, tp_size=2, layout="scattered")
                        .global_num_tokens_for_logprob)

        assert all(m == rule(int(p)) and sum(m) >= int(p) * w for p, m in healthy["metas"].items())
        assert not healthy["refused"] and healthy["rows"] == bs * w
        assert healthy["max_rel_err_sel"] < 1e-5 and healthy["bad_sel_rows"] == []
        # The same check fails under the fault: the metadata, and the logits at the selected rows.
        assert any(m != rule(int(p)) for p, m in fault["metas"].items())
        assert not fault["refused"] and fault["bad_sel_rows"], fault
        assert fault["max_rel_err_sel"] > 0.1
        assert all(r >= 2 * fault["bucket"] for r in fault["bad_sel_rows"])  # past the [bs]-per-rank rows
        assert replay["refused"]
    for r in ranks:
        assert "error" not in r


def test_startup_validation_names_what_does_not_divide() -> None:
    with pytest.raises(EngineInputError, match="num_attention_heads=3 is not divisible by tp_size=2"):
        Engine(tiny_cfg(heads=3, kv=1, hidden=48), tp_size=2)
    with pytest.raises(EngineInputError, match="intermediate_size=131"):
        Engine(tiny_cfg(inter=131), tp_size=2)
    cfg = tiny_cfg(heads=6, kv=3, hidden=48, inter=96)
    assert tp_shape_errors(cfg.model.arch, 2, "") == [
        "num_key_value_heads=3 neither divides nor is divisible by tp_size=2"]
    assert tp_shape_errors(cfg.model.arch, 3, "") == []
    assert tp_shape_errors(tiny_cfg(kv=1).model.arch, 4, "draft ") == []  # one KV head, replicated


def test_config_rejects_bad_topology() -> None:
    with pytest.raises(ValueError, match="tp_size=3 is not divisible by nnodes=2"):
        Engine(tiny_cfg(), tp_size=3, nnodes=2)
