"""The Triton kernels in Triton's CPU interpreter (float32) against the torch reference.

`tests/kernel_cases.py --interpret` runs in a subprocess with TRITON_INTERPRET=1 set before Triton is
imported, so this process (and the rest of the suite) keeps the torch path; it runs every case once
and reports each case's largest error, which the parametrised tests below check one by one. The
cases cover rotary + KV store (exact slots, sentinel elsewhere), attention through the Triton backend's
own plan/forward in EXTEND (ragged, with prefixes), DECODE and TARGET_VERIFY / DRAFT_EXTEND (W rows,
causal window) with GQA, shuffled slot maps and 1 or several KV splits, a graph-style padded batch,
fused add-RMSNorm, SiLU-and-mul and the FlashInfer page-list gather.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/kernel_cases.py (pytest runs with --import-mode=importlib)
from kernel_cases import CASES


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "kernel_cases.py"), "--interpret"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(results: dict[str, Any], case: str) -> None:
    r = results[case]
    assert r["err"] <= r["tol"], f"{case}: {CASES[case].__doc__ or ''} max error {r['err']:.3g} > {r['tol']:.1g}"


def test_interpreter_stays_in_its_subprocess() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1"
    import torch

    from mleagle.engine.attention import resolve_backend
    from mleagle.engine.kernels import fused_layers_on

    assert resolve_backend("auto", "cpu") == "torch"
    assert not fused_layers_on(torch.zeros(2))


def test_the_decode_tile_override_is_parsed_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from mleagle.engine.kernels.attention import DecodeTile, decode_tile

    monkeypatch.delenv("MLEAGLE_DECODE_TILE", raising=False)
    assert decode_tile(64) == DecodeTile(128, 4, 2, 4)  # SmolLM2's heads: the measured default
    assert decode_tile(128) == DecodeTile(64, 4, 2, 1) and decode_tile(256).block_n == 32
    # The tile's fewest splits hold at every batch; the small-batch rule may ask for more; 1 turns it off.
    from mleagle.engine.kernels.attention import num_kv_splits

    assert num_kv_splits(32, 3, 132, 16, 4) == 4 and num_kv_splits(64, 3, 132, 16, 4) == 4
    assert num_kv_splits(8, 3, 132, 16, 4) == 5 and num_kv_splits(1, 3, 132, 16, 4) == 16
    assert num_kv_splits(32, 3, 132, 1, 4) == 1 and num_kv_splits(32, 3, 132) == 1
    monkeypatch.setenv("MLEAGLE_DECODE_TILE", "128,8,3")
    assert decode_tile(64) == DecodeTile(128, 8, 3, 1)
    monkeypatch.setenv("MLEAGLE_DECODE_TILE", "256,4,1,2")
    assert decode_tile(64) == DecodeTile(256, 4, 1, 2)
    for bad in ("96,4,2", "128,3,2", "a,b,c", "128,4,0", "128,4,2,0", "128,4,2,1,1"):
        monkeypatch.setenv("MLEAGLE_DECODE_TILE", bad)
        with pytest.raises(ValueError, match="MLEAGLE_DECODE_TILE"):
            decode_tile(64)


def test_decode_tiles_script_agrees_across_tiles_in_the_interpreter(tmp_path: Path) -> None:
    """`scripts/decode_tiles.py --check`: real MT-Bench-length batches through the decode kernel with
    three launch shapes (one split); every shape's output equals the first's."""
    out = tmp_path / "t.json"
    p = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "scripts" / "decode_tiles.py"), "--check",
                        "--batch-sizes", "3", "--tiles", "64x4x2x1,16x2x1x1,128x4x2x2", "--output", str(out)],
                       env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["mix"] for r in rows} == {"static", "served"} and len(rows) == 6
    assert all(r["max_diff_from_first"] < 1e-4 for r in rows)
    assert all(r["mean_max_ctx"] >= r["mean_ctx"] > 0 for r in rows)
