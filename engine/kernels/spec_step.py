"""The greedy speculative iteration's bookkeeping in three kernels: row argmax, accept, draft step.

Between the forwards of a speculative iteration the torch version runs about forty small launches for
the verify's accept and commit, and a dozen per draft step (argmax, vocabulary map, state write,
window rotate), each a few microseconds of GPU time at batch 1 plus its gap: more than a tenth of the
iteration. Here:

- `argmax_partials`: the largest logit and its index per row and column block (grid rows × blocks,
  so one row of 49k logits still spreads over many SMs); a consumer reduces the few partials.
- `greedy_accept`: per request, the target's argmax of each of the W verify rows, the accepted drafts
  n (the leading drafts equal to them; or the benchmark's forced count), the emitted tokens, the
  commit of the request's slot state (last token, output and KV lengths, iteration count; only for
  live rows, so graph padding changes nothing), the packed result row and the draft-extend logit row.
- `greedy_draft_step`: per request, the draft's argmax mapped to a target id, written to the slot
  state's drafts (live rows) and into the next step's id window (rotated left by one, the new draft at
  the last accepted row).

Ties go to the lowest index, as in `torch.argmax`; NaN logits are not handled (torch would pick them).
The torch references are `SlotState.verify_greedy` and `.draft_greedy`, which pick these kernels on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mleagle.engine.kernels import interpreter_compat, next_pow2

interpreter_compat()

BLOCK = 2048  # logits per argmax program


@triton.jit
def _argmax_partial_kernel(x, s_x, pmax, pidx, V, CP: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    i = c * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + r * s_x + i, mask=i < V, other=float("-inf")).to(tl.float32)
    tl.store(pmax + r * CP + c, tl.max(v, 0))
    tl.store(pidx + r * CP + c, (c * BLOCK + tl.argmax(v, 0)).to(tl.int64))


@triton.jit
def _reduce_rows(pmax, pidx, rows, rmask, C, CP: tl.constexpr):
    """[len(rows)] argmax ids from each row's C partials (the first block holding the maximum)."""
    c = tl.arange(0, CP)
    m = rmask[:, None] & (c[None, :] < C)
    pm = tl.load(pmax + rows[:, None] * CP + c[None, :], mask=m, other=float("-inf"))
    pi = tl.load(pidx + rows[:, None] * CP + c[None, :], mask=m, other=0)
    best = tl.argmax(pm, 1)
    return tl.sum(tl.where(c[None, :] == best[:, None], pi, 0), 1)


@triton.jit
def _greedy_accept_kernel(pmax, pidx, C, rpi, live, drafts, s_dr, sim, last_tok, n_out, kv_len, iters,
                          emitted, packed, n_acc, sel, HAS_LIVE: tl.constexpr, CP: tl.constexpr,
                          S: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    b = tl.program_id(0)
    j = tl.arange(0, WP)
    mj = j < W
    pred = _reduce_rows(pmax, pidx, b * W + j, mj, C, CP)  # the target's argmax of each verify row
    row = tl.load(rpi + b)
    dr = tl.load(drafts + row * s_dr + j, mask=j < S, other=-1)
    n = tl.min(tl.where((j < S) & (dr != pred), j, S), 0).to(tl.int64)  # leading drafts that match
    sv = tl.load(sim)
    n = tl.where(sv >= 0, tl.minimum(sv, S), n)
    em = tl.where(j < n, dr, pred)
    final = tl.sum(tl.where(j == n, pred, 0), 0)
    tl.store(emitted + b * W + j, em, mask=mj)
    tl.store(packed + b * (W + 1) + j, em.to(tl.float64), mask=mj)
    tl.store(packed + b * (W + 1) + W, (n + 1).to(tl.float64))
    tl.store(n_acc + b, n)
    tl.store(sel + b, b * W + n)
    ok = tl.full((), 1, tl.int1)
    if HAS_LIVE:
        ok = tl.load(live + b) != 0
    tl.store(last_tok + row, final, mask=ok)
    tl.store(n_out + row, tl.load(n_out + row) + n + 1, mask=ok)
    tl.store(kv_len + row, tl.load(kv_len + row) + n + 1, mask=ok)
    tl.store(iters + row, tl.load(iters + row) + 1, mask=ok)


@triton.jit
def _greedy_draft_step_kernel(pmax, pidx, C, vocab_ids, rpi, live, drafts, s_dr, k, n_acc, ids, ids_out, d_out,
                              HAS_VOCAB: tl.constexpr, HAS_LIVE: tl.constexpr, CP: tl.constexpr,
                              W: tl.constexpr, WP: tl.constexpr):
    b = tl.program_id(0)
    one = tl.arange(0, 1)
    d = tl.sum(_reduce_rows(pmax, pidx, b + one, one < 1, C, CP), 0)
    if HAS_VOCAB:
        d = tl.load(vocab_ids + d)
    tl.store(d_out + b, d)
    row = tl.load(rpi + b)
    ok = tl.full((), 1, tl.int1)
    if HAS_LIVE:
        ok = tl.load(live + b) != 0
    tl.store(drafts + row * s_dr + k, d, mask=ok)
    j = tl.arange(0, WP)
    nxt = tl.load(ids + b * W + j + 1, mask=j + 1 < W, other=0)
    last = tl.load(ids + b * W + W - 1)
    nxt = tl.where(j + 1 < W, nxt, last)
    nxt = tl.where(j == tl.load(n_acc + b), d, nxt)
    tl.store(ids_out + b * W + j, nxt, mask=j < W)


def argmax_partials(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """logits [R, V] (any float dtype) → per-block maxima [R, CP] float32, their
    indices [R, CP] int64 (the first C columns written) and C."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    r, v = logits.shape
    c = triton.cdiv(v, BLOCK)
    cp = next_pow2(c)
    pmax = torch.empty(r, cp, dtype=torch.float32, device=logits.device)
    pidx = torch.empty(r, cp, dtype=torch.int64, device=logits.device)
    if r:
        _argmax_partial_kernel[(r, c)](logits, logits.stride(0), pmax, pidx, v, CP=cp, BLOCK=BLOCK, num_warps=4)
    return pmax, pidx, c


def greedy_accept(logits: torch.Tensor, w: int, rpi: torch.Tensor, live: torch.Tensor | None, sim: torch.Tensor,
                  drafts: torch.Tensor, last_tok: torch.Tensor, n_out: torch.Tensor, kv_len: torch.Tensor,
                  iters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `SlotState.verify_greedy` (which owns the state tensors it passes): `drafts` [R, S] is read at
    the request rows `rpi`; `sim` a device scalar (≥ 0: a forced accepted count); the live rows of
    `last_tok`, `n_out`, `kv_len`, `iters` [R] advance. Returns (emitted [bs, W], n [bs], packed
    [bs, W+1], sel [bs])."""
    bs = int(rpi.shape[0])
    pmax, pidx, c = argmax_partials(logits)
    dev = logits.device
    emitted = torch.empty(bs, w, dtype=torch.int64, device=dev)
    packed = torch.empty(bs, w + 1, dtype=torch.float64, device=dev)
    n = torch.empty(bs, dtype=torch.int64, device=dev)
    sel = torch.empty(bs, dtype=torch.int64, device=dev)
    if bs:
        sd = drafts
        _greedy_accept_kernel[(bs,)](pmax, pidx, c, rpi, live if live is not None else rpi, sd, sd.stride(0), sim,
                                     last_tok, n_out, kv_len, iters,
                                     emitted, packed, n, sel, HAS_LIVE=live is not None, CP=pmax.shape[1],
                                     S=w - 1, W=w, WP=next_pow2(w), num_warps=1)
    return emitted, n, packed, sel


def greedy_draft_step(logits: torch.Tensor, vocab_ids: torch.Tensor | None, drafts: torch.Tensor, rpi: torch.Tensor,
                      k: int, live: torch.Tensor | None, ids: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See `SlotState.draft_greedy`: (new drafts [bs], the next id window [bs, W]); the live rows of
    `drafts` [R, S] get column k."""
    ids = ids.contiguous()  # the kernel reads row b at b·W
    bs, w = ids.shape
    pmax, pidx, c = argmax_partials(logits)
    d = torch.empty(bs, dtype=torch.int64, device=logits.device)
    out = torch.empty_like(ids)
    if bs:
        _greedy_draft_step_kernel[(bs,)](pmax, pidx, c, vocab_ids if vocab_ids is not None else rpi, rpi,
                                         live if live is not None else rpi, drafts, drafts.stride(0), k, n, ids, out, d,
                                         HAS_VOCAB=vocab_ids is not None, HAS_LIVE=live is not None,
                                         CP=pmax.shape[1], W=w, WP=next_pow2(w), num_warps=1)
    return d, out
