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
