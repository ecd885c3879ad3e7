"""Model loading: a `ModelSource` becomes a `ModelArch` plus HF-Llama-named torch tensors.

Three formats share one output: GGUF files (dequantised once, then cached as float32 safetensors
next to the tokenizer, see `gguf.py`), HF-style directories of the Llama family (`hf.py`) and random
weights of any shape (`dummy.py`). `weights` always uses HF Llama names
(`model.layers.{i}.self_attn.q_proj.weight`, ...), holds `lm_head.weight` only when the head is
untied, and every tensor is contiguous and already in the requested dtype (and device).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mleagle.engine.contract.config import ModelSource
from mleagle.engine.model_loader.names import LoadedModel, check_weights, expected_names, expected_shapes


def load_model(src: ModelSource, dtype: torch.dtype, device: str | torch.device = "cpu") -> LoadedModel:
    """Load weights for `src` in `dtype` on `device` (dummy weights are generated there directly)."""
    fmt: str = src.load_format  # "" while auto-detection has not found one
    path = src.resolved_path()
    if fmt == "auto":
        if path is None:
            fmt = "dummy" if src.arch is not None else ""
        elif Path(path).is_dir():
            fmt = "hf"
        elif path.endswith(".gguf"):
            fmt = "gguf"
        elif not Path(path).exists():
            raise FileNotFoundError(f"model path not found: {path}")
        if fmt not in ("dummy", "hf", "gguf"):
            raise ValueError(
                f"cannot tell the format of model {src.name!r} at {path!r}: give a .gguf file, an HF directory "
                "(config.json + *.safetensors), or set load_format"
            )
    if fmt == "dummy":
        from mleagle.engine.model_loader.dummy import load_dummy

        if src.arch is None:
            raise ValueError(f"model {src.name!r}: load_format 'dummy' needs [model.arch] (the shape to generate)")
        return LoadedModel(src.arch, load_dummy(src.arch, src.dummy_seed, dtype, device))
    if path is None:
        raise ValueError(f"model {src.name!r} has no path: set [model] path to a .gguf file or an HF directory")
    if fmt == "gguf":
        from mleagle.engine.model_loader.gguf import load_gguf

        arch, w = load_gguf(path, dtype)
    else:
        from mleagle.engine.model_loader.hf import load_hf

        arch, w = load_hf(path, dtype)
    if torch.device(device).type != "cpu":
        for k in list(w):  # one tensor at a time, so the host copy is freed as we go
            w[k] = w[k].to(device)
    return LoadedModel(arch, w)


__all__ = ["LoadedModel", "check_weights", "expected_names", "expected_shapes", "load_model"]
