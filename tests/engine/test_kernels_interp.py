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
