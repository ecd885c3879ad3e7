"""Draft checkpoints: mleagle's own format (safetensors + draft_config.json), imports, random drafts.

Own format: a folder with `draft_config.json` ({"format": "mleagle-mtp", "version": 1, "num_layers",
"chain", "arch"}) and `draft.safetensors` holding `layers.{k}.{enorm,hnorm,eh_proj,norm}.weight` and
`layers.{k}.block.<HF decoder-layer names>`. Import maps the common MTP namings: MiMo-style
`model.mtp.layers.{i}.*` and DeepSeek-style `model.layers.{N+i}.*` (with `shared_head.norm`).
`random:S[:seed]` builds an S-layer chain draft with random weights for any target (tests, benchmarks).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from mleagle.engine.contract.config import MAX_SPEC_STEPS, ModelArch
from mleagle.engine.spec.draft_model import DraftStack, MTPLayer

FORMAT = "mleagle-mtp"
_BLOCK_KEYS = ("input_layernorm.", "post_attention_layernorm.", "self_attn.", "mlp.")
_FINAL_NORMS = ("norm.weight", "final_layernorm.weight", "shared_head.norm.weight")


def parse_spec(spec: str) -> tuple[str, int | None, int, bool]:
    """'random:S[:seed[:nochain]]' → ('random', S, seed, chain); a path → ('path', None, 0, True);
    'none' → ('none', None, 0, True)."""
    if spec in ("", "none"):
        return "none", None, 0, True
    if spec.startswith("random:"):
        parts = spec.split(":")
        try:
            s = int(parts[1])
            seed = int(parts[2]) if len(parts) > 2 else 0
        except (IndexError, ValueError):
            raise ValueError(f"bad draft spec {spec!r}: expected random:S[:seed[:nochain]]") from None
        if not 1 <= s <= MAX_SPEC_STEPS or len(parts) > 4 or (len(parts) == 4 and parts[3] not in ("chain", "nochain")):
            raise ValueError(f"bad draft spec {spec!r}: expected random:S[:seed[:nochain]] with S in 1..{MAX_SPEC_STEPS}")
        return "random", s, seed, not (len(parts) == 4 and parts[3] == "nochain")
    return "path", None, 0, True


def layer_state(stack: DraftStack, k: int) -> dict[str, torch.Tensor]:
    m: MTPLayer = stack.layers[k]
    b = m.block
    hq, hk, d = b.self_attn.hq, b.self_attn.hk, b.self_attn.d
    q, kk, v = b.self_attn.qkv_proj.weight.split([hq * d, hk * d, hk * d])
    g, u = b.mlp.gate_up_proj.weight.chunk(2)
    st: dict[str, torch.Tensor] = {}
    if b.self_attn.qkv_proj.bias is not None:  # Qwen2-style q/k/v biases: part of the layer, saved with it
        qb, kb, vb = b.self_attn.qkv_proj.bias.split([hq * d, hk * d, hk * d])
        st = {"block.self_attn.q_proj.bias": qb, "block.self_attn.k_proj.bias": kb, "block.self_attn.v_proj.bias": vb}
    return st | {
        "enorm.weight": m.enorm.weight, "hnorm.weight": m.hnorm.weight, "eh_proj.weight": m.eh_proj.weight,
        "norm.weight": m.norm.weight,
        "block.input_layernorm.weight": b.input_layernorm.weight,
        "block.post_attention_layernorm.weight": b.post_attention_layernorm.weight,
        "block.self_attn.q_proj.weight": q, "block.self_attn.k_proj.weight": kk, "block.self_attn.v_proj.weight": v,
        "block.self_attn.o_proj.weight": b.self_attn.o_proj.weight,
        "block.mlp.gate_proj.weight": g, "block.mlp.up_proj.weight": u, "block.mlp.down_proj.weight": b.mlp.down_proj.weight,
    }


def save_draft(stack: DraftStack, path: str | Path) -> None:
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    tensors = {f"layers.{k}.{n}": t.detach().contiguous().clone()
               for k in range(len(stack)) for n, t in layer_state(stack, k).items()}
    save_file(tensors, str(p / "draft.safetensors"))
    cfg = {"format": FORMAT, "version": 1, "num_layers": len(stack), "chain": stack.chain,
           "arch": stack.arch.model_dump(mode="json")}
    (p / "draft_config.json").write_text(json.dumps(cfg, indent=2))


def load_layer(m: MTPLayer, w: dict[str, torch.Tensor]) -> None:
    """Load one layer from names relative to the layer (`enorm.weight`, `block.self_attn...`)."""
    with torch.no_grad():
        m.enorm.weight.copy_(w["enorm.weight"])
        m.hnorm.weight.copy_(w["hnorm.weight"])
        m.eh_proj.weight.copy_(w["eh_proj.weight"])
        m.norm.weight.copy_(w["norm.weight"])
        m.block.load(w, "block")


def read_draft(path: str | Path, target: ModelArch) -> tuple[ModelArch, bool, list[dict[str, torch.Tensor]]]:
    """Read a draft folder: own format, or an imported MTP checkpoint (config.json + safetensors)."""
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"draft {path!r}: not a folder (expected draft_config.json + draft.safetensors, "
                                "or random:S[:seed], or none)")
    own = p / "draft_config.json"
    if own.is_file():
        cfg = json.loads(own.read_text())
        if cfg.get("format") != FORMAT:
            raise ValueError(f"draft {path}: unknown format {cfg.get('format')!r}")
        arch = ModelArch.model_validate(cfg["arch"])
        flat = load_file(str(p / "draft.safetensors"))
        layers = [{n[len(f"layers.{k}."):]: t for n, t in flat.items() if n.startswith(f"layers.{k}.")}
                  for k in range(int(cfg["num_layers"]))]
        return arch, bool(cfg.get("chain", True)), layers
    return import_mtp(p, target)


def import_mtp(p: Path, target: ModelArch) -> tuple[ModelArch, bool, list[dict[str, torch.Tensor]]]:
    from safetensors.torch import load_file

    flat: dict[str, torch.Tensor] = {}
    for f in sorted(p.glob("*.safetensors")):
        flat.update(load_file(str(f)))
    groups: dict[int, dict[str, torch.Tensor]] = {}
    n = target.num_hidden_layers
    for name, t in flat.items():
        m = re.match(r"model\.mtp\.layers\.(\d+)\.(.+)", name)
        if m:
            groups.setdefault(int(m.group(1)), {})[m.group(2)] = t
            continue
        m = re.match(r"model\.layers\.(\d+)\.(.+)", name)
        if m and int(m.group(1)) >= n:
            groups.setdefault(int(m.group(1)) - n, {})[m.group(2)] = t
    if not groups:
        raise ValueError(f"draft {p}: no MTP layers found (model.mtp.layers.* or model.layers.{{{n}+i}}.*)")
    layers = []
    for k in sorted(groups):
        g = groups[k]
        w = {key: g[key] for key in ("enorm.weight", "hnorm.weight", "eh_proj.weight") if key in g}
        for fn in _FINAL_NORMS:
            if fn in g:
                w["norm.weight"] = g[fn]
                break
        w.update({f"block.{key}": t for key, t in g.items() if key.startswith(_BLOCK_KEYS)})
        missing = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "norm.weight"} - w.keys()
        if missing:
            raise ValueError(f"draft {p}: MTP layer {k} lacks {sorted(missing)}")
        layers.append(w)
    # Imported stacks are run in chain mode when they have several layers (Step3p5-style), which is
    # also exact for a single layer; a config flag can say otherwise.
    chain = json.loads((p / "config.json").read_text()).get("mtp_chain", True) if (p / "config.json").is_file() else True
    return target, bool(chain), layers


def random_layer_weights(arch: ModelArch, seed: int, k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + k)
    h, i = arch.hidden_size, arch.intermediate_size
    assert arch.head_dim is not None
    hq, hk = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    w = {"enorm.weight": torch.ones(h), "hnorm.weight": torch.ones(h), "eh_proj.weight": r(h, 2 * h),
         "norm.weight": torch.ones(h), "block.input_layernorm.weight": torch.ones(h),
         "block.post_attention_layernorm.weight": torch.ones(h),
         "block.self_attn.q_proj.weight": r(hq, h), "block.self_attn.k_proj.weight": r(hk, h),
         "block.self_attn.v_proj.weight": r(hk, h), "block.self_attn.o_proj.weight": r(h, hq),
         "block.mlp.gate_proj.weight": r(i, h), "block.mlp.up_proj.weight": r(i, h), "block.mlp.down_proj.weight": r(h, i)}
    if arch.attention_bias:
        w.update({"block.self_attn.q_proj.bias": torch.zeros(hq), "block.self_attn.k_proj.bias": torch.zeros(hk),
                  "block.self_attn.v_proj.bias": torch.zeros(hk)})
    return w
