"""Training a chain MTP draft on the target's own outputs, exactly as the chain unrolls when serving.

Per batch of token sequences (prompt + the target's response, `train_data`), the frozen target runs
one dense causal forward and gives its last hidden states before the final norm, h_p (recomputed
on the fly: storing them would cost 1 KB per token per layer, recomputing costs one forward). Draft
layer k at position p then reads what it reads in the engine's draft prefill and draft-extend: the
hidden of layer k-1 at p (the target's for k = 0; the draft's own output, not the target's, with
gradients flowing through the chain), the token t_{p+k+1} through the shared embedding, and, by
causal attention, its own layer's keys and values at positions <= p; it predicts t_{p+k+2} through
its own final norm and the draft head (the target's head, or its rows for a reduced vocabulary).
Layer 0 of a draft with fused features also reads the target's streams after `aux_layers`, and a step
with several blocks runs them in order (`mtp_forward`).
`tests/engine/test_spec_train.py` checks that this forward's hidden states and logits equal the engine's
draft runners' on the same sequence (float32), so training and serving cannot drift apart.

The loss of layer k at p is forward KL to the target's distribution at the same position (the
target's logits at p+k+1, restricted to the draft vocabulary and renormalised), optionally mixed with
cross-entropy on the data token where the response was generated greedily (the token is then the
target's argmax, what greedy verification checks); the default is KL alone, which generalised
better than hard labels or a mix in the tiny experiments (results/DRAFT_TRAINING.md). The KL uses the full (draft) vocabulary, not a top-k: the teacher
is recomputed per batch anyway, so the full distribution costs one more head GEMM, and it is exact.
The head GEMMs and softmaxes run in row chunks inside one autograd function (`distill_loss`) that
recomputes the chunk's logits in backward, so no [N, V] tensor outlives a chunk (~200 MB per chunk
instead of several GB per layer). Depth k's loss is weighted by `depth_weights[k]`.

AdamW (decoupled weight decay), linear warm-up then cosine decay driven by progress =
max(step / planned steps, elapsed / time budget), gradient clipping, bf16 autocast on CUDA (float32
master weights), a fixed seed, periodic checkpoints of everything needed to resume (weights,
optimizer, epoch and position, elapsed time) and a progress line with loss and top-1 agreement with
the target per depth.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mleagle.engine.models.llama import DecoderLayer, LlamaForCausalLM
from mleagle.engine.spec.draft_model import DraftStack, MTPLayer
from mleagle.engine.spec.train_data import Batch, Seq, collate, length_batches


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class TrainConfig:
    layers: int = 3
    blocks: int = 1  # decoder blocks per draft step
    aux_layers: list[int] = field(default_factory=list)  # target layers whose streams layer 0 also reads
    tied: dict[int, int] = field(default_factory=dict)  # layer → the layer whose blocks it runs (shared)
    epochs: float = 4.0  # at most this many passes over the training data
    steps: int | None = None  # at most this many optimizer steps (None: epochs decide)
    time_budget_s: float | None = None  # stop (and finish the LR schedule) after this much training time
    lr: float = 6e-4
    min_lr_frac: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    batch_tokens: int = 16384  # padded tokens per optimizer step
    max_len: int = 2048  # sequences are cut to this many tokens
    kl_weight: float = 1.0  # loss = kl_weight·KL(target ‖ draft) + ce_weight·CE(greedy data token)
    ce_weight: float = 0.0  # hard labels generalise worse (results/DRAFT_TRAINING.md)
    # Total variation between target and draft at `tv_temperature`: 1 - TV is the sampled acceptance there,
    # so this term aims at temperature-sampled serving (0: off). Its complement is reported per depth anyway.
    tv_weight: float = 0.0
    tv_temperature: float = 0.7
    depth_weights: list[float] = field(default_factory=list)  # per layer; default 0.8**k
    prompt_weight: float = 0.0  # weight of KL at prompt positions (the target's distribution exists there too)
    init: str = "random"  # "random" (as EAGLE); "last": blocks start as the target's last layer
    amp: bool = True  # bf16 autocast where CUDA is used
    chunk_rows: int = 4096  # rows per chunk of the head/softmax in the loss
    seed: int = 0
    log_every_s: float = 10.0
    ckpt_every_s: float = 120.0

    def weights(self) -> list[float]:
        w = self.depth_weights or [0.8**k for k in range(self.layers)]
        if len(w) != self.layers:
            raise ValueError(f"depth_weights has {len(w)} values for {self.layers} layers")
        return list(w)


def amp_ctx(model: LlamaForCausalLM, on: bool) -> Any:
    """Autocast for a training or teacher forward: bf16 on CUDA when asked, and always in the dtype of a
    target loaded in half precision (its weights meet the float32 draft's activations)."""
    w = model.embed_tokens.weight
    if w.dtype != torch.float32:
        return torch.autocast(w.device.type, dtype=w.dtype)
    return torch.autocast("cuda", dtype=torch.bfloat16) if on and w.device.type == "cuda" else nullcontext()


# --- the dense forward (training and teacher): the engine's math without a paged KV --------------------
def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the engine computes it: float32 statistics, cast back, then the weight."""
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_tables(model: LlamaForCausalLM, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, D] in float32 for positions 0..n-1, from the same frequencies as the engine's RoPE."""
    from mleagle.engine.layers.rope import inv_freq

    a = model.arch
    assert a.head_dim is not None
    f = torch.outer(torch.arange(n, dtype=torch.int64).float(), inv_freq(a.head_dim, a.rope_theta, a.rope_scaling))
    emb = torch.cat([f, f], dim=-1).to(device)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return (x * cos + rot * sin).to(x.dtype)


def dense_block(b: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One decoder block over [B, T, H] with causal attention over its own positions (positions 0..T-1).

    Reads the block's weights directly (fused q|k|v and gate|up as stored) with plain torch ops, so
    it stays differentiable whatever fused kernels the serving forward uses."""
    a = b.self_attn
    eps = b.input_layernorm.eps
    bs, t, _ = x.shape
    hq, hk, d = a.hq, a.hk, a.d
    y = rms(x, b.input_layernorm.weight, eps)
    qkv = F.linear(y, a.qkv_proj.weight, a.qkv_proj.bias)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    c, s = cos[:t].view(1, t, 1, d), sin[:t].view(1, t, 1, d)
    q = _rotate(q.view(bs, t, hq, d), c, s).transpose(1, 2)
    k = _rotate(k.view(bs, t, hk, d), c, s).transpose(1, 2)
    v = v.view(bs, t, hk, d).transpose(1, 2)
    if hk != hq:
        k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True)
    x = x + F.linear(o.transpose(1, 2).reshape(bs, t, hq * d), a.o_proj.weight, a.o_proj.bias)
    y = rms(x, b.post_attention_layernorm.weight, b.post_attention_layernorm.eps)
    g, u = F.linear(y, b.mlp.gate_up_proj.weight).chunk(2, dim=-1)
    return x + F.linear(F.silu(g) * u, b.mlp.down_proj.weight)


@torch.no_grad()
def target_hidden(model: LlamaForCausalLM, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  aux_layers: Sequence[int] = ()) -> torch.Tensor:
    """[B, T, H]: the target's last decoder layer output before the final norm (draft layer 0's input),
    followed by the streams after `aux_layers` ([B, T, H·(1+A)], as the engine's target returns them)."""
    h = F.embedding(ids, model.embed_tokens.weight)
    aux = []
    for i, layer in enumerate(model.layers):
        h = dense_block(layer, h, cos, sin)
        if i in aux_layers:
            aux.append(h)
    return torch.cat([h, *aux], dim=-1) if aux else h


def mtp_forward(m: MTPLayer, h: torch.Tensor, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Draft layer over [B, T]: h = the previous layer's (or the target's) hidden at p (with the fused
    target streams for a layer that reads them), ids = t_{p+k+1}. The layer's own `fuse` (on [B, T, ·]
    its norms take the differentiable torch path), then every block."""
    x = m.fuse(F.embedding(ids, m._shared[0].weight), h)
    for b in m.blocks:
        x = dense_block(b, x, cos, sin)
    return x


def shifted(ids: torch.Tensor, s: int) -> torch.Tensor:
    """ids[:, p + s] at p (0 past the end)."""
    out = torch.zeros_like(ids)
    if s < ids.shape[1]:
        out[:, : ids.shape[1] - s] = ids[:, s:]
    return out


@torch.no_grad()
def stack_logits(model: LlamaForCausalLM, stack: DraftStack, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Teacher-forced hidden states [B, T, H] and logits [B, T, Vd] of every draft layer over `ids`
    (layer k at p reads t_{p+k+1}); what the engine's draft runners compute on the same sequence."""
    cos, sin = rope_tables(model, ids.shape[1], ids.device)
    h = target_hidden(model, ids, cos, sin, stack.aux_layers)
    hs, logits = [], []
    for k, m in enumerate(stack.layers):
        h = mtp_forward(m, h, shifted(ids, k + 1), cos, sin)
        hs.append(h)
        logits.append(F.linear(rms(h, m.norm.weight, m.norm.eps), head_weight(model, stack)))
    return hs, logits


def head_weight(model: LlamaForCausalLM, stack: DraftStack) -> torch.Tensor:
    w = stack.head.weight
    return model.lm_head.weight if w is None else w


# --- the loss --------------------------------------------------------------------------------------------
class _Distill(torch.autograd.Function):
    """Σ_rows row_w·(kl_w·KL(p_t ‖ q) + ce_w·CE(q, label) + tv_w·TV(p_t^τ, q^τ)) over chunks of rows, logits
    recomputed in backward. TV(a, b) = ½Σ|a - b| between both distributions at temperature τ: 1 - TV is
    the chance that a draft sampled from q^τ is accepted against p_t^τ (rejection sampling), so the TV
    term aims at sampled acceptance directly.

    d/dlogits of the row's term = row_w·(kl_w·(q - p_t) + ce_w·[label ≥ 0]·(q - onehot(label))
    + tv_w/τ·q^τ⊙(s - Σ q^τ s)), s = ½·sign(q^τ - p_t^τ).
    Also returns (unweighted) statistics: Σ KL, Σ CE, #CE rows, #rows whose argmax equals the target's
    (`top`: the target's argmax over its whole vocabulary, as a draft index or -1; None: over `w`'s rows),
    and Σ min(p_t^τ, q^τ) (the target renormalised to the draft's vocabulary: with a reduced one, an
    upper bound on the sampled acceptance) where `smin` asks for it or the TV term needs it, else 0:
    its two softmaxes cost about a tenth of the loss's forward and backward (measured on the CPU)."""

    @staticmethod
    def forward(ctx: Any, hd: torch.Tensor, ht: torch.Tensor, w: torch.Tensor, label: torch.Tensor, row_w: torch.Tensor,
                kl_w: float, ce_w: float, chunk: int, top: torch.Tensor | None, tv_w: float,
                tau: float, smin_stat: bool) -> tuple[torch.Tensor, torch.Tensor]:
        f = torch.promote_types(w.dtype, torch.float32)  # softmax in float32 (float64 stays, for tests)
        loss = torch.zeros((), dtype=f, device=hd.device)
        stats = torch.zeros(5, dtype=f, device=hd.device)
        for s in range(0, hd.shape[0], chunk):
            e = s + chunk
            ld = F.linear(hd[s:e].to(w.dtype), w).to(f)
            lt = F.linear(ht[s:e].to(w.dtype), w).to(f)
            lq, lp = ld.log_softmax(-1), lt.log_softmax(-1)
            kl = F.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
            lab = label[s:e]
            has = lab >= 0
            ce = -lq.gather(1, lab.clamp(min=0).unsqueeze(1)).squeeze(1) * has
            term = kl_w * kl + ce_w * ce
            smin = torch.zeros_like(kl)
            if tv_w or smin_stat:
                smin = torch.minimum((ld / tau).softmax(-1), (lt / tau).softmax(-1)).sum(-1)
                term = term + tv_w * (1 - smin)
            loss += (row_w[s:e] * term).sum()
            want = lt.argmax(-1) if top is None else top[s:e]
            stats += torch.stack([kl.sum(), ce.sum(), has.sum().to(f), (ld.argmax(-1) == want).sum().to(f), smin.sum()])
        ctx.save_for_backward(hd, ht, w, label, row_w)
        ctx.kl_w, ctx.ce_w, ctx.chunk, ctx.tv_w, ctx.tau = kl_w, ce_w, chunk, tv_w, tau
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _g_stats: torch.Tensor) -> tuple[Any, ...]:
        hd, ht, w, label, row_w = ctx.saved_tensors
        gh = torch.empty_like(hd)
        f = torch.promote_types(w.dtype, torch.float32)
        for s in range(0, hd.shape[0], ctx.chunk):
            e = s + ctx.chunk
            ld = F.linear(hd[s:e].to(w.dtype), w).to(f)
            lt = F.linear(ht[s:e].to(w.dtype), w).to(f)
            q, p = ld.softmax(-1), lt.softmax(-1)
            lab = label[s:e]
            has = (lab >= 0).to(f).unsqueeze(1)
            gl = ctx.kl_w * (q - p) + ctx.ce_w * has * q
            gl.scatter_add_(1, lab.clamp(min=0).unsqueeze(1), -ctx.ce_w * has)
            if ctx.tv_w:
                qt = (ld / ctx.tau).softmax(-1)
                sg = 0.5 * torch.sign(qt - (lt / ctx.tau).softmax(-1))
                gl += ctx.tv_w / ctx.tau * qt * (sg - (qt * sg).sum(-1, keepdim=True))
            gl *= (row_w[s:e].to(f) * g).unsqueeze(1)
            gh[s:e] = F.linear(gl.to(w.dtype), w.t()).to(hd.dtype)
        return gh, None, None, None, None, None, None, None, None, None, None, None


def distill_loss(hd: torch.Tensor, ht: torch.Tensor, w: torch.Tensor, label: torch.Tensor, row_w: torch.Tensor,
                 kl_w: float, ce_w: float, chunk: int = 4096, top: torch.Tensor | None = None, *,
                 tv_w: float = 0.0, tau: float = 0.7, smin: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """hd: draft rows after the draft's final norm [N, H]; ht: target rows after the target's final norm
    [N, H]; w: the draft head [Vd, H]; label: draft-vocabulary index of the data token or -1 (no CE);
    row_w: [N] weights; top: the target's full-vocabulary argmax as a draft index or -1 (with a reduced
    vocabulary, so that agreement counts a target token outside it as a miss); tv_w, tau: the weight of
    the total-variation term between both distributions at temperature tau; smin: compute Σ min(p^tau,
    q^tau) also without that term. Returns (weighted loss, stats [Σ KL, Σ CE, #CE rows, #argmax
    agreements, Σ min(p^tau, q^tau) or 0])."""
    return _Distill.apply(hd, ht.detach(), w.detach(), label, row_w.detach(), kl_w, ce_w, chunk, top, tv_w, tau, smin)


# --- the draft ---------------------------------------------------------------------------------------------
def init_stack(model: LlamaForCausalLM, layers: int, init: str = "last", seed: int = 0, hidden_rms: float = 1.0,
               vocab_ids: torch.Tensor | None = None, blocks: int = 1, aux_layers: Sequence[int] = (),
               tied: dict[int, int] | None = None) -> DraftStack:
    """A float32 chain stack on the target's device sharing its embedding, head and rope; trainable.

    "last": each block starts as the target's last decoder layer, the final norm as the target's,
    eh_proj as [0 | I] (passes the hidden through) and hnorm scaled to the hidden's RMS, so the
    stack starts close to a working layer; "random": small random weights (checkpoint.random_layer_weights).
    `tied` (layer → earlier layer): that layer runs the other's blocks, one set of weights trained at both
    depths (`DraftStack.tie_blocks`)."""
    from mleagle.engine.spec.checkpoint import load_layer, random_layer_weights

    if init not in ("last", "random"):
        raise ValueError(f"init must be 'last' or 'random', not {init!r}")
    arch = model.arch
    dev = model.embed_tokens.weight.device
    stack = DraftStack(arch, layers, True, torch.float32, model.embed_tokens, model.lm_head, model.rope,
                       vocab_ids=vocab_ids, blocks=blocks, aux_layers=tuple(aux_layers))
    layer_mods = list(stack.layers)
    stack.layers.to(dev)
    h = arch.hidden_size
    for k, m in enumerate(layer_mods):
        load_layer(m, random_layer_weights(arch, seed, k, blocks, m.aux))
        if init == "last":
            with torch.no_grad():
                src = dict(model.layers[-1].named_parameters())
                for b in m.blocks:
                    for n, p in b.named_parameters():
                        p.copy_(src[n].float())
                m.norm.weight.copy_(model.norm.weight.float())
                m.hnorm.weight.fill_(hidden_rms)  # the residual stream keeps the target's scale
                m.eh_proj.weight.zero_()
                m.eh_proj.weight[:, h:] = torch.eye(h)
    if tied:
        stack.tie_blocks(tied)
    for p in trainable(stack):
        p.requires_grad_(True)
    return stack


def trainable(stack: DraftStack) -> list[torch.nn.Parameter]:
    return [p for p in stack.layers.parameters()]


def named_trainable(stack: DraftStack) -> dict[str, torch.nn.Parameter]:
    return dict(stack.layers.named_parameters())


# --- training ----------------------------------------------------------------------------------------------
@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    pos: int = 0  # batches of the current epoch already done
    elapsed_s: float = 0.0
    tokens: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


class Trainer:
    """Trains `stack` on `seqs` against the frozen `model`; `run()` until epochs, steps or the time budget end."""

    def __init__(self, model: LlamaForCausalLM, stack: DraftStack, seqs: Sequence[Seq], cfg: TrainConfig,
                 ckpt_dir: str | Path | None = None, log_file: str | Path | None = None):
        if cfg.layers != len(stack):
            raise ValueError(f"config has {cfg.layers} layers, the stack {len(stack)}")
        if cfg.tied != stack.tied:
            raise ValueError(f"config has tied blocks {cfg.tied}; the stack {stack.tied}")
        if cfg.blocks != stack.blocks_per_layer or tuple(cfg.aux_layers) != stack.aux_layers:
            raise ValueError(f"config has blocks={cfg.blocks}, aux_layers={cfg.aux_layers}; the stack "
                             f"{stack.blocks_per_layer}, {list(stack.aux_layers)}")
        self.model, self.stack, self.seqs, self.cfg = model, stack, list(seqs), cfg
        self.device = model.embed_tokens.weight.device
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir else None
        self.log_file = Path(log_file) if log_file else None
        self.params = trainable(stack)
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                     fused=self.device.type == "cuda")
        self.state = TrainState()
        self.lens = [min(len(s), cfg.max_len) for s in self.seqs]
        self.per_epoch = len(length_batches(self.lens, cfg.batch_tokens, cfg.seed))
        total = math.ceil(cfg.epochs * self.per_epoch)
        self.total_steps = max(1, min(total, cfg.steps) if cfg.steps else total)
        self.depth_w = cfg.weights()
        vocab_ids = stack.vocab_ids
        v = model.arch.vocab_size
        # target id → draft-vocabulary index (-1 outside it)
        self.t2d = torch.arange(v, device=self.device)
        if vocab_ids is not None:
            self.t2d = torch.full((v,), -1, dtype=torch.int64, device=self.device)
            self.t2d[vocab_ids.to(self.device)] = torch.arange(len(vocab_ids), device=self.device)
        self.cos, self.sin = rope_tables(model, cfg.max_len, self.device)

    # --- one batch ---
    def layer_rows(self, b: Batch, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows where layer k learns: (flat row index, teacher row index, label (draft index or -1), weight)."""
        t = b.ids.shape[1]
        p = torch.arange(t, device=b.ids.device).unsqueeze(0)
        tgt = p + k + 2  # the position layer k at p predicts
        inside = tgt < b.lens.unsqueeze(1)
        resp = inside & (tgt >= b.n_prompt.unsqueeze(1))
        w = resp.float()
        if self.cfg.prompt_weight > 0:
            w = w + self.cfg.prompt_weight * (inside & ~resp).float()
        rows = w.flatten().nonzero().squeeze(1)
        lab = self.t2d[shifted(b.ids, k + 2).flatten()[rows]]
        ce_ok = (resp & b.greedy.unsqueeze(1)).flatten()[rows]
        lab = torch.where(ce_ok, lab, torch.full_like(lab, -1))
        trow = rows + k + 1  # the teacher's row for position p + k + 1 (same sequence: p + k + 1 < T)
        return rows, trow, lab, w.flatten()[rows]

    def batch_loss(self, b: Batch, grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Total weighted loss and per-layer stats [S, 6] (Σ KL, Σ CE, #CE rows, #agree, Σ min(p^τ, q^τ), #rows)."""
        cfg, m = self.cfg, self.model
        cos, sin = self.cos, self.sin
        w = head_weight(m, self.stack)
        with amp_ctx(m, cfg.amp):
            ht = target_hidden(m, b.ids, cos, sin, self.stack.aux_layers)
            d = m.arch.hidden_size
            ht_n = rms(ht[..., :d], m.norm.weight, m.norm.eps).flatten(0, 1)
            top_all = None
            if self.stack.vocab_ids is not None:  # the target's own argmax, over its whole vocabulary
                with torch.no_grad():
                    top_all = torch.cat([F.linear(ht_n[i : i + cfg.chunk_rows].to(m.lm_head.weight.dtype),
                                                  m.lm_head.weight).argmax(-1)
                                         for i in range(0, ht_n.shape[0], cfg.chunk_rows)])
            h = ht
            total = torch.zeros((), device=self.device)
            stats = []
            with torch.set_grad_enabled(grad):
                for k, layer in enumerate(self.stack.layers):
                    h = mtp_forward(layer, h, shifted(b.ids, k + 1), cos, sin)
                    rows, trow, lab, rw = self.layer_rows(b, k)
                    n = max(int(rows.numel()), 1)
                    hd = rms(h.flatten(0, 1)[rows], layer.norm.weight, layer.norm.eps)
                    top = None if top_all is None else self.t2d[top_all[trow]]
                    loss, st = distill_loss(hd, ht_n[trow], w, lab, rw / n, cfg.kl_weight, cfg.ce_weight, cfg.chunk_rows,
                                            top, tv_w=cfg.tv_weight, tau=cfg.tv_temperature, smin=not grad)
                    total = total + self.depth_w[k] * loss
                    stats.append(torch.cat([st, torch.tensor([float(rows.numel())], device=st.device)]))
        return total / sum(self.depth_w), torch.stack(stats)

    # --- schedule ---
    def lr_at(self, step: int, elapsed: float) -> tuple[float, float]:
        cfg = self.cfg
        progress = step / self.total_steps
        if cfg.time_budget_s:
            progress = max(progress, elapsed / cfg.time_budget_s)
        warm = min(1.0, (step + 1) / max(1, min(cfg.warmup, self.total_steps // 10 or 1)))
        cos = cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return cfg.lr * warm * cos, progress

    # --- checkpoints ---
    def save_state(self) -> None:
        if self.ckpt_dir is None:
            return
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        st = {"params": {n: p.detach().cpu() for n, p in named_trainable(self.stack).items()},
              "opt": self.opt.state_dict(), "state": asdict(self.state), "cfg": asdict(self.cfg),
              "vocab_ids": None if self.stack.vocab_ids is None else self.stack.vocab_ids.cpu(),
              "num_seqs": len(self.seqs)}
        tmp = self.ckpt_dir / "train_state.pt.tmp"
        torch.save(st, tmp)
        tmp.replace(self.ckpt_dir / "train_state.pt")

    def load_state(self) -> bool:
        f = self.ckpt_dir / "train_state.pt" if self.ckpt_dir else None
        if f is None or not f.is_file():
            return False
        st = torch.load(f, map_location=self.device, weights_only=False)
        if st["num_seqs"] != len(self.seqs):
            raise ValueError(f"{f}: saved with {st['num_seqs']} training sequences, now {len(self.seqs)}: "
                             "the data changed; start afresh (without --resume) or restore the data")
        for key in ("layers", "blocks", "aux_layers", "tied", "batch_tokens", "max_len", "seed"):
            saved = st["cfg"].get(key, getattr(TrainConfig(), key))  # states from before a key existed
            if saved != getattr(self.cfg, key):
                raise ValueError(f"{f}: saved with {key}={saved}, now {getattr(self.cfg, key)}")
        sv, cur = st["vocab_ids"], self.stack.vocab_ids
        same = (sv is None and cur is None) or (
            sv is not None and cur is not None and torch.equal(sv.cpu(), cur.cpu()))
        if not same:
            raise ValueError(f"{f}: saved with another draft vocabulary")
        with torch.no_grad():
            for n, p in named_trainable(self.stack).items():
                p.copy_(st["params"][n])
        self.opt.load_state_dict(st["opt"])
        self.state = TrainState(**st["state"])
        log(f"train: resumed at step {self.state.step} (epoch {self.state.epoch}, batch {self.state.pos}, "
            f"{self.state.elapsed_s:.0f}s trained)")
        return True

    # --- the loop ---
    def batches(self, epoch: int) -> list[list[int]]:
        return length_batches(self.lens, self.cfg.batch_tokens, self.cfg.seed * 7919 + epoch)

    def run(self, stop_at: int | None = None) -> dict[str, Any]:
        """Train until the planned steps, the epochs or the time budget end (or step `stop_at`, leaving the
        schedule as planned: an interrupted run that resumes ends where an uninterrupted one does)."""
        cfg, st, s = self.cfg, self.state, len(self.stack)
        torch.manual_seed(cfg.seed + st.step)
        self.stack.train()
        bar = _Progress(self.total_steps, st.step)
        acc = torch.zeros(s, 6, device=self.device)
        loss_acc = torch.zeros((), device=self.device)
        n_acc = 0
        t_start = time.perf_counter() - st.elapsed_s
        last_log = last_ckpt = time.perf_counter()
        order = self.batches(st.epoch)
        stop = "steps"
        while True:
            elapsed = time.perf_counter() - t_start
            lr, progress = self.lr_at(st.step, elapsed)
            if st.step >= self.total_steps or progress >= 1.0:
                stop = "time budget" if st.step < self.total_steps else "steps"
                break
            if stop_at is not None and st.step >= stop_at:
                stop = "stop_at"
                break
            if st.pos >= len(order):
                st.epoch, st.pos = st.epoch + 1, 0
                order = self.batches(st.epoch)
            b = collate([self.seqs[i] for i in order[st.pos]], cfg.max_len, self.device)
            st.pos += 1
            for g in self.opt.param_groups:
                g["lr"] = lr
            loss, stats = self.batch_loss(b)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
            self.opt.step()
            st.step += 1
            st.tokens += b.num_tokens
            acc += stats.detach()
            loss_acc += loss.detach()
            n_acc += 1
            now = time.perf_counter()
            st.elapsed_s = now - t_start
            if now - last_log >= cfg.log_every_s or st.step == self.total_steps:
                rec = self._record(acc, loss_acc, n_acc, lr, st.epoch + st.pos / max(len(order), 1))
                bar.update(st.step, rec)
                acc.zero_()
                loss_acc.zero_()
                n_acc = 0
                last_log = now
            if self.ckpt_dir is not None and now - last_ckpt >= cfg.ckpt_every_s:
                self.save_state()
                last_ckpt = now
        if n_acc:
            bar.update(st.step, self._record(acc, loss_acc, n_acc, lr, st.epoch + st.pos / max(len(order), 1)))
        bar.close()
        self.stack.eval()
        self.save_state()
        return {"steps": st.step, "epochs": round(st.epoch + st.pos / max(len(order), 1), 3), "stop": stop,
                "train_s": round(st.elapsed_s, 2), "tokens": st.tokens,
                "tok_s": round(st.tokens / max(st.elapsed_s, 1e-9), 1), "planned_steps": self.total_steps,
                "steps_per_epoch": self.per_epoch, "last": st.history[-1] if st.history else None}

    def _record(self, acc: torch.Tensor, loss: torch.Tensor, n: int, lr: float, epoch: float) -> dict[str, Any]:
        a = acc.cpu().double().numpy()
        st = self.state
        rec = {"step": st.step, "epoch": round(epoch, 3), "lr": lr, "loss": round(float(loss) / max(n, 1), 4),
               **per_depth(a, smin=self.cfg.tv_weight > 0),  # training steps skip the stat without the TV term
               "elapsed_s": round(st.elapsed_s, 1), "tok_s": round(st.tokens / max(st.elapsed_s, 1e-9), 1)}
        st.history.append(rec)
        if self.log_file is not None:
            with self.log_file.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        return rec

    @torch.no_grad()
    def evaluate(self, seqs: Sequence[Seq]) -> dict[str, list[float]]:
        """Teacher-forced KL, CE and top-1 agreement with the target per depth on `seqs`."""
        was = self.stack.training
        self.stack.eval()
        tot = torch.zeros(len(self.stack), 6, device=self.device)
        lens = [min(len(s), self.cfg.max_len) for s in seqs]
        for g in length_batches(lens, self.cfg.batch_tokens, 0):
            _, st = self.batch_loss(collate([seqs[i] for i in g], self.cfg.max_len, self.device), grad=False)
            tot += st
        self.stack.train(was)
        a = tot.cpu().double().numpy()
        return {**per_depth(a), "rows": [int(x) for x in a[:, 5].tolist()]}


def per_depth(a: np.ndarray, smin: bool = True) -> dict[str, list[float]]:
    """Per-depth means of `batch_loss`'s summed stats [S, 6]: KL, CE (over its rows), top-1 agreement,
    and (where it was computed) `smin`, Σ min(p^τ, q^τ): the chance a draft sampled at the TV
    temperature is accepted."""
    rows = np.maximum(a[:, 5], 1)
    out = {"kl": [round(x, 4) for x in (a[:, 0] / rows).tolist()],
           "ce": [round(x, 4) for x in (a[:, 1] / np.maximum(a[:, 2], 1)).tolist()],
           "acc": [round(x, 4) for x in (a[:, 3] / rows).tolist()]}
    if smin:
        out["smin"] = [round(x, 4) for x in (a[:, 4] / rows).tolist()]
    return out


class _Progress:
    """tqdm when stderr is a terminal and tqdm is installed; otherwise one line per log interval."""

    def __init__(self, total: int, start: int):
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=start, file=sys.stderr, dynamic_ncols=True, desc="train")
            except ImportError:
                pass
        self.total = total

    def update(self, step: int, rec: dict[str, Any]) -> None:
        d = " ".join(f"L{k} {lo:.3f}/{a:.3f}" for k, (lo, a) in enumerate(zip(rec["kl"], rec["acc"])))
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(f"loss {rec['loss']:.3f} kl/acc {d}", refresh=True)
        else:
            log(f"train: step {step}/{self.total} ep {rec['epoch']:.2f} lr {rec['lr']:.2e} loss {rec['loss']:.3f} "
                f"kl/acc {d} {rec['tok_s']:.0f} tok/s {rec['elapsed_s']:.0f}s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def hidden_rms(model: LlamaForCausalLM, seqs: Sequence[Seq], n: int = 8) -> float:
    """Median RMS of the target's last hidden over a few sequences (the scale `init='last'` keeps)."""
    dev = model.embed_tokens.weight.device
    vals = []
    for s in list(seqs)[:n]:
        ids = torch.from_numpy(s.ids[:512]).to(dev).unsqueeze(0)
        cos, sin = rope_tables(model, ids.shape[1], dev)
        with amp_ctx(model, True):
            h = target_hidden(model, ids, cos, sin)
        vals.append(h.float().pow(2).mean(-1).sqrt().flatten())
    return float(torch.cat(vals).median()) if vals else 1.0


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train_throughput(model: LlamaForCausalLM, cfg: TrainConfig, draft_vocab: int | None = None, seq_len: int = 512,
                     steps: int = 3) -> float:
    """Padded tokens per second of a training step at `cfg`'s shape (and draft vocabulary size), on random
    tokens with a throwaway stack and optimizer: what `train-draft all` splits its budget with."""
    dev = model.embed_tokens.weight.device
    t = min(seq_len, cfg.max_len)
    bs = max(1, cfg.batch_tokens // t)
    g = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(0, model.arch.vocab_size, (bs, t), generator=g)
    seqs = [Seq(ids[i].numpy(), t // 4) for i in range(bs)]
    vocab = torch.arange(draft_vocab) if draft_vocab and draft_vocab < model.arch.vocab_size else None
    tr = Trainer(model, init_stack(model, cfg.layers, "random", cfg.seed, vocab_ids=vocab, blocks=cfg.blocks,
                                   aux_layers=cfg.aux_layers, tied=cfg.tied), seqs, cfg)
    b = collate(seqs, t, dev)
    times = []
    for _ in range(steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, _ = tr.batch_loss(b)
        tr.opt.zero_grad(set_to_none=True)
        loss.backward()
        tr.opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    best = min(times[1:] or times)
    return b.num_tokens / best
