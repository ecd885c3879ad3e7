"""What a loaded model holds: the HF-Llama tensor names and shapes an architecture has, and the check
that a set of weights matches them. A leaf the three loaders and the package's `load_model` share, so
the loaders never import the package that dispatches to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mleagle.engine.contract.config import ModelArch


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
