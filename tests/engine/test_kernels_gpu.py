"""GPU checks of the kernels and backends (marked gpu: they skip without CUDA; `pytest -m gpu` on a
CUDA machine runs them).

- every case of tests/kernel_cases.py through the Triton backend on CUDA, in bfloat16 and float32;
- the attention cases through FlashInfer (bfloat16; skipped when flashinfer is not importable),
  including a padded graph-style batch after `init_graph` (the graph wrappers' plan path);
- each graph-capable backend captured in a CUDA graph on fixed buffers and replayed on later steps
  (new lengths, requests and slots copied into the buffers, `plan`, replay) equals the eager torch
  backend on those steps, output and pool;
- end to end, greedy `Engine.generate` on a small chaotic model: the Triton backend with fused layers
  equals the torch backend with reference layers token for token (float32), speculative greedy with a
  random 2-layer draft equals target-only greedy on the Triton backend, and FlashInfer (float16, which
  it supports; no float32 kernels) equals the torch backend in float16.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/*.py helpers (pytest runs with --import-mode=importlib)
from kernel_cases import CASES, graph_replay_err, tol
from spec_helpers import greedy, run, tiny_cfg, tiny_engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_fi = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed")

CUDA = torch.device("cuda")
FI_CASES = ["extend", "extend_d128", "decode", "decode_d128", "verify", "verify_padded"]
PROMPTS = [[1, 5, 9, 200, 17], [3, 3, 3, 8] * 9, [42], list(range(10, 90))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_case_on_cuda(case: str, dtype: torch.dtype) -> None:
    if case == "engine_greedy" and dtype != torch.float32:
        pytest.skip("token equality across kernels is a float32 check (bf16 near-ties may flip)")
    err = CASES[case](dtype, CUDA)
    assert err <= tol(dtype), f"{case} ({dtype}): max error {err:.3g} > {tol(dtype):.1g}"


@needs_fi
@pytest.mark.parametrize("case", FI_CASES)
def test_flashinfer_case(case: str) -> None:
    err = CASES[case](torch.bfloat16, CUDA, backend="flashinfer")
    assert err <= tol(torch.bfloat16), f"flashinfer {case}: max error {err:.3g}"


@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("backend", ["triton", pytest.param("flashinfer", marks=needs_fi)])
def test_backend_replays_from_cuda_graph(backend: str, width: int) -> None:
    err = graph_replay_err(backend, torch.bfloat16, CUDA, width)
    assert err <= tol(torch.bfloat16), f"{backend} W={width}: replay differs from eager by {err:.3g}"


def _tokens(backend: str, dtype: str, *, fused: bool = True, draft: str = "none", hidden: int = 64,
            heads: int = 4) -> list[list[int]]:
    cfg = tiny_cfg(hidden=hidden, heads=heads, kv=2, layers=2)
    e = tiny_engine(draft, cfg=cfg, device="cuda", dtype=dtype, attention_backend=backend, fused_layers=fused)
    assert all(r.binding.backend.name == {"torch": "torch_native"}.get(backend, backend) for r in e.runners)
    return run(e, PROMPTS, greedy(24))


def test_engine_triton_equals_torch_float32() -> None:
    ref = _tokens("torch", "float32", fused=False)
    assert _tokens("triton", "float32") == ref
    assert _tokens("triton", "float32", fused=False) == ref


def test_engine_spec_greedy_equals_target_triton() -> None:
    assert _tokens("triton", "float32", draft="random:2") == _tokens("triton", "float32")


@needs_fi
def test_engine_flashinfer_equals_torch_float16() -> None:
    # head_dim 64 (hidden 256, 4 heads): a size FlashInfer compiles for.
    ref = _tokens("torch", "float16", fused=False, hidden=256)
    assert _tokens("flashinfer", "float16", hidden=256) == ref
    assert _tokens("flashinfer", "float16", hidden=256, draft="random:2") == _tokens("flashinfer", "float16", hidden=256)
