"""The sampler: penalised logits → chosen tokens, plus the logprobs of what was chosen.

Greedy rows take the argmax of the penalised logits. Sampled rows draw from `probs_from_logits` by
an exponential race with noise from the request's (seed, position), so a seeded request gets the
same tokens alone or in any batch. Logprobs are reported from the raw model distribution
(log-softmax of the unprocessed logits), for the chosen token and the top-N alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mleagle.engine.contract.outputs import TokenLogprob
from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.sampling import rng
from mleagle.engine.sampling.processor import apply_penalties, probs_from_logits


@dataclass
class RowInfo:
    """What the sampler needs to know about one logit row."""

    params: SamplingParams
    seed: int
    pos: int  # index of the output token this row produces (0 = first generated token)
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]  # tokens generated before this row's token
    suppress: Sequence[int] = ()  # token ids banned at this row (EOS/stop ids before min_new_tokens)


def sample(logits: torch.Tensor, rows: Sequence[RowInfo]) -> list[int]:
    """logits: [R, V] float32 raw; returns R token ids. `logits` is not modified."""
    params = [r.params for r in rows]
    x = processed_logits(logits, rows)
    if all(p.greedy for p in params):
        return x.argmax(-1).tolist()
    probs = probs_from_logits(x, params)
    out: list[int] = []
    for i, r in enumerate(rows):
        if r.params.greedy:
            out.append(int(x[i].argmax()))
        else:
            e = rng.exponential(r.seed, r.pos, probs.shape[1], rng.STREAM_TOKEN).to(probs.device)
            out.append(int((probs[i] / e).argmax()))
    return out


def processed_logits(logits: torch.Tensor, rows: Sequence[RowInfo]) -> torch.Tensor:
    """Penalties and min-token suppression applied; returns `logits` itself when nothing applies."""
    params = [r.params for r in rows]
    x = logits
    if any(p.has_penalties for p in params) or any(r.suppress for r in rows):
        x = apply_penalties(logits.clone(), params, [r.prompt_ids for r in rows], [r.output_ids for r in rows])
        for i, r in enumerate(rows):
            if r.suppress:
                x[i, list(r.suppress)] = float("-inf")
    return x


def logprobs_of(logits: torch.Tensor, tokens: Sequence[int], top_n: Sequence[int | None]) -> list[TokenLogprob | None]:
    """Raw-distribution logprob of tokens[i] at row i and its top-N alternatives; None where not asked."""
    want = [i for i, n in enumerate(top_n) if n is not None]
    res: list[TokenLogprob | None] = [None] * len(tokens)
    if not want:
        return res
    lp = torch.log_softmax(logits[want], dim=-1)
    maxn = max(int(top_n[i] or 0) for i in want)
    if maxn:
        tv, ti = lp.topk(maxn, dim=-1)
        tv, ti = tv.tolist(), ti.tolist()
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in want], device=lp.device).view(-1, 1)).view(-1).tolist()
    for j, i in enumerate(want):
        n = int(top_n[i] or 0)
        top = list(zip(ti[j][:n], tv[j][:n])) if n else []
        res[i] = TokenLogprob(token_id=int(tokens[i]), logprob=chosen[j], top=top)
    return res
