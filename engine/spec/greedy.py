"""Greedy speculation's device bookkeeping: the verify's accept + commit, and each draft step's pick.

`accept` serves plain greedy batches (no penalties, bans or logprobs): from the target's verify
logits it finds the accepted drafts, the emitted tokens, commits the slot state and packs the result
row. `draft_step` serves greedy draft-extend steps: the draft's argmax as a target id, written to the
slot state and into the next step's id window. Both are the torch reference here, and the Triton
kernels of `mleagle.engine.kernels.spec_step` on CUDA (where they replace some fifty small launches
per iteration by five); the kernels are tested against these references.
"""

from __future__ import annotations

import torch

from mleagle.engine.executor.slot_state import SlotState
from mleagle.engine.executor.worker import pack
from mleagle.engine.kernels import fused_layers_on
from mleagle.engine.sampling.processor import RowFlags

PLAIN = RowFlags()


def accept(logits: torch.Tensor, w: int, drafts: torch.Tensor, rpi: torch.Tensor, live: torch.Tensor | None,
           st: SlotState, sim: torch.Tensor, fused: bool | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [bs·W, V] of the verify rows, drafts [bs, S] (the request rows' `st.drafts`), `sim` a device
    scalar (≥ 0: the benchmark's forced accepted count) → (emitted [bs, W]: accepted drafts then the
    target's argmax, the first n+1 valid; n [bs]; the packed result [bs, W+1]; sel [bs]: each request's
    draft-extend logit row b·W + n). Commits the live rows' slot state (n+1 tokens and KV positions)."""
    if fused_layers_on(logits) if fused is None else fused:  # `fused` forces a side (kernel tests)
        from mleagle.engine.kernels.spec_step import greedy_accept

        return greedy_accept(logits, w, drafts, rpi, live, st, sim)
    s, bs = w - 1, int(rpi.shape[0])
    pred = logits.argmax(-1).view(bs, w)
    n = torch.where(sim >= 0, sim.clamp(max=s), accepted(drafts, pred))
    # Accepted drafts (equal to the target's argmax unless forced), then the target's tokens from row n.
    emitted = torch.where(st._ar[:w].view(1, w) < n.view(-1, 1), torch.cat([drafts, drafts[:, -1:]], 1), pred)
    n_emit = n + 1
    st.commit(rpi, emitted, n_emit, PLAIN, live=live)
    st.iters[rpi] += 1 if live is None else live.to(torch.int64)
    sel = torch.arange(bs, device=logits.device) * w + n
    return emitted, n, pack(emitted, n_emit, None, w), sel


def accepted(drafts: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance: the number of leading drafts [bs, S] equal to the target's argmax of the rows
    before them (pred [bs, W]), per request."""
    return (drafts == pred[:, : drafts.shape[1]]).to(torch.int64).cumprod(1).sum(1)


def draft_step(logits: torch.Tensor, vocab_ids: torch.Tensor | None, st: SlotState, rpi: torch.Tensor, k: int,
               live: torch.Tensor | None, ids: torch.Tensor, n: torch.Tensor, fused: bool | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft k+1 of each request from the draft's logits [bs, Vd] (argmax, mapped through `vocab_ids`
    when the draft has a reduced vocabulary), written to `st.drafts[rpi, k]` (live rows), and the next
    step's id window: `ids` [bs, W] rotated left by one, the new draft at column n (the last accepted
    row). Returns (drafts [bs], the new window)."""
    if fused_layers_on(logits) if fused is None else fused:
        from mleagle.engine.kernels.spec_step import greedy_draft_step

        return greedy_draft_step(logits, vocab_ids, st.drafts, rpi, k, live, ids, n)
    idx = logits.argmax(-1)
    d = idx if vocab_ids is None else vocab_ids[idx]
    st.drafts[rpi, k] = d if live is None else torch.where(live, d, st.drafts[rpi, k])
    ids = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1).scatter(1, n.view(-1, 1), d.view(-1, 1))
    return d, ids
