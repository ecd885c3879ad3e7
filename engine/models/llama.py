"""Llama-family decoder (Llama 2/3, Qwen2, SmolLM, Mistral without sliding window).

RMSNorm, RoPE (plain or Llama-3 scaled), GQA attention through the bound backend, SwiGLU MLP; fused
QKV and gate/up projections (column-parallel) and row-parallel output projections; a vocab-parallel
embedding and a tied or untied head. The decoder carries the residual stream beside the hidden state
(vLLM style), so each residual add is fused into the RMSNorm after it; the attention backend takes the
fused QKV output and does rotary, the KV store and attention itself. On CUDA a decode layer is then
nine launches: two add-RMSNorms, four GEMMs, attention (with rotary and the store), SiLU-and-mul.
`forward` returns the last layer's hidden states before the final norm (the residual stream after the
last layer: what draft layers consume), followed, when a draft reads fused features (`aux_layers`), by
the streams after those layers ([T, H·(1+A)]); `logits` applies the final norm and the head to the rows the
batch asks for (`compute_logits` to given rows). Weights load from HF-named tensors.

Tensor parallelism (`tp`, `layout`): heads, MLP columns, the embedding and the head are sharded. In
the all-reduce layout the row-parallel projections all-reduce. In the token-scattered layout each
rank carries its T_pad/N rows of the residual stream: the row-parallel outputs are reduce-scattered,
the fused add-RMSNorm runs on the rank's rows, and the normed rows are all-gathered (sized by the
forward's `global_num_tokens`) before attention and the MLP; the last stream is all-gathered for the
consumers (draft layers) and the head gathers only its logit rows (`ParallelLMHead.logits`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from mleagle.engine.contract.config import ModelArch
from mleagle.engine.distributed import LOCAL, Comm, TPGroup, comm_for, current
from mleagle.engine.executor.forward_batch import ForwardBatch
from mleagle.engine.layers.activation import SiluAndMul
from mleagle.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from mleagle.engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from mleagle.engine.layers.module_list import ModuleListOf
from mleagle.engine.layers.norm import RMSNorm
from mleagle.engine.layers.rope import RotaryEmbedding

if TYPE_CHECKING:
    from mleagle.engine.attention.base import AttentionBackend


class Attention(nn.Module):
    def __init__(self, a: ModelArch, layer_id: int, rope: RotaryEmbedding, dtype: torch.dtype,
                 tp: TPGroup | None = None):
        super().__init__()
        assert a.head_dim is not None
        tp = tp or current()
        self.layer_id, self.rope, self.d = layer_id, rope, a.head_dim
        hd = a.head_dim
        self.qkv_proj = QKVParallelLinear(a.hidden_size, a.num_attention_heads, a.num_key_value_heads, hd,
                                          bias=a.attention_bias, dtype=dtype, tp=tp)
        self.hq, self.hk = self.qkv_proj.hq, self.qkv_proj.hk  # this rank's query and KV heads
        self.o_proj = RowParallelLinear(a.num_attention_heads * hd, a.hidden_size, dtype=dtype, tp=tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch, reduce: bool = True) -> torch.Tensor:
        assert batch.binding is not None
        # The bound backend rotates q and k, stores k and v in its own pool, and attends. A binding's
        # backend is always an AttentionBackend; the binding's Backend protocol names only what the
        # executor needs of it.
        backend = cast("AttentionBackend", batch.binding.backend)
        o = backend.forward(self.layer_id, self.qkv_proj(x), positions, self.rope, batch)
        return self.o_proj(o, reduce)


class MLP(nn.Module):
    def __init__(self, a: ModelArch, dtype: torch.dtype, tp: TPGroup | None = None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(a.hidden_size, [a.intermediate_size] * 2, dtype=dtype, tp=tp)
        self.down_proj = RowParallelLinear(a.intermediate_size, a.hidden_size, dtype=dtype, tp=tp)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)), reduce)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArch, layer_id: int, rope: RotaryEmbedding, dtype: torch.dtype,
                 tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or current()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.self_attn = Attention(a, layer_id, rope, dtype, self.tp)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.mlp = MLP(a, dtype, self.tp)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch, comm: Comm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) → (h', residual'): the layer's input stream is h + residual (h alone for the
        first layer, residual None); its output stream is h' + residual'. Token-scattered (`comm`), h and
        residual are this rank's rows; attention and the MLP see every token, gathered after the norm."""
        sc = comm is not None and comm.scattered and self.tp.size > 1
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        if sc:
            assert comm is not None
            x = comm.gather_tokens(x)
            h = comm.scatter_tokens(self.self_attn(positions, x, batch, reduce=False))
            x, residual = self.post_attention_layernorm(h, residual)
            return comm.scatter_tokens(self.mlp(comm.gather_tokens(x), reduce=False)), residual
        h = self.self_attn(positions, x, batch)
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual

    def load(self, w: dict[str, torch.Tensor], p: str) -> None:
        self.input_layernorm.weight.data.copy_(w[f"{p}.input_layernorm.weight"])
        self.post_attention_layernorm.weight.data.copy_(w[f"{p}.post_attention_layernorm.weight"])
        for i, n in enumerate("qkv"):
            self.self_attn.qkv_proj.load_part(i, w[f"{p}.self_attn.{n}_proj.weight"], w.get(f"{p}.self_attn.{n}_proj.bias"))
        self.self_attn.o_proj.load(w[f"{p}.self_attn.o_proj.weight"])
        self.mlp.gate_up_proj.load_part(0, w[f"{p}.mlp.gate_proj.weight"])
        self.mlp.gate_up_proj.load_part(1, w[f"{p}.mlp.up_proj.weight"])
        self.mlp.down_proj.load(w[f"{p}.mlp.down_proj.weight"])


class LlamaForCausalLM(nn.Module):
    def __init__(self, a: ModelArch, dtype: torch.dtype, max_positions: int | None = None,
                 tp: TPGroup | None = None, layout: str = "all_reduce"):
        super().__init__()
        assert a.head_dim is not None
        self.arch, self.dtype = a, dtype
        self.tp, self.layout = tp or current(), layout
        self.rope = RotaryEmbedding(a.head_dim, max_positions or a.max_position_embeddings, a.rope_theta,
                                    a.rope_scaling, dtype)
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, dtype, self.tp)
        self.layers = ModuleListOf(DecoderLayer(a, i, self.rope, dtype, self.tp) for i in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(a.vocab_size, a.hidden_size, dtype,
                                      tied=self.embed_tokens if a.tie_word_embeddings else None, tp=self.tp)
        # Layers whose output streams `forward` appends to the last one (set by a draft that reads them).
        self.aux_layers: tuple[int, ...] = ()

    @property
    def num_kv_layers(self) -> int:
        return len(self.layers)

    @property
    def tp_size(self) -> int:
        return self.tp.size

    def comm(self, batch: ForwardBatch) -> Comm:
        return comm_for(self.tp, self.layout, batch) if self.tp.size > 1 else Comm(LOCAL)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        c = self.comm(batch)
        if c.scattered:
            h = c.scatter_tokens(self.embed_tokens(batch.input_ids, reduce=False))
        else:
            h = self.embed_tokens(batch.input_ids)
        res: torch.Tensor | None = None
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            h, res = layer(batch.positions, h, res, batch, c)
            if i in self.aux_layers:
                aux.append(h + res)
        assert res is not None  # set by the first layer
        s = h + res
        if aux:
            s = torch.cat([s, *aux], dim=-1)
        return c.gather_tokens(s) if c.scattered else s

    def logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Logits of the batch's logit rows from `forward`'s hidden states (every row on every rank)."""
        return self.lm_head.logits(self._last(hidden), batch.logit_rows, self.norm, self.comm(batch))

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self._last(h)))

    def _last(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's stream of `forward`'s output (the first H columns when aux streams follow)."""
        return hidden[..., : self.arch.hidden_size] if self.aux_layers else hidden

    @torch.no_grad()
    def load_weights(self, w: dict[str, torch.Tensor]) -> None:
        """Load HF-named tensors, consuming the dict as it goes so no second copy lingers."""
        self.embed_tokens.load(w.pop("model.embed_tokens.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            layer.load(w, p)
            for k in [k for k in w if k.startswith(p + ".")]:
                del w[k]
        self.norm.weight.data.copy_(w.pop("model.norm.weight"))
        if not self.arch.tie_word_embeddings:
            self.lm_head.load(w.pop("lm_head.weight"))
        else:
            w.pop("lm_head.weight", None)
