"""Model loading: a `ModelSource` becomes a `ModelArch` plus HF-Llama-named torch tensors.

Three formats share one output: GGUF files (dequantised once, then cached as float32 safetensors
next to the tokenizer, see `gguf.py`), HF-style directories of the Llama family (`hf.py`) and random
weights of any shape (`dummy.py`). `weights` always uses HF Llama names
(`model.layers.{i}.self_attn.q_proj.weight`, ...), holds `lm_head.weight` only when the head is
untied, and every tensor is contiguous and already in the requested dtype (and device).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mleagle.engine.contract.config import ModelArch, ModelSource


@dataclass
class LoadedModel:
    arch: ModelArch
    weights: dict[str, torch.Tensor]


def expected_names(arch: ModelArch) -> list[str]:
    """Every tensor name a loaded model has, in a stable order."""
    names = ["model.embed_tokens.weight"]
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight"]
        names += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
        if arch.attention_bias:
            names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
        names += [p + "post_attention_layernorm.weight"]
        names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    names.append("model.norm.weight")
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def expected_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    h, hd, ff, v = arch.hidden_size, arch.head_dim or 0, arch.intermediate_size, arch.vocab_size
    nq, nkv = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
    by_suffix = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "q_proj.weight": (nq, h), "k_proj.weight": (nkv, h), "v_proj.weight": (nkv, h), "o_proj.weight": (h, nq),
        "q_proj.bias": (nq,), "k_proj.bias": (nkv,), "v_proj.bias": (nkv,),
        "gate_proj.weight": (ff, h), "up_proj.weight": (ff, h), "down_proj.weight": (h, ff),
    }
    out: dict[str, tuple[int, ...]] = {}
    for n in expected_names(arch):
        if n in ("model.embed_tokens.weight", "lm_head.weight"):
            out[n] = (v, h)
        elif n == "model.norm.weight":
            out[n] = (h,)
        else:
            out[n] = by_suffix[n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1]]
    return out


def check_weights(arch: ModelArch, weights: dict[str, torch.Tensor], where: str) -> None:
    """Every expected tensor present with the right shape, nothing else: a mismatch names the file."""
    shapes = expected_shapes(arch)
    missing = [n for n in shapes if n not in weights]
    extra = [n for n in weights if n not in shapes]
    if missing or extra:
        raise ValueError(
            f"{where}: tensors do not match the architecture (missing {missing[:5]}{'...' if len(missing) > 5 else ''},"
            f" unexpected {extra[:5]}{'...' if len(extra) > 5 else ''})"
        )
    bad = [f"{n} {tuple(weights[n].shape)} != {s}" for n, s in shapes.items() if tuple(weights[n].shape) != s]
    if bad:
        raise ValueError(f"{where}: tensor shapes do not match the architecture: {bad[:5]}")


def load_model(src: ModelSource, dtype: torch.dtype, device: str | torch.device = "cpu") -> LoadedModel:
    """Load weights for `src` in `dtype` on `device` (dummy weights are generated there directly)."""
    fmt = src.load_format
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
