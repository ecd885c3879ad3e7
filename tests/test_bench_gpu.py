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
