"""HF-style directories: config.json + safetensors (one file or sharded with an index), Llama family.

Reads LlamaForCausalLM, Qwen2ForCausalLM (q/k/v biases) and MistralForCausalLM without a sliding
window into `ModelArch` (rope_theta and llama3 rope scaling from either transformers 4's
`rope_theta`/`rope_scaling` or transformers 5's `rope_parameters`, head_dim, tied embeddings, eos
ids from config.json and generation_config.json). Anything the engine would compute differently
(other rope types, sliding windows, MLP/o_proj biases, other activations) is refused with a clear
error instead of producing wrong text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mleagle.engine.contract.config import ModelArch, RopeScaling
from mleagle.engine.model_loader.names import check_weights

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def arch_from_config(cfg: dict[str, Any], gen: dict[str, Any] | None = None, where: str = "config.json") -> ModelArch:
    archs = cfg.get("architectures") or []
    kind = next((a for a in archs if a in SUPPORTED), None)
    if kind is None:
        mt = cfg.get("model_type")
        kind = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}.get(mt or "")
    if kind is None:
        raise ValueError(
            f"{where}: architecture {archs or cfg.get('model_type')!r} is not supported; "
            f"mleagle runs the Llama family: {', '.join(SUPPORTED)}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias=true is not supported")
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    if kind == "Qwen2ForCausalLM":
        bias = True  # Qwen2 always has q/k/v biases (and none on o_proj)
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{where}: use_sliding_window=true is not supported")
    else:
        bias = bool(cfg.get("attention_bias", False))
        if bias:  # Llama's attention_bias also adds an o_proj bias the engine does not have
            raise ValueError(f"{where}: attention_bias=true is not supported for {kind}")
        sw = cfg.get("sliding_window")
        if kind == "MistralForCausalLM" and sw is not None and sw < max_pos:
            raise ValueError(
                f"{where}: sliding_window={sw} is not supported (Mistral v0.1); models without a "
                "sliding window (sliding_window null, e.g. Mistral v0.2+) load fine"
            )
    rope = dict(cfg.get("rope_parameters") or {})  # transformers 5
    rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if not rope or rope.get("rope_type", rope.get("type")) in (None, "default"):
        rope = dict(cfg.get("rope_scaling") or {})  # transformers 4
    rtype = rope.get("rope_type", rope.get("type")) if rope else None
    scaling: RopeScaling | None = None
    if rtype == "llama3":
        scaling = RopeScaling.model_validate(rope)
    elif rtype not in (None, "default"):
        raise ValueError(f"{where}: rope scaling {rtype!r} is not supported (only llama3 or none)")
    eos: list[int] = []
    for c in (cfg, gen or {}):
        e = c.get("eos_token_id")
        for x in [e] if isinstance(e, int) else list(e or []):
            if x not in eos:
                eos.append(x)
    return ModelArch(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=int(cfg["num_attention_heads"]),
        num_key_value_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        head_dim=cfg.get("head_dim"),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bias,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=None if not eos else eos[0] if len(eos) == 1 else eos,
    )


def weight_files(d: Path) -> list[Path]:
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        files = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{d}: shards named in model.safetensors.index.json are missing: {missing}")
        return [d / f for f in files]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        hint = " (found PyTorch .bin weights: convert them to safetensors)" if list(d.glob("*.bin")) else ""
        raise FileNotFoundError(f"{d}: no *.safetensors weights{hint}")
    return files


def load_hf(path: str, dtype: torch.dtype) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    d = Path(path)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d}: not an HF model directory (no config.json)")
    cfg = json.loads((d / "config.json").read_text())
    gen = json.loads((d / "generation_config.json").read_text()) if (d / "generation_config.json").is_file() else None
    arch = arch_from_config(cfg, gen, str(d / "config.json"))
    w: dict[str, torch.Tensor] = {}
    for f in weight_files(d):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if k.endswith("rotary_emb.inv_freq"):  # old checkpoints store the RoPE buffer
                    continue
                if k == "lm_head.weight" and arch.tie_word_embeddings:
                    continue  # a tied head stored anyway: the embedding is the one we keep
                w[k] = sf.get_tensor(k).to(dtype).contiguous()
    if arch.tie_word_embeddings is False and "lm_head.weight" not in w and "model.embed_tokens.weight" in w:
        raise ValueError(f"{d}: tie_word_embeddings is false but there is no lm_head.weight")
    check_weights(arch, w, str(d))
    return arch, w
