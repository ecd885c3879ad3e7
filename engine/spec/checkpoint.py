"""Draft checkpoints: mleagle's own format (safetensors + draft_config.json), imports, random drafts.

Own format: a folder with `draft_config.json` ({"format": "mleagle-mtp", "version": 3, "num_layers",
"chain", "arch", "dtype", "files", "draft_vocab_size", "blocks_per_layer", "aux_layers"}) and the
weights in `files`: `draft.safetensors`, or `draft-00001-of-0000N.safetensors` shards of at most
`max_shard_bytes` each (so a draft fits size limits on files, e.g. what one GPU run may hand back),
holding `layers.{k}.{enorm,hnorm,eh_proj,norm}.weight`, `layers.{k}.block.<HF decoder-layer names>`
(`block1.`, `block2.`, ... for further blocks of a step), for fused target features
`layers.0.aux_proj.weight` and `layers.0.anorm.{i}.weight`, and, for a reduced draft vocabulary,
`vocab_ids` (the target ids the draft head covers, see `DraftHead`). `tied_blocks` ({"k": j}) says layer
k runs layer j's decoder blocks: its `block*` weights are not stored, and loading copies layer j's in.
`auto_depths` (optional, e.g. [0, 3, 5]) are the depths the `auto` policy chooses between for this
draft when the engine names none (`spec_depths`): a deep draft whose last steps pay only at small
batches serves best with a depth in between, and that is the draft's property, not the model's.
`auto_depths_by_device` (optional, e.g. {"cuda": [0, 5]}) replaces that list on one device type, where
a depth in between pays on one machine and not on another.
Version 1 folders (one `draft.safetensors`, no `files`) and version 2 (no `blocks_per_layer`,
`aux_layers`: one block, no fused features) load unchanged. Weights are stored in the dtype asked for (bfloat16
for shipped drafts) and cast to the engine's at load. Import maps the common MTP namings: MiMo-style
`model.mtp.layers.{i}.*` and DeepSeek-style `model.layers.{N+i}.*` (with `shared_head.norm`).
`random:S[:seed]` builds an S-layer chain draft with random weights for any target (tests, benchmarks).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mleagle.engine.contract.config import MAX_SPEC_STEPS, ModelArch
from mleagle.engine.models.llama import DecoderLayer
from mleagle.engine.spec.draft_model import DraftStack, MTPLayer, check_ties

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


def block_prefix(i: int) -> str:
    """Checkpoint prefix of a draft step's block i: `block` for the first (the format's original name)."""
    return "block" if i == 0 else f"block{i}"


def block_state(b: DecoderLayer, p: str) -> dict[str, torch.Tensor]:
    """One decoder block's weights under HF names (q/k/v and gate/up unfused), prefixed `p.`."""
    hq, hk, d = b.self_attn.hq, b.self_attn.hk, b.self_attn.d
    q, kk, v = b.self_attn.qkv_proj.weight.split([hq * d, hk * d, hk * d])
    g, u = b.mlp.gate_up_proj.weight.chunk(2)
    st: dict[str, torch.Tensor] = {}
    if b.self_attn.qkv_proj.bias is not None:  # Qwen2-style q/k/v biases: part of the layer, saved with it
        qb, kb, vb = b.self_attn.qkv_proj.bias.split([hq * d, hk * d, hk * d])
        st = {f"{p}.self_attn.q_proj.bias": qb, f"{p}.self_attn.k_proj.bias": kb, f"{p}.self_attn.v_proj.bias": vb}
    return st | {
        f"{p}.input_layernorm.weight": b.input_layernorm.weight,
        f"{p}.post_attention_layernorm.weight": b.post_attention_layernorm.weight,
        f"{p}.self_attn.q_proj.weight": q, f"{p}.self_attn.k_proj.weight": kk, f"{p}.self_attn.v_proj.weight": v,
        f"{p}.self_attn.o_proj.weight": b.self_attn.o_proj.weight,
        f"{p}.mlp.gate_proj.weight": g, f"{p}.mlp.up_proj.weight": u, f"{p}.mlp.down_proj.weight": b.mlp.down_proj.weight,
    }


def layer_state(stack: DraftStack, k: int) -> dict[str, torch.Tensor]:
    """Layer k's weights relative to the layer; a layer with tied blocks (`DraftStack.tie_blocks`) leaves
    them out: its source layer holds them."""
    m: MTPLayer = stack.layers[k]
    st = {"enorm.weight": m.enorm.weight, "hnorm.weight": m.hnorm.weight, "eh_proj.weight": m.eh_proj.weight,
          "norm.weight": m.norm.weight}
    if m.aux:
        st["aux_proj.weight"] = m.aux_proj.weight
        st |= {f"anorm.{i}.weight": n.weight for i, n in enumerate(m.anorm)}
    if k not in stack.tied:
        for i, b in enumerate(m.blocks):
            st |= block_state(b, block_prefix(i))
    return st


MAX_SHARD_BYTES = 15 * 2**20  # + the header stays under 16 MiB (what one GPU run may return per file)


def save_draft(stack: DraftStack, path: str | Path, dtype: torch.dtype | None = None,
               max_shard_bytes: int = MAX_SHARD_BYTES, auto_depths: list[int] | None = None,
               auto_depths_by_device: dict[str, list[int]] | None = None) -> list[Path]:
    """Write the stack in the own format; returns the weight files. Tensors are packed in order into
    shards of at most `max_shard_bytes` (a single larger tensor gets a shard of its own); files of an
    earlier save in the same folder that this one does not list are removed. `auto_depths`, if given,
    goes into the config (the depths `auto` chooses between for this draft), and `auto_depths_by_device`
    (the same per device type, where it differs)."""
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    tensors = {f"layers.{k}.{n}": t.detach().to("cpu", dtype or t.dtype).contiguous().clone()
               for k in range(len(stack)) for n, t in layer_state(stack, k).items()}
    if stack.vocab_ids is not None:
        tensors["vocab_ids"] = stack.vocab_ids.detach().to("cpu", torch.int64).contiguous().clone()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    names = ["draft.safetensors"] if len(shards) == 1 else \
        [f"draft-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for old in p.glob("draft*.safetensors"):
        if old.name not in names:
            old.unlink()
    for name, shard in zip(names, shards):
        tmp = p / (name + ".tmp")
        save_file(shard, str(tmp), metadata={"format": FORMAT})
        tmp.chmod(0o644)  # safetensors writes 0600; a shipped draft is read by whoever serves it
        tmp.replace(p / name)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for n, t in tensors.items() if n != "vocab_ids"})
    cfg = {"format": FORMAT, "version": 3, "num_layers": len(stack), "chain": stack.chain,
           "dtype": dtypes[0] if len(dtypes) == 1 else dtypes, "files": names,
           "draft_vocab_size": None if stack.vocab_ids is None else int(stack.vocab_ids.numel()),
           "blocks_per_layer": stack.blocks_per_layer, "aux_layers": list(stack.aux_layers),
           "tied_blocks": {str(k): j for k, j in sorted(stack.tied.items())},
           "arch": stack.arch.model_dump(mode="json")}
    if auto_depths is not None:
        cfg["auto_depths"] = sorted(set(auto_depths))
    if auto_depths_by_device:
        cfg["auto_depths_by_device"] = {k: sorted(set(v)) for k, v in sorted(auto_depths_by_device.items())}
    (p / "draft_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return [p / n for n in names]


def load_layer(m: MTPLayer, w: dict[str, torch.Tensor], grow: bool = False) -> None:
    """Load one layer from names relative to the layer (`enorm.weight`, `block.self_attn...`).

    `grow`: `w` may come from a smaller layer (fewer blocks, no fused features); the parts it lacks are
    set so that the layer computes exactly what the smaller one did: `aux_proj` zero, and each missing
    block an identity (its output projections zero, the rest left as initialised), so training grows
    the draft from where it was. Without `grow` every weight must be there."""
    with torch.no_grad():
        m.enorm.weight.copy_(w["enorm.weight"])
        m.hnorm.weight.copy_(w["hnorm.weight"])
        m.eh_proj.weight.copy_(w["eh_proj.weight"])
        m.norm.weight.copy_(w["norm.weight"])
        if m.aux:
            if "aux_proj.weight" in w:
                m.aux_proj.weight.copy_(w["aux_proj.weight"])
                for i, n in enumerate(m.anorm):
                    n.weight.copy_(w[f"anorm.{i}.weight"])
            elif grow:
                m.aux_proj.weight.zero_()
            else:
                raise KeyError("aux_proj.weight")
        for i, b in enumerate(m.blocks):
            p = block_prefix(i)
            if f"{p}.input_layernorm.weight" in w:
                b.load(w, p)
            elif grow:
                b.self_attn.o_proj.weight.zero_()
                b.mlp.down_proj.weight.zero_()
            else:
                raise KeyError(f"{p}.input_layernorm.weight")


@dataclass
class DraftCheckpoint:
    arch: ModelArch
    chain: bool
    layers: list[dict[str, torch.Tensor]]  # per layer, names relative to the layer
    vocab_ids: torch.Tensor | None = None  # reduced draft vocabulary (target ids), or None
    blocks: int = 1  # decoder blocks per draft step
    aux_layers: tuple[int, ...] = ()  # target layers whose streams layer 0 also reads
    tied: dict[int, int] = field(default_factory=dict)  # layer → the layer whose blocks it runs (copied in)
    auto_depths: tuple[int, ...] | None = None  # the depths `auto` chooses between by default (None: 0 and S)
    auto_depths_by_device: dict[str, tuple[int, ...]] = field(default_factory=dict)  # device type -> its own

    def depths_for(self, device: str) -> tuple[int, ...] | None:
        """The depths `auto` chooses between on `device` (a device type: "cuda", "cpu")."""
        return self.auto_depths_by_device.get(device, self.auto_depths)


def load_draft(path: str | Path, target: ModelArch) -> DraftCheckpoint:
    """Read a draft folder: own format (v1 or sharded v2), or an imported MTP checkpoint."""
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"draft {path!r}: not a folder (expected draft_config.json + draft.safetensors, "
                                "or random:S[:seed], or none)")
    own = p / "draft_config.json"
    if not own.is_file():
        arch, chain, layers = import_mtp(p, target)
        return DraftCheckpoint(arch, chain, layers)
    cfg = json.loads(own.read_text())
    if cfg.get("format") != FORMAT:
        raise ValueError(f"draft {path}: unknown format {cfg.get('format')!r}")
    arch = ModelArch.model_validate(cfg["arch"])
    flat: dict[str, torch.Tensor] = {}
    for name in cfg.get("files", ["draft.safetensors"]):
        f = p / name
        if not f.is_file():
            raise FileNotFoundError(f"draft {path}: weight file {name} is missing (draft_config.json lists it)")
        flat.update(load_file(str(f)))
    n = int(cfg["num_layers"])
    layers = [{k[len(f"layers.{i}."):]: t for k, t in flat.items() if k.startswith(f"layers.{i}.")} for i in range(n)]
    empty = [i for i, w in enumerate(layers) if not w]
    if empty:
        raise ValueError(f"draft {path}: no weights for layer(s) {empty}")
    vocab = flat.get("vocab_ids")
    if vocab is not None and cfg.get("draft_vocab_size") not in (None, vocab.numel()):
        raise ValueError(f"draft {path}: vocab_ids has {vocab.numel()} ids, the config says {cfg['draft_vocab_size']}")
    blocks, aux = int(cfg.get("blocks_per_layer", 1)), tuple(int(i) for i in cfg.get("aux_layers") or ())
    tied = {int(k): int(j) for k, j in (cfg.get("tied_blocks") or {}).items()}
    try:
        check_ties(tied, n)
    except ValueError as err:
        raise ValueError(f"draft {path}: {err}") from None
    for k, j in tied.items():  # the source's block weights, under this layer's names (the same tensors)
        layers[k] |= {name: t for name, t in layers[j].items() if name.startswith("block")}
    for k, w in enumerate(layers):
        want = [f"{block_prefix(i)}.input_layernorm.weight" for i in range(blocks)]
        want += ["aux_proj.weight"] if k == 0 and aux else []
        lack = [n for n in want if n not in w]
        if lack:
            raise ValueError(f"draft {path}: layer {k} lacks {lack} (blocks_per_layer={blocks}, aux_layers={list(aux)})")
    def depth_list(key: str, v: object) -> tuple[int, ...]:
        if not isinstance(v, list) or not all(isinstance(d, int) and 0 <= d <= n for d in v):
            raise ValueError(f"draft {path}: {key} {v!r} must be a list of depths in 0..{n}")
        return tuple(v)

    depths = cfg.get("auto_depths")
    by_device = cfg.get("auto_depths_by_device") or {}
    if not isinstance(by_device, dict):
        raise ValueError(f"draft {path}: auto_depths_by_device {by_device!r} must map a device type to depths")
    return DraftCheckpoint(arch, bool(cfg.get("chain", True)), layers, vocab, blocks, aux, tied,
                           depth_list("auto_depths", depths) if depths is not None else None,
                           {str(k): depth_list(f"auto_depths_by_device[{k!r}]", v) for k, v in by_device.items()})


def read_draft(path: str | Path, target: ModelArch) -> tuple[ModelArch, bool, list[dict[str, torch.Tensor]]]:
    """(arch, chain, layers) of a draft folder; `load_draft` also gives its draft vocabulary."""
    c = load_draft(path, target)
    return c.arch, c.chain, c.layers


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
        w: dict[str, torch.Tensor] = {
            key: g[key] for key in ("enorm.weight", "hnorm.weight", "eh_proj.weight") if key in g}
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


def random_layer_weights(arch: ModelArch, seed: int, k: int, blocks: int = 1, aux: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + k)
    h, i = arch.hidden_size, arch.intermediate_size
    assert arch.head_dim is not None
    hq, hk = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    w = {"enorm.weight": torch.ones(h), "hnorm.weight": torch.ones(h), "eh_proj.weight": r(h, 2 * h),
         "norm.weight": torch.ones(h)}
    for j in range(blocks):
        p = block_prefix(j)
        w |= {f"{p}.input_layernorm.weight": torch.ones(h), f"{p}.post_attention_layernorm.weight": torch.ones(h),
              f"{p}.self_attn.q_proj.weight": r(hq, h), f"{p}.self_attn.k_proj.weight": r(hk, h),
              f"{p}.self_attn.v_proj.weight": r(hk, h), f"{p}.self_attn.o_proj.weight": r(h, hq),
              f"{p}.mlp.gate_proj.weight": r(i, h), f"{p}.mlp.up_proj.weight": r(i, h),
              f"{p}.mlp.down_proj.weight": r(h, i)}
        if arch.attention_bias:
            w |= {f"{p}.self_attn.q_proj.bias": torch.zeros(hq), f"{p}.self_attn.k_proj.bias": torch.zeros(hk),
                  f"{p}.self_attn.v_proj.bias": torch.zeros(hk)}
    if aux:
        w["aux_proj.weight"] = r(h, aux * h)
        w |= {f"anorm.{j}.weight": torch.ones(h) for j in range(aux)}
    return w
