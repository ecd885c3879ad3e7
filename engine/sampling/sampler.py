"""The sampler: processed logits → chosen tokens, and the logprobs of what was chosen, on the device.

Greedy rows take the argmax of the penalised logits. Sampled rows draw from `probs_from_logits` by an
exponential race with noise keyed by the row's (seed, position, stream, iteration) (`rng`), so a
seeded request gets the same tokens alone or in any batch, and nothing is read back to the host.
Logprobs are reported from the raw model distribution (log-softmax of the unprocessed logits), for the
chosen token and the top-N alternatives, as vLLM reports them by default.
"""

from __future__ import annotations

import torch

from mleagle.engine.sampling import rng
from mleagle.engine.sampling.processor import SamplingRows, probs_from_logits


def draw(probs: torch.Tensor, rows: SamplingRows, stream: int) -> torch.Tensor:
    """One token per row from `probs` ([N, V]) by the exponential race with the row's own noise."""
    e = rng.exponential(rng.keys(rows.seed, rows.pos, stream, rows.it), probs.shape[1])
    return (probs / e).argmax(-1)


def sample(x: torch.Tensor, rows: SamplingRows, stream: int = rng.STREAM_TOKEN) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [N, V] processed logits. Returns (tokens [N] int64, probs [N, V] or None when all greedy)."""
    greedy = x.argmax(-1)
    if rows.flags.all_greedy:
        return greedy, None
    probs = probs_from_logits(x, rows)
    return torch.where(rows.greedy, greedy, draw(probs, rows, stream)), probs


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw-distribution logprob of tokens[i] at row i and the top-`top_n` alternatives of every row.

    Returns (chosen [N] float32, top values [N, top_n], top ids [N, top_n] int64)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.view(-1, 1)).view(-1)
    if top_n > 0:
        tv, ti = lp.topk(top_n, dim=-1)
    else:
        tv = lp.new_zeros(lp.shape[0], 0)
        ti = tokens.new_zeros(lp.shape[0], 0)
    return chosen, tv, ti
