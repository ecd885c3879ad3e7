"""Kernel-versus-reference cases, shared by the CPU interpreter tests and the GPU tests.

Each case builds small seeded inputs, runs a kernel (or a GPU attention backend through its real
plan/forward API) and the torch reference (the torch backend, the layers' reference forwards) on
identical copies, and returns the largest error it found (0.0 for exact checks). Pools start
poisoned with a sentinel, slot maps are shuffled permutations, so a kernel that writes a wrong slot,
reads through the wrong map entry or mixes up GQA heads shows up as a large error.

Run as a script (`python tests/kernel_cases.py --interpret`), it sets TRITON_INTERPRET=1 before
anything imports Triton, runs every case on the CPU in float32 and prints a JSON object
{case: {"err": ..., "tol": ...}}: tests/engine/test_kernels_interp.py runs it in a subprocess so the rest of
the suite never sees the interpreter. tests/engine/test_kernels_gpu.py calls the same cases in-process on
CUDA (bf16, and FlashInfer).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

SENTINEL = -7.0


def tol(dtype: torch.dtype) -> float:
    return {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}[dtype]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / (1 + |ref|): absolute near zero, relative for large values (a bf16 ulp at 8 is
    0.06, and rounding once from float32 vs at every step of the reference differs by an ulp or two)."""
    g, r = got.float(), ref.float()
    return ((g - r).abs() / (1 + r.abs())).max().item() if r.numel() else 0.0


# --- attention setups -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Shape:
    hq: int = 6
    hk: int = 2
    d: int = 64
    slots: int = 2400  # 7 requests x 342 slots: every position of every request has its own slot
    max_reqs: int = 8
    max_ctx: int = 320


def _maps(shape: Shape, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Request-to-token rows: disjoint shuffled slots from 1 (slot 0 is the pad slot); row 0 stays
    all zeros (the reserved pad request row)."""
    r2t = torch.zeros(shape.max_reqs, shape.max_ctx, dtype=torch.int64)
    perm = torch.randperm(shape.slots - 1, generator=gen) + 1
    per = (shape.slots - 1) // (shape.max_reqs - 1)
    assert per >= shape.max_ctx, "every position needs its own slot (a shared slot makes the cases ill-posed)"
    for r in range(1, shape.max_reqs):
        r2t[r] = perm[(r - 1) * per : (r - 1) * per + shape.max_ctx]
    return r2t.to(device)


def _pair(backend: str, shape: Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> Any:
    """(reference, kernel): two (pool, map, backend) triples with identical, poisoned contents."""
    from mleagle.engine.attention import create_backend
    from mleagle.engine.memory.kv_pool import KVPool
    from mleagle.engine.memory.req_to_token import ReqToTokenPool

    r2t = _maps(shape, gen, device)
    k0 = torch.full((shape.slots, shape.hk, shape.d), SENTINEL, dtype=dtype)
    v0 = torch.full((shape.slots, shape.hk, shape.d), SENTINEL, dtype=dtype)
    out = []
    for name in ("torch", backend):
        pool = KVPool(f"{name}-pool", 1, shape.slots, shape.hk, shape.d, dtype, device)
        pool.k[0].copy_(k0)
        pool.v[0].copy_(v0)
        m = ReqToTokenPool(f"{name}-map", shape.max_reqs, shape.max_ctx, device)
        m.req_to_token[: r2t.shape[0]].copy_(r2t)  # the map's last row is the pad row (zeros)
        be = create_backend(name, pool, m, shape.hq)
        out.append((pool, m, be))
    return out


def _fill_prefix(pairs: Any, rows: list[int], prefix: list[int], dtype: torch.dtype, gen: torch.Generator) -> None:
    """Random K/V at every prefix position of each request, the same in both pools."""
    pool0 = pairs[0][0]
    r2t = pairs[0][1].req_to_token
    for r, p in zip(rows, prefix):
        if p:
            slots = r2t[r, :p]
            kk = torch.randn(p, *pool0.k[0].shape[1:], generator=gen).to(dtype).to(slots.device)
            vv = torch.randn(p, *pool0.v[0].shape[1:], generator=gen).to(dtype).to(slots.device)
            for pool, _, _ in pairs:
                pool.k[0][slots] = kk
                pool.v[0][slots] = vv


def run_attention(backend: str, mode: str, rows: list[int], prefix: list[int], extend: list[int], *,
                  dtype: torch.dtype, device: torch.device, shape: Shape | None = None, splits: int | None = None,
                  graph: bool = False, pad_to: int = 0, seed: int = 0, tile: Any = None) -> float:
    """One forward of `mode` through the reference and through `backend`; the largest error over the
    outputs and over both whole pools (a write to a wrong slot, or a missing one, shows there).

    `pad_to`: append pad requests (the reserved row 0, prefix 0, width W, all slots the pad slot 0) up to
    that batch size, as a graph runner does, and compare only the real rows (the reference runs unpadded).
    """
    from mleagle.engine.executor.forward_batch import ForwardMode, build_batch
    from mleagle.engine.executor.runner import StepBinding
    from mleagle.engine.layers.rope import RotaryEmbedding

    shape = shape or Shape()
    gen = torch.Generator().manual_seed(seed)
    pairs = _pair(backend, shape, dtype, device, gen)
    _fill_prefix(pairs, rows, prefix, dtype, gen)
    fm = ForwardMode(mode)
    width = extend[0] if fm.uniform else 1
    t = sum(extend)
    qkv = torch.randn(t, (shape.hq + 2 * shape.hk) * shape.d, generator=gen).to(dtype).to(device)
    rope = RotaryEmbedding(shape.d, shape.max_ctx + 8, 10000.0, None, dtype).to(device)
    outs = []
    for i, (pool, m, be) in enumerate(pairs):
        rr, pp, ee, x = list(rows), list(prefix), list(extend), qkv
        if i == 1 and pad_to > len(rows):
            n = pad_to - len(rows)
            rr, pp, ee = rr + [0] * n, pp + [0] * n, ee + [width] * n
            pad = torch.randn(n * width, qkv.shape[1], generator=gen).to(dtype).to(device)
            x = torch.cat([qkv, pad])
        if i == 1 and splits is not None:
            be.num_sms, be.max_kv_splits = 10**6, splits
        if i == 1 and tile is not None:  # the decode kernel's launch shape (Triton backend)
            be.tile = tile
        if i == 1 and graph:
            be.init_graph(max(len(rr), 1), width)
        b = build_batch(fm, input_ids=torch.zeros(len(x), dtype=torch.int64), req_pool_indices=rr, prefix_lens=pp,
                        extend_lens=ee, req_to_token=m.req_to_token.cpu(), width=width, device=device)
        b = dataclasses.replace(b, binding=StepBinding(pool.name, pool, m, be))
        be.plan(b)
        o = be.forward(0, x, b.positions, rope, b)
        outs.append(o[:t].float())
    ref_pool, pool = pairs[0][0], pairs[1][0]
    err = rel_err(outs[1], outs[0])
    # Pad rows write the pad slot 0, which the unpadded reference does not: compare the real slots then.
    lo = 1 if pad_to > len(rows) else 0
    err = max(err, rel_err(pool.k[0][lo:], ref_pool.k[0][lo:]))
    err = max(err, rel_err(pool.v[0][lo:], ref_pool.v[0][lo:]))
    return err


def graph_replay_err(backend: str, dtype: torch.dtype, device: torch.device, width: int = 1) -> float:
    """CUDA only. Capture one layer's `backend.forward` in a CUDA graph on a padded batch whose tensors are
    views of fixed buffers, then copy a later step (other lengths, other requests, new slots) into the
    same buffers, `plan` it and replay: the output and the pool equal the torch backend's eager forward
    of that step. Shows the backend reads its per-step values from the buffers at replay, not from
    whatever it saw at capture."""
    from mleagle.engine.executor.forward_batch import ForwardBatch, ForwardMode, build_batch
    from mleagle.engine.executor.runner import StepBinding
    from mleagle.engine.layers.rope import RotaryEmbedding

    shape = Shape(hq=9, hk=3, d=64)  # SmolLM2's attention
    gen = torch.Generator().manual_seed(11)
    (rpool, rmap, rbe), (pool, m, be) = _pair(backend, shape, dtype, device, gen)
    mode = ForwardMode.DECODE if width == 1 else ForwardMode.TARGET_VERIFY
    bs = 4  # the graph bucket; steps below use 3 real requests + 1 pad row (request row 0, slot 0)
    rope = RotaryEmbedding(shape.d, shape.max_ctx + 8, 10000.0, None, dtype).to(device)
    t = bs * width
    buf = {k: torch.zeros(t if k in ("positions", "out_cache_loc") else bs, dtype=torch.int64, device=device)
           for k in ("positions", "out_cache_loc", "req_pool_indices", "seq_lens")}
    qkv = torch.zeros(t, (shape.hq + 2 * shape.hk) * shape.d, dtype=dtype, device=device)

    def step(rows: list[int], prefix: list[int]) -> tuple[ForwardBatch, torch.Tensor]:
        _fill_prefix([(rpool, rmap, rbe), (pool, m, be)], rows, prefix, dtype, gen)
        pad = bs - len(rows)
        b = build_batch(mode, input_ids=torch.zeros(t, dtype=torch.int64), req_pool_indices=rows + [0] * pad,
                        prefix_lens=prefix + [0] * pad, extend_lens=[width] * bs, req_to_token=m.req_to_token.cpu(),
                        width=width, device=device)
        for k, v in buf.items():
            v.copy_(getattr(b, k))
        x = torch.randn(t, qkv.shape[1], generator=gen).to(dtype).to(device)
        qkv.copy_(x)
        fixed = dataclasses.replace(b, binding=StepBinding(pool.name, pool, m, be), **buf)
        real = len(rows) * width
        ref = build_batch(mode, input_ids=torch.zeros(real, dtype=torch.int64), req_pool_indices=rows,
                          prefix_lens=prefix, extend_lens=[width] * len(rows), req_to_token=rmap.req_to_token.cpu(),
                          width=width, device=device)
        ref = dataclasses.replace(ref, binding=StepBinding(rpool.name, rpool, rmap, rbe))
        rbe.plan(ref)
        return fixed, rbe.forward(0, x[:real], ref.positions, rope, ref)

    be.init_graph(bs, width)
    b1, _ = step([1, 2, 3], [5, 40, 7])
    be.plan(b1)
    be.forward(0, qkv, b1.positions, rope, b1)  # warm up (compiles), then capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        be.plan(b1)  # a capture through the runner's forward plans again: must record nothing
        out = be.forward(0, qkv, b1.positions, rope, b1)
    err = 0.0
    for rows, prefix in (([4, 2, 6], [130, 41, 0]), ([5, 1, 3], [200, 9, 60])):
        b, ref = step(rows, prefix)
        be.plan(b)
        g.replay()
        torch.cuda.synchronize()
        err = max(err, rel_err(out[: ref.shape[0]], ref))
        err = max(err, rel_err(pool.k[0][1:], rpool.k[0][1:]), rel_err(pool.v[0][1:], rpool.v[0][1:]))
    return err


# --- the cases --------------------------------------------------------------------------------------------
def case_rope_store(dtype: torch.dtype, device: torch.device) -> float:
    """rope_store alone: q as the reference rotates it; exactly the batch's slots written, with the
    rotated k and the raw v; every other slot still holds the sentinel (non-power-of-two head size)."""
    from mleagle.engine.kernels.attention import rope_store
    from mleagle.engine.layers.rope import RotaryEmbedding

    gen = torch.Generator().manual_seed(1)
    hq, hk, d, slots, t = 5, 1, 48, 64, 9
    rope = RotaryEmbedding(d, 128, 10000.0, None, dtype).to(device)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype).to(device)
    pos = torch.randint(0, 128, (t,), generator=gen).to(device)
    loc = (torch.randperm(slots - 1, generator=gen)[:t] + 1).to(device)
    kc = torch.full((slots, hk, d), SENTINEL, dtype=dtype, device=device)
    vc = torch.full((slots, hk, d), SENTINEL, dtype=dtype, device=device)
    q = rope_store(qkv, pos, rope.cos, rope.sin, loc, kc, vc, hq)
    qk = rope.rotate(pos, qkv[:, : (hq + hk) * d].view(t, hq + hk, d))
    err = rel_err(q, qk[:, :hq])
    err = max(err, rel_err(kc[loc], qk[:, hq:]))
    err = max(err, rel_err(vc[loc], qkv[:, (hq + hk) * d :].view(t, hk, d)))
    untouched = torch.ones(slots, dtype=torch.bool, device=device)
    untouched[loc] = False
    if not (bool((kc[untouched] == SENTINEL).all()) and bool((vc[untouched] == SENTINEL).all())):
        return float("inf")
    return err


def case_extend(dtype: torch.dtype, device: torch.device, backend: str = "triton") -> float:
    """EXTEND: three ragged requests, with and without a cached prefix, one longer than a query block."""
    return run_attention(backend, "EXTEND", [3, 1, 5], [0, 5, 37], [9, 1, 70], dtype=dtype, device=device)


def case_extend_d128(dtype: torch.dtype, device: torch.device, backend: str = "triton") -> float:
    """EXTEND at the 8B head shape (head 128, GQA 4)."""
    return run_attention(backend, "EXTEND", [2, 6], [3, 0], [20, 33], dtype=dtype, device=device,
                         shape=Shape(hq=8, hk=2, d=128))


def case_decode(dtype: torch.dtype, device: torch.device, backend: str = "triton", splits: int = 1,
                tile: Any = None) -> float:
    """DECODE: four requests of lengths 1..130 (ragged), GQA 3."""
    return run_attention(backend, "DECODE", [4, 2, 7, 1], [0, 16, 63, 129], [1, 1, 1, 1], dtype=dtype, device=device,
                         splits=splits, tile=tile)


def case_decode_tiles(dtype: torch.dtype, device: torch.device) -> float:
    """DECODE and TARGET_VERIFY with other launch shapes than the default: keys in blocks of 16 and of
    128 (longer than some requests, shorter than others), one and three pipeline stages, split and not."""
    from mleagle.engine.kernels.attention import DecodeTile

    err = case_decode(dtype, device, tile=DecodeTile(128, 8, 3))
    err = max(err, case_decode(dtype, device, splits=2, tile=DecodeTile(16, 2, 1)))
    return max(err, run_attention("triton", "TARGET_VERIFY", [5, 3, 6], [0, 20, 150], [4, 4, 4], dtype=dtype,
                                  device=device, splits=2, tile=DecodeTile(128, 4, 1)))


def case_decode_d128(dtype: torch.dtype, device: torch.device, backend: str = "triton", splits: int = 4) -> float:
    """DECODE at the 8B head shape (head 128, GQA 4: FlashInfer's tensor-core decode), split keys."""
    return run_attention(backend, "DECODE", [1, 3, 2], [200, 5, 60], [1, 1, 1], dtype=dtype, device=device,
                         splits=splits, shape=Shape(hq=8, hk=2, d=128))


def case_verify(dtype: torch.dtype, device: torch.device, backend: str = "triton", splits: int = 1) -> float:
    """TARGET_VERIFY, W=4: causal inside each request's window, prefixes 0..150."""
    return run_attention(backend, "TARGET_VERIFY", [5, 3, 6], [0, 20, 150], [4, 4, 4], dtype=dtype, device=device,
                         splits=splits)


def case_draft_extend_mqa(dtype: torch.dtype, device: torch.device, backend: str = "triton") -> float:
    """DRAFT_EXTEND, W=2, one KV head for four query heads, head 32."""
    return run_attention(backend, "DRAFT_EXTEND", [2, 4], [7, 40], [2, 2], dtype=dtype, device=device, splits=3,
                         shape=Shape(hq=4, hk=1, d=32))


def case_verify_padded(dtype: torch.dtype, device: torch.device, backend: str = "triton", graph: bool = True) -> float:
    """A graph-style padded batch: two real requests + two pad rows (request row 0, slot 0), after
    init_graph. The real rows match the unpadded reference, and every real slot (all but the pad slot 0)
    ends equal to the reference's pool."""
    return run_attention(backend, "TARGET_VERIFY", [3, 5], [11, 30], [3, 3], dtype=dtype, device=device,
                         splits=2, pad_to=4, graph=graph)


def case_add_rmsnorm(dtype: torch.dtype, device: torch.device) -> float:
    """Fused add + RMSNorm against the reference (SmolLM2's hidden 576, not a power of two): the
    normed output and the new residual; and the plain norm without a residual."""
    from mleagle.engine.kernels.norm import add_rmsnorm
    from mleagle.engine.layers.norm import rms_norm_ref

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 576, generator=gen).to(dtype).to(device)
    r = (torch.randn(7, 576, generator=gen) * 3).to(dtype).to(device)
    w = (torch.rand(576, generator=gen) + 0.5).to(dtype).to(device)
    y, s = add_rmsnorm(x, r, w, 1e-5)
    s_ref = x + r
    err = rel_err(y, rms_norm_ref(s_ref, w, 1e-5))
    assert s is not None
    err = max(err, rel_err(s, s_ref))
    y2, none = add_rmsnorm(x, None, w, 1e-5)
    assert none is None
    return max(err, rel_err(y2, rms_norm_ref(x, w, 1e-5)))


def case_silu_and_mul(dtype: torch.dtype, device: torch.device) -> float:
    """SiLU-and-mul over gate|up (SmolLM2's intermediate 1536: two column blocks)."""
    from mleagle.engine.kernels.activation import silu_and_mul
    from mleagle.engine.layers.activation import silu_and_mul_ref

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 2 * 1536, generator=gen) * 3).to(dtype).to(device)
    return rel_err(silu_and_mul(x), silu_and_mul_ref(x))


def case_fill_kv_indices(dtype: torch.dtype, device: torch.device) -> float:
    """The flat page list FlashInfer reads: exactly the map's first seq_len entries of each request."""
    from mleagle.engine.kernels.attention import fill_kv_indices

    gen = torch.Generator().manual_seed(4)
    r2t = torch.randint(0, 10**6, (6, 700), generator=gen).to(device)
    rpi = torch.tensor([4, 0, 2], device=device)
    seq = torch.tensor([600, 3, 1], device=device)
    indptr = torch.tensor([0, 600, 603, 604], dtype=torch.int32, device=device)
    out = torch.full((610,), -1, dtype=torch.int32, device=device)
    fill_kv_indices(r2t, rpi, seq, indptr, out)
    ref = torch.cat([r2t[4, :600], r2t[0, :3], r2t[2, :1]]).to(torch.int32)
    bad = int((out[:604] != ref).sum().item()) + int((out[604:] != -1).sum().item())
    return float(bad)


def case_engine_greedy(dtype: torch.dtype, device: torch.device) -> float:
    """End to end: greedy Engine.generate on a small chaotic model, speculative with a random 2-layer
    draft (each draft runner with its own pool and Triton backend) on the Triton backend, gives the
    torch backend's target-only tokens (prefill, verify and draft-extend through the kernels); returns
    the number of differing tokens."""
    from spec_helpers import greedy, run, tiny_cfg, tiny_engine

    prompts = [[1, 5, 9, 200, 17], list(range(10, 50))]
    dt = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]

    def toks(backend: str, draft: str = "none") -> list[int]:
        e = tiny_engine(draft, cfg=tiny_cfg(layers=2), device=device.type, dtype=dt, attention_backend=backend)
        return [t for ts in run(e, prompts, greedy(8)) for t in ts]

    ref, got = toks("torch"), toks("triton", "random:2")
    return float(sum(a != b for a, b in zip(ref, got)) + abs(len(ref) - len(got)))


def _spec_state(device: torch.device, s: int, gen: torch.Generator) -> Any:
    from mleagle.engine.executor.slot_state import SlotState

    st = SlotState(6, 64, s, device, [2])
    for t in (st.n_out, st.kv_len, st.iters, st.last_tok):
        t.copy_(torch.randint(0, 50, t.shape, generator=gen).to(device))
    return st


def _tied_logits(rows: int, v: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Coarse values with each row's maximum at random places, often twice in different argmax blocks:
    exact ties, where the lowest index must win (as in torch.argmax)."""
    x = torch.randint(-40, 8, (rows, v), generator=gen).float() / 4
    for r in range(rows):
        top = torch.randint(0, v, (1 + r % 2,), generator=gen)
        x[r, top] = 3.0
    return x.to(dtype).to(device)


def case_greedy_accept(dtype: torch.dtype, device: torch.device) -> float:
    """The fused greedy accept against the torch reference: verify rows over 3 argmax blocks with ties,
    drafts made to match 0..S leading rows, a padded batch (pad rows not live, sharing the pad row),
    and the benchmark's forced count; emitted tokens, n, packed rows, logit rows and every slot-state
    field must be equal (returns the number of differing entries)."""
    gen = torch.Generator().manual_seed(5)
    s, w, v = 3, 4, 4100
    bad = 0
    for sim in (-1, 2):
        rpi = torch.tensor([3, 0, 5, 6, 6], device=device)  # row 6 = the pad row, twice
        live = torch.tensor([True, True, True, False, False], device=device)
        logits = _tied_logits(5 * w, v, dtype, device, gen)
        pred = logits.float().argmax(-1).view(5, w)
        sts = [_spec_state(device, s, torch.Generator().manual_seed(9)) for _ in range(2)]
        for st in sts:  # request b's first b drafts match the target's rows (b = 3: all three)
            for b in range(5):
                st.drafts[rpi[b]] = torch.where(torch.arange(s, device=device) < b, pred[b, :s], pred[b, :s] + 1)
        outs = []
        for st, fused in zip(sts, (False, True)):
            forced = torch.tensor(sim, device=device) if sim >= 0 else None
            outs.append(st.verify_greedy(logits, w, rpi, live, forced, fused=fused))
        for a, b in zip(*outs):
            bad += int((a != b).sum())
        for f in ("last_tok", "n_out", "kv_len", "iters", "drafts"):
            bad += int((getattr(sts[0], f) != getattr(sts[1], f)).sum())
    return float(bad)


def case_greedy_draft_step(dtype: torch.dtype, device: torch.device) -> float:
    """The fused greedy draft step against the torch reference: argmax with ties over 3 blocks, mapped
    through a reduced vocabulary (and without one), written to the live rows' drafts, and the id window
    rotated with the new draft at each request's accepted count."""
    gen = torch.Generator().manual_seed(6)
    bad = 0
    for vocab in (None, torch.randperm(10000, generator=gen)[:6000].to(device)):
        rpi = torch.tensor([4, 1, 6], device=device)
        live = torch.tensor([True, True, False], device=device)
        logits = _tied_logits(3, 6000, dtype, device, gen)
        ids = torch.randint(0, 500, (3, 4), generator=gen).to(device)
        n = torch.tensor([0, 3, 1], device=device)
        sts = [_spec_state(device, 3, torch.Generator().manual_seed(7)) for _ in range(2)]
        outs = [st.draft_greedy(logits, vocab, rpi, 1, live, ids, n, fused=f) for st, f in zip(sts, (False, True))]
        for a, b in zip(*outs):
            bad += int((a != b).sum())
        bad += int((sts[0].drafts != sts[1].drafts).sum())
    return float(bad)


def case_draft_fuse_input(dtype: torch.dtype, device: torch.device) -> float:
    """A draft layer's input (token embedding and fused target features, 4 streams; and a chain layer
    without them) through the grouped input norm and the accumulated projections, against the
    reference's separate norms, concatenations and projections; SmolLM2's width 576."""
    from spec_helpers import tiny_cfg

    from mleagle.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from mleagle.engine.layers.rope import RotaryEmbedding
    from mleagle.engine.spec.draft_model import MTPLayer

    arch = tiny_cfg(hidden=576, heads=9, kv=3, inter=64).model.arch
    assert arch is not None
    gen = torch.Generator().manual_seed(8)
    torch.manual_seed(8)
    embed, head = VocabParallelEmbedding(arch.vocab_size, 576, dtype), ParallelLMHead(arch.vocab_size, 576, dtype)
    rope = RotaryEmbedding(64, 512, arch.rope_theta, None, dtype)
    err = 0.0
    for aux in (4, 0):
        layer = MTPLayer(arch, dtype, embed, head, rope, aux=aux)
        with torch.no_grad():
            for prm in layer.parameters():
                prm.copy_((torch.rand(prm.shape, generator=gen) * 0.1 + (0.5 if prm.dim() == 1 else -0.05)).to(dtype))
        layer.to(device)
        e = (torch.randn(5, 576, generator=gen) * 0.2).to(dtype).to(device)
        hin = (torch.randn(5, 576 * (1 + aux), generator=gen) * 4).to(dtype).to(device)
        with torch.no_grad():
            err = max(err, rel_err(layer.fuse_kernel(e, hin), layer.fuse_ref(e, hin)))
            layer.enorm.weight.mul_(2)  # an in-place change must reach the stacked weights
            err = max(err, rel_err(layer.fuse_kernel(e, hin), layer.fuse_ref(e, hin)))
    return err


CASES: dict[str, Callable[..., float]] = {
    "rope_store": case_rope_store,
    "extend": case_extend,
    "extend_d128": case_extend_d128,
    "decode": case_decode,
    "decode_split4": lambda dt, dev: case_decode(dt, dev, splits=4),
    "decode_tiles": case_decode_tiles,
    "decode_d128": case_decode_d128,
    "verify": case_verify,
    "verify_split3": lambda dt, dev: case_verify(dt, dev, splits=3),
    "draft_extend_mqa": case_draft_extend_mqa,
    "verify_padded": case_verify_padded,
    "add_rmsnorm": case_add_rmsnorm,
    "silu_and_mul": case_silu_and_mul,
    "fill_kv_indices": case_fill_kv_indices,
    "engine_greedy": case_engine_greedy,
    "greedy_accept": case_greedy_accept,
    "greedy_draft_step": case_greedy_draft_step,
    "draft_fuse_input": case_draft_fuse_input,
}


def main(argv: list[str]) -> int:
    if "--interpret" in argv:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    # --float16: the interpreter handles float16 (not bfloat16), a check of the low-precision tolerances.
    dtype = torch.float16 if "--float16" in argv else torch.float32
    names = [a for a in argv if not a.startswith("--")] or list(CASES)
    res = {}
    for n in names:
        err = CASES[n](dtype, torch.device("cpu"))
        res[n] = {"err": err, "tol": tol(dtype)}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
