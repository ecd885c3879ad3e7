"""Turning logits into the distribution a request samples from: penalties, temperature, filters.

`apply_penalties` implements HF's repetition penalty (over prompt and output tokens) and OpenAI's
presence and frequency penalties (over output tokens). `probs_from_logits` applies temperature, then
top-k, top-p and min-p, and renormalises. The speculative worker uses the same two functions on both
the target's and the draft's logits, so rejection sampling compares the distributions actually used.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mleagle.engine.contract.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], prompt_ids: Sequence[Sequence[int]],
                    output_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Penalise rows in place where the request asks for it. logits: [R, V] float32."""
    v, dev = logits.shape[1], logits.device
    for r, sp in enumerate(params):
        if not sp.has_penalties:
            continue
        row = logits[r]
        out = torch.tensor(list(output_ids[r]), dtype=torch.int64, device=dev)
        out = out[out < v]
        if sp.repetition_penalty != 1.0:
            seen = torch.cat([torch.tensor(list(prompt_ids[r]), dtype=torch.int64, device=dev), out]).unique()
            seen = seen[seen < v]
            x = row[seen]
            row[seen] = torch.where(x > 0, x / sp.repetition_penalty, x * sp.repetition_penalty)
        if out.numel() and (sp.presence_penalty or sp.frequency_penalty):
            counts = torch.zeros(v, device=dev).index_add_(0, out, torch.ones(out.numel(), device=dev))
            row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).float()
    return logits


def probs_from_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[R, V] logits (penalised) → [R, V] probabilities after temperature and top-k/top-p/min-p.

    Greedy rows (temperature 0) get a one-hot at the argmax, so callers can treat every row alike.
    """
    r, v = logits.shape
    dev = logits.device  # every helper tensor lives with the logits (CPU here, the GPU later)
    temps = torch.tensor([sp.temperature if sp.temperature > 0 else 1.0 for sp in params], device=dev).view(r, 1)
    probs = torch.softmax(logits / temps, dim=-1)
    top_k = [sp.top_k for sp in params]
    top_p = [sp.top_p for sp in params]
    min_p = [sp.min_p for sp in params]
    if any(0 < k < v for k in top_k) or any(p < 1.0 for p in top_p):
        sp_, idx = probs.sort(dim=-1, descending=True)
        keep = torch.ones_like(sp_, dtype=torch.bool)
        ks = torch.tensor([k if 0 < k < v else v for k in top_k], device=dev).view(r, 1)
        keep &= torch.arange(v, device=dev).view(1, v) < ks
        ps = torch.tensor(top_p, device=dev).view(r, 1)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it < p.
        before = sp_.cumsum(-1) - sp_
        keep &= before < ps
        keep[:, 0] = True
        probs = torch.zeros_like(probs).scatter_(1, idx, sp_ * keep)
    if any(m > 0 for m in min_p):
        mp = torch.tensor(min_p, device=dev).view(r, 1)
        probs = torch.where(probs >= mp * probs.max(-1, keepdim=True).values, probs, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    greedy = [i for i, sp in enumerate(params) if sp.temperature == 0]
    if greedy:
        g = torch.tensor(greedy, device=dev)
        probs[g] = torch.nn.functional.one_hot(logits[g].argmax(-1), v).float()
    return probs
