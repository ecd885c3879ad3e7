"""Triton paged attention over per-token KV slots, and the fused rotary + KV store.

One rule covers every mode: query row i of request b sits at absolute position
`seq_lens[b] - extend_len[b] + i` and attends every key position j <= that position of its request,
the key's slot read through `req_to_token[req_pool_indices[b], j]`. The kernels read the slot map, the
request rows and the lengths straight from the batch's device tensors, so a CUDA graph captured once
replays correctly with new values in the same buffers, and no host-built metadata is needed.

- `rope_store` (EXTEND, and the FlashInfer backend): one program per token rotates q and k
  (rotate-half, cos/sin gathered by position), writes k and v into the pool at the token's slot and q
  into a fresh [T, Hq, D] tensor. Pad rows of a graph batch carry slot 0 (the reserved pad slot), so
  they never touch a real slot (the same holds in `decode_attention`).
- `decode_attention` (DECODE, TARGET_VERIFY, DRAFT_EXTEND: W rows per request): rotary, the K/V
  store and attention in one launch. One program per (request, KV head, KV split) holds the W·G
  query rows that share that KV head (G = Hq/Hk) as one [W·G, D] tile, so K and V are read once per
  KV head rather than once per query head, and the tile is at least 16 rows, which is what
  tensor-core `tl.dot` needs. The cached keys (positions < seq_len - W) come from the pool; the W
  keys of the window itself are rotated from the projection in registers, stored by the one program
  that owns them (the last split of each request and KV head) and attended causally from there, so
  no program ever reads a slot written in the same launch. Split-KV: the cached keys are cut into
  `num_splits` chunks, each program writes a partial output and its log-sum-exp, and `_merge_kernel`
  combines them. With few programs (batch 1 of a 3-KV-head model is 3 programs on a 132-SM GPU) that
  fills the SMs; at any batch it also cuts the longest request's keys, whose program the whole launch
  waits for (a served batch holds requests at every length: at bs 32 over MT-Bench its longest is
  ~1.4x a static batch's), so the default tile asks for at least 4 splits where it was measured
  (`decode_tile`). The split count is a host function of the padded batch size only (`num_kv_splits`
  and the tile), so a captured graph's grid stays valid at any length; the chunk size is computed on
  the device from the live length, and chunks past the end are empty.
- `extend_attention` (EXTEND: ragged prompt chunks with a cached prefix): one program per
  (request, query head, block of query rows), flash-attention over keys 0..last position of the
  block; its query offsets and lengths are device tensors (from the host lists when eager, fixed
  buffers in a prefill graph, whose grid the bucket's token count sizes; a zero-length request or a
  block past a request's rows does nothing).
- `fill_kv_indices`: the flat page list FlashInfer wants (page size 1), gathered from the slot map
  on the device before a replay.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mleagle.engine.kernels import interpreter_compat, next_pow2

interpreter_compat()

LOG2E = 1.4426950408889634


@triton.jit
def _rotate_store(src, dst, m, c, s, HALF: tl.constexpr):
    """Rotary (rotate-half: halves at +0 and +HALF) of the values at `src`, stored at `dst` in its dtype."""
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(dst, (x1 * c - x2 * s).to(dst.dtype.element_ty), mask=m)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(dst.dtype.element_ty), mask=m)


@triton.jit
def _rope_store_kernel(
    qkv, s_qkv, pos, cos, sin, s_cs, loc,
    q_out, s_qo_t, s_qo_h,
    k_cache, v_cache, s_kn, s_kh, s_vn, s_vh,
    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    p = tl.load(pos + t)
    slot = tl.load(loc + t)
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, BLOCK_HALF)
    im = i < HALF
    # The tables hold [cos | cos] (rotate-half layout): the first half is enough.
    c = tl.load(cos + p * s_cs + i, mask=im, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin + p * s_cs + i, mask=im, other=0.0).to(tl.float32)[None, :]
    row = qkv + t * s_qkv

    hq = tl.arange(0, BLOCK_HQ)
    _rotate_store(row + hq[:, None] * D + i[None, :], q_out + t * s_qo_t + hq[:, None] * s_qo_h + i[None, :],
                  (hq < HQ)[:, None] & im[None, :], c, s, HALF)
    hk = tl.arange(0, BLOCK_HK)
    _rotate_store(row + (HQ + hk)[:, None] * D + i[None, :], k_cache + slot * s_kn + hk[:, None] * s_kh + i[None, :],
                  (hk < HK)[:, None] & im[None, :], c, s, HALF)

    j = tl.arange(0, BLOCK_D)
    mv = (hk < HK)[:, None] & (j < D)[None, :]
    v = tl.load(row + (HQ + HK + hk)[:, None] * D + j[None, :], mask=mv, other=0.0)
    tl.store(v_cache + slot * s_vn + hk[:, None] * s_vh + j[None, :], v.to(v_cache.dtype.element_ty), mask=mv)


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               loc: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, hq: int) -> torch.Tensor:
    """qkv [T, (hq+2hk)*D] → rotated q [T, hq, D]; rotated k and v written to the caches at `loc`.

    cos/sin: [max_pos, D] in the rotate-half layout; k_cache/v_cache: [num_slots, hk, D].
    """
    t = qkv.shape[0]
    hk, d = k_cache.shape[1], k_cache.shape[2]
    if qkv.shape[1] != (hq + 2 * hk) * d or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [T, ({hq} + 2*{hk}) * {d}] with unit column stride")
    q = torch.empty(t, hq, d, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    _rope_store_kernel[(t,)](
        qkv, qkv.stride(0), positions, cos, sin, cos.stride(0), loc,
        q, q.stride(0), q.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HQ=hq, HK=hk, D=d, BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(hk), BLOCK_HALF=next_pow2(d // 2),
        BLOCK_D=next_pow2(d), num_warps=4 if hq * d >= 2048 else 1,
    )
    return q


@triton.jit
def _rot_half(base, s_cs, cos, sin, p, i, im, rows_m, HALF: tl.constexpr):
    """Rotary of [rows, D] values at `base` (halves at +0 and +HALF) for positions p: (first, second) half."""
    c = tl.load(cos + p[:, None] * s_cs + i[None, :], mask=rows_m[:, None] & im[None, :], other=0.0).to(tl.float32)
    s = tl.load(sin + p[:, None] * s_cs + i[None, :], mask=rows_m[:, None] & im[None, :], other=0.0).to(tl.float32)
    m = rows_m[:, None] & im[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _softmax_step(s, vt, m_i, l_i, acc, DOT_PREC: tl.constexpr):
    """Fold one block of scores s [M, N] (base 2, -inf where masked) and values vt [N, D] into (m, l, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no visible key yet keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    qkv, s_qkv, pos, cos, sin, s_cs, loc,
    k_cache, v_cache, s_kn, s_kh, s_vn, s_vh,
    r2t, s_r2t, rpi, seq_lens,
    out, s_ot, s_oh, part_o, part_lse, sm_scale,
    W: tl.constexpr, G: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    HALF: tl.constexpr = D // 2
    dt = qkv.dtype.element_ty
    seq = tl.load(seq_lens + b).to(tl.int32)
    req = tl.load(rpi + b)
    i = tl.arange(0, BLOCK_HALF)
    im = i < HALF
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    # The W·G query rows that share KV head kh: row m is window row m // G of query head kh·G + m % G.
    m = tl.arange(0, BLOCK_M)
    w = m // G
    head = kh * G + m % G
    mv = m < W * G
    qrow = b * W + w
    q1, q2 = _rot_half(qkv + qrow[:, None] * s_qkv + head[:, None] * D + i[None, :], s_cs, cos, sin,
                       tl.load(pos + qrow, mask=mv, other=0), i, im, mv, HALF)
    q1 = q1.to(dt)
    q2 = q2.to(dt)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Cached keys 0 .. seq-W-1 (every row sees all of them), this split's chunk, read through the map.
    npre = seq - W
    chunk = tl.cdiv(tl.cdiv(npre, SPLITS), BLOCK_N) * BLOCK_N
    start = sp * chunk
    end = tl.minimum(npre, start + chunk)
    n = tl.arange(0, BLOCK_N)
    row = r2t + req * s_r2t
    for n0 in range(start, end, BLOCK_N):
        kn = n0 + n
        km = kn < end
        slots = tl.load(row + kn, mask=km, other=0)
        kb = k_cache + slots[None, :] * s_kn + kh * s_kh + i[:, None]
        k1 = tl.load(kb, mask=km[None, :] & im[:, None], other=0.0)
        k2 = tl.load(kb + HALF, mask=km[None, :] & im[:, None], other=0.0)
        sc = tl.dot(q1, k1, input_precision=DOT_PREC) + tl.dot(q2, k2, input_precision=DOT_PREC)
        sc = tl.where(km[None, :], sc * sm_scale, float("-inf"))
        vt = tl.load(v_cache + slots[:, None] * s_vn + kh * s_vh + d[None, :], mask=km[:, None] & dm[None, :], other=0.0)
        m_i, l_i, acc = _softmax_step(sc, vt, m_i, l_i, acc, DOT_PREC)

    # The window's own W keys (positions seq-W ..): rotated from qkv in registers, stored into the pool by
    # this one program per (request, KV head), and attended causally. No program reads these slots, so
    # the store needs no ordering against the reads above.
    if sp == SPLITS - 1:
        j = tl.arange(0, BLOCK_W)
        jm = j < W
        krow = b * W + j
        k1, k2 = _rot_half(qkv + krow[:, None] * s_qkv + (HQ + kh) * D + i[None, :], s_cs, cos, sin,
                           tl.load(pos + krow, mask=jm, other=0), i, im, jm, HALF)
        k1 = k1.to(dt)
        k2 = k2.to(dt)
        vt = tl.load(qkv + krow[:, None] * s_qkv + (HQ + HK + kh) * D + d[None, :], mask=jm[:, None] & dm[None, :],
                     other=0.0)
        slot = tl.load(loc + krow, mask=jm, other=0)
        kd = k_cache + slot[:, None] * s_kn + kh * s_kh + i[None, :]
        tl.store(kd, k1.to(k_cache.dtype.element_ty), mask=jm[:, None] & im[None, :])
        tl.store(kd + HALF, k2.to(k_cache.dtype.element_ty), mask=jm[:, None] & im[None, :])
        tl.store(v_cache + slot[:, None] * s_vn + kh * s_vh + d[None, :], vt.to(v_cache.dtype.element_ty),
                 mask=jm[:, None] & dm[None, :])
        sc = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC) + tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC)
        sc = tl.where(jm[None, :] & (j[None, :] <= w[:, None]), sc * sm_scale, float("-inf"))
        m_i, l_i, acc = _softmax_step(sc, vt, m_i, l_i, acc, DOT_PREC)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    om = mv[:, None] & dm[None, :]
    if SPLITS == 1:
        tl.store(out + qrow[:, None] * s_ot + head[:, None] * s_oh + d[None, :], o.to(out.dtype.element_ty), mask=om)
    else:
        idx = (qrow * HQ + head) * SPLITS + sp
        tl.store(part_o + idx[:, None] * D + d[None, :], o, mask=om)
        tl.store(part_lse + idx, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe)), mask=mv)


@triton.jit
def _merge_kernel(part_o, part_lse, out, s_ot, s_oh, HQ: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    sm = s < SPLITS
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    base = (t * HQ + h) * SPLITS
    lse = tl.load(part_lse + base + s, mask=sm, other=float("-inf"))
    # The last split holds the window, whose first key every row sees: the max is finite.
    wgt = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(part_o + (base + s)[:, None] * D + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
    res = tl.sum(wgt[:, None] * o, 0) / tl.sum(wgt, 0)
    tl.store(out + t * s_ot + h * s_oh + d, res.to(out.dtype.element_ty), mask=dm)


class DecodeTile(NamedTuple):
    """`decode_attention`'s launch shape: keys per loop step, warps and pipeline stages a program, and
    the fewest KV splits (1: split only where `num_kv_splits`' rule does). `decode_tile()` gives the
    default; `MLEAGLE_DECODE_TILE=BLOCK_N,WARPS,STAGES[,MIN_SPLITS]` overrides it for tuning runs
    (`scripts/decode_tiles.py` times the choices on a device)."""

    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    min_splits: int = 1


def decode_tile(head_dim: int) -> DecodeTile:
    """The default tile for a head size, or the `MLEAGLE_DECODE_TILE` override (a backend reads it once,
    when it is made, so that every graph it captures and every eager launch share one shape)."""
    env = os.environ.get("MLEAGLE_DECODE_TILE")
    if env:
        try:
            parts = [int(x) for x in env.split(",")]
            t = DecodeTile(*parts)
        except (ValueError, TypeError) as e:
            raise ValueError(f"MLEAGLE_DECODE_TILE={env!r}: want BLOCK_N,WARPS,STAGES[,MIN_SPLITS] integers") from e
        if t.block_n < 16 or t.block_n & (t.block_n - 1) or t.num_warps not in (1, 2, 4, 8) or t.num_stages < 1 \
                or t.min_splits < 1:
            raise ValueError(f"MLEAGLE_DECODE_TILE={env!r}: BLOCK_N a power of two >= 16, WARPS 1/2/4/8, STAGES "
                             "and MIN_SPLITS >= 1")
        return t
    if next_pow2(head_dim) <= 64:
        # Measured on an H100 (`scripts/decode_tiles.py`, SmolLM2's 9/3 heads of 64, MT-Bench lengths, 30
        # layers in a CUDA graph): 128-key blocks cut the loop steps of the longest request, and at least 4
        # splits spread it over 4 programs, merge launch included: 9.3 µs a layer at bs 32 on a served mix
        # against 18.2 with (64, 4, 2, 1), 8.5 against 14.4 on a static batch; at bs 64 12.8 against 21.0.
        return DecodeTile(128, 4, 2, 4)
    return DecodeTile(64 if next_pow2(head_dim) <= 128 else 32)  # larger heads: not yet measured


def num_kv_splits(bs: int, hk: int, num_sms: int, max_splits: int = 16, min_splits: int = 1) -> int:
    """KV splits for a uniform batch: a function of the padded batch size only (graph-safe).

    Split while bs·hk programs would leave most SMs idle (at batch 1 of a small-KV-head model this
    turns 3 programs into up to 48), and at least `min_splits` at any batch (the tile's: a request's
    keys spread over that many programs), never more than `max_splits` (1 turns splitting off).
    Chunks are rounded to the key block on the device, so short sequences leave the later splits empty
    (a cheap early exit) rather than making tiny ones.
    """
    floor = max(1, min(min_splits, max_splits))
    progs = bs * hk
    if max_splits <= 1 or progs >= num_sms:
        return floor
    return max(floor, min(max_splits, num_sms // progs))


def _dot_prec(dtype: torch.dtype) -> str:
    # float32 is the reference dtype: no TF32 rounding in its dot products.
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_attention(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     loc: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, hq: int, width: int, num_splits: int,
                     scale: float, out: torch.Tensor | None = None, tile: DecodeTile | None = None) -> torch.Tensor:
    """Uniform batches (W rows per request, request-major): rotary, the K/V store at `loc` and attention
    in one launch (plus the merge when split). qkv [bs·W, (hq+2hk)·D] → out [bs·W, hq, D]. `tile`: the
    launch shape (default `decode_tile(D)`; `num_splits` is the caller's)."""
    t = qkv.shape[0]
    hk, d = k_cache.shape[1], k_cache.shape[2]
    bs = req_pool_indices.shape[0]
    if t != bs * width:
        raise ValueError(f"{t} query rows for {bs} requests of width {width}")
    if qkv.shape[1] != (hq + 2 * hk) * d or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [T, ({hq} + 2*{hk}) * {d}] with unit column stride")
    g = hq // hk
    out = torch.empty(t, hq, d, dtype=qkv.dtype, device=qkv.device) if out is None else out
    if t == 0:
        return out
    block_d = next_pow2(d)
    tile = tile or decode_tile(d)
    if num_splits > 1:
        part_o = torch.empty(t, hq, num_splits, d, dtype=torch.float32, device=qkv.device)
        part_lse = torch.empty(t, hq, num_splits, dtype=torch.float32, device=qkv.device)
    else:
        part_o = part_lse = out  # unused
    _decode_kernel[(bs, hk, num_splits)](
        qkv, qkv.stride(0), positions, cos, sin, cos.stride(0), loc,
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token, req_to_token.stride(0), req_pool_indices, seq_lens,
        out, out.stride(0), out.stride(1), part_o, part_lse, scale * LOG2E,
        W=width, G=g, HQ=hq, HK=hk, D=d, SPLITS=num_splits, BLOCK_M=max(16, next_pow2(width * g)),
        BLOCK_N=tile.block_n, BLOCK_W=max(16, next_pow2(width)), BLOCK_HALF=max(16, next_pow2(d // 2)), BLOCK_D=block_d,
        DOT_PREC=_dot_prec(qkv.dtype), num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    if num_splits > 1:
        _merge_kernel[(t, hq)](part_o, part_lse, out, out.stride(0), out.stride(1), HQ=hq, D=d, SPLITS=num_splits,
                               BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d, num_warps=1)
    return out


@triton.jit
def _attend_tile(qv, kn, qpos, end, slots, k_cache, v_cache, kv_off_k, kv_off_v, s_kn, s_vn, d, dm,
                 m_i, l_i, acc, sm_scale, DOT_PREC: tl.constexpr):
    """One block of pooled keys for a tile of query rows at positions qpos (causal)."""
    km = kn < end
    kt = tl.load(k_cache + slots[None, :] * s_kn + kv_off_k + d[:, None], mask=km[None, :] & dm[:, None], other=0.0)
    s = tl.dot(qv, kt, input_precision=DOT_PREC) * sm_scale
    s = tl.where(km[None, :] & (kn[None, :] <= qpos[:, None]), s, float("-inf"))
    vt = tl.load(v_cache + slots[:, None] * s_vn + kv_off_v + d[None, :], mask=km[:, None] & dm[None, :], other=0.0)
    return _softmax_step(s, vt, m_i, l_i, acc, DOT_PREC)


@triton.jit
def _extend_kernel(
    q, s_qt, s_qh, k_cache, v_cache, s_kn, s_kh, s_vn, s_vh,
    r2t, s_r2t, rpi, seq_lens, qo_start, ext_lens,
    out, s_ot, s_oh, sm_scale,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    kh = h // G
    seq = tl.load(seq_lens + b).to(tl.int32)
    e = tl.load(ext_lens + b).to(tl.int32)
    qs = tl.load(qo_start + b).to(tl.int32)
    req = tl.load(rpi + b)
    prefix = seq - e
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < e
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    qv = tl.load(q + (qs + rows)[:, None] * s_qt + h * s_qh + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
    qpos = prefix + rows
    # Keys up to the last position of this block (causal); nothing for a block past the request's rows.
    end = tl.minimum(seq, prefix + (mb + 1) * BLOCK_M)
    end = tl.where(mb * BLOCK_M < e, end, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    row = r2t + req * s_r2t
    for n0 in range(0, end, BLOCK_N):
        kn = n0 + n
        slots = tl.load(row + kn, mask=kn < end, other=0)
        m_i, l_i, acc = _attend_tile(qv, kn, qpos, end, slots, k_cache, v_cache, kh * s_kh, kh * s_vh, s_kn, s_vn,
                                     d, dm, m_i, l_i, acc, sm_scale, DOT_PREC)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out + (qs + rows)[:, None] * s_ot + h * s_oh + d[None, :], o.to(out.dtype.element_ty),
             mask=rm[:, None] & dm[None, :])


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, qo_start: torch.Tensor,
                     extend_lens: torch.Tensor, max_extend: int, scale: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] (requests' rows back to back from `qo_start`) → out [T, Hq, D]."""
    t, hq, d = q.shape
    hk = k_cache.shape[1]
    bs = req_pool_indices.shape[0]
    out = torch.empty_like(q) if out is None else out
    if t == 0 or max_extend == 0:
        return out
    block_d = next_pow2(d)
    block_m = 64 if block_d <= 128 else 32
    block_n = 64 if block_d <= 64 else 32
    _extend_kernel[(bs, hq, triton.cdiv(max_extend, block_m))](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token, req_to_token.stride(0), req_pool_indices, seq_lens,
        qo_start, extend_lens, out, out.stride(0), out.stride(1), scale * LOG2E,
        G=hq // hk, D=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_PREC=_dot_prec(q.dtype),
        num_warps=4, num_stages=2,
    )
    return out


@triton.jit
def _fill_kv_indices_kernel(r2t, s_r2t, rpi, seq_lens, indptr, out, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    req = tl.load(rpi + b)
    seq = tl.load(seq_lens + b).to(tl.int32)
    dst = tl.load(indptr + b)
    for j0 in range(0, seq, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        jm = j < seq
        slots = tl.load(r2t + req * s_r2t + j, mask=jm, other=0)
        tl.store(out + dst + j, slots.to(out.dtype.element_ty), mask=jm)


def fill_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    kv_indptr: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[kv_indptr[b] + j] = req_to_token[req_pool_indices[b], j] for j < seq_lens[b] (page size 1)."""
    bs = req_pool_indices.shape[0]
    if bs:
        _fill_kv_indices_kernel[(bs,)](req_to_token, req_to_token.stride(0), req_pool_indices, seq_lens, kv_indptr,
                                       out, BLOCK=512, num_warps=4)
    return out


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
