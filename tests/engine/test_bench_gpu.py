"""`mleagle bench gpu` on the CPU with a tiny random model: `--batches` times several static batches per
batch size (distinct prompts, wrapping round the dataset) and pools their tokens, walls and verifies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mleagle.engine.entrypoints import bench_gpu

pytestmark = pytest.mark.usefixtures("one_thread")


def test_batches_pool_several_static_batches(tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": "x" * (20 + 7 * i)}) + "\n" for i in range(5)))
    out = tmp_path / "b.json"
    args = bench_gpu.build_parser().parse_args(
        ["--model", "tiny-dummy", "--dataset", str(data), "--configs", "graphs,spec", "--draft", "random:2",
         "--batch-sizes", "1,2", "--max-new-tokens", "6", "--batches", "3", "--out", str(out)])
    res = bench_gpu.run(args)
    assert json.loads(out.read_text())["batches"] == 3
    rows = {(r["config"], r["bs"]): r for r in res["rows"]}
    for bs in (1, 2):
        t, s = rows[("target graphs", bs)], rows[("spec random:2", bs)]
        assert t["batches"] == s["batches"] == 3
        assert t["tokens"] == s["tokens"] == 3 * bs * 6  # every batch's every request, ignore_eos
        assert s["equal_to_target_graphs"] is True  # float32 on the CPU: speculation is exact
        assert s["spec"]["accept_len"] >= 1.0 and s["spec"]["iterations_per_request"] >= 6 / 3


def test_profile_kernel_families_and_table() -> None:
    assert bench_gpu.kernel_name("void cutlass::Kernel2<cutlass_80_wmma_tensorop>(Params)") == "void cutlass::Kernel2"
    assert bench_gpu.kernel_name("_attn_decode_kernel") == "_attn_decode_kernel"
    res = {"machine": {"torch": "x"}, "model": "m", "dtype": "bf16", "dataset": "d", "max_new_tokens": 4, "rows": [],
           "profile_bs1_spec": {"kernels_per_token": 10.0, "gpu_busy_frac_of_wall": 0.5, "gpu_busy_frac_profiled": 0.4,
                                "first_token_ms": 9.5, "steady_ms_per_token": 0.61,
                                "top_kernels": [{"name": "gemv", "per_token": 3.0, "us_per_token": 12.5}]}}
    text = bench_gpu.table(res)
    assert "first token 9.5 ms, then 0.61 ms/token" in text and "12.50 us/token" in text and "gemv" in text


def test_draft_ab_serves_every_engine_from_one_process(tmp_path: Path) -> None:
    """scripts/draft_ab.py: each engine times every prompt in every round (a 1-token and an N-token
    request), target-only is the speed-up's base, and a draft's accept length pools its verifies."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("draft_ab", Path(__file__).parents[2] / "scripts" / "draft_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": "y" * (15 + 5 * i)}) + "\n" for i in range(4)))
    out = tmp_path / "ab.json"
    assert ab.main(["--model", "tiny-dummy", "--drafts", "none,random:2,random:3@auto=0/2/3", "--dataset", str(data),
                    "--prompts", "3", "--max-new-tokens", "6", "--rounds", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["prompts"] == 3 and set(res["summary"]) == {"none", "random:2", "random:3@auto=0/2/3"}
    for rows in res["samples"].values():
        assert sorted((x["round"], x["prompt"]) for x in rows) == [(r, i) for r in range(2) for i in range(3)]
        assert all(x["tokens"] == 6 for x in rows)
    assert res["summary"]["none"]["speedup"] == 1.0 and "accept_len" not in res["summary"]["none"]
    s = res["summary"]["random:2"]
    # A difference of two timings (a 6-token request less a 1-token one): present, not signed on a loaded
    # machine (timings are the benchmark's business, not the test's).
    assert 1.0 <= s["accept_len"] <= 3.0 and isinstance(s["ms_per_iteration"], float)
    assert all(x["verifies"] >= 5 / 3 for x in res["samples"]["random:2"])
    with pytest.raises(SystemExit):
        ab.main(["--model", "tiny-dummy", "--drafts", "none", "--dataset", str(data), "--max-new-tokens", "1"])
    from mleagle.engine.entrypoints.bench_gpu import engine_for

    e = ab.build(engine_for, "tiny-dummy", 6, "random:3@auto=0/2/3")
    p = e.worker.policy
    assert (p.mode, p.choices, e.worker.steps) == ("auto", [0, 2, 3], 3) and p.cost  # served as a server is: warmed, timed


def test_policy_replay_serves_a_recorded_answer_at_each_depth() -> None:
    """scripts/policy_replay.py: a shallower depth stops inside a recorded chain and goes on from there
    with what the bounds allow; fixed depths are timed by the given costs, and `auto` runs the real
    policy over the same positions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("policy_replay", Path(__file__).parents[2] / "scripts" / "policy_replay.py")
    pr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pr)
    # 11 tokens: the first from the prefill, then iterations accepting 3, 0, 2 and 1 drafts.
    trace = {"steps": 3, "requests": [{"tokens": 11, "accepted": [3, 0, 2, 1]}] * 4}
    req = trace["requests"][0]
    assert pr.potentials(req, 3, high=False)[:9] == [3, 2, 1, 0, 0, 2, 1, 0, 1]
    assert pr.potentials(req, 3, high=True)[:9] == [3, 3, 2, 1, 0, 2, 3, 2, 1]
    cost = {0: 0.5, 1: 1.0, 3: 2.0}
    full = pr.replay(trace, cost, 0.5, 3, high=False)
    assert full["tok_s"] == pytest.approx(10 / 0.008) and full["depth_share"] == [0.0, 0.0, 0.0, 1.0]
    one = pr.replay(trace, cost, 0.5, 1, high=False)
    assert one["tok_s"] == pytest.approx(10 / 0.006)  # 6 iterations of 1 ms make the same 10 tokens
    plain = pr.replay(trace, cost, 0.5, 0, high=True)
    assert plain["tok_s"] == pytest.approx(1 / 0.0005)  # one token every 0.5 ms
    auto = pr.replay(trace, cost, 0.5, None, high=True)
    assert sum(auto["depth_share"]) == pytest.approx(1.0, abs=0.01) and auto["tok_s"] > 0
