"""Turning logits into the distribution a row samples from: penalties, bans, temperature, filters.

Everything is vectorised over rows with per-row parameter tensors (`SamplingRows`), so a batch mixing
greedy, sampled and penalised requests runs the same few kernels on the device. `penalize` applies
HF's repetition penalty (over prompt and output tokens, the `seen` mask) and OpenAI's presence and
frequency penalties (over output token `counts`), then bans (-inf) what a row may not emit yet (EOS and
stop ids before `min_new_tokens`). `probs_from_logits` applies temperature, then top-k, top-p and
min-p, and renormalises; greedy rows become a one-hot at their argmax so callers can treat every row
alike. The speculative worker uses the same functions on the target's and the draft's logits, so
rejection sampling compares the distributions actually used. Host-side flags (`RowFlags`) skip the
work no row needs, without reading device values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mleagle.engine.contract.sampling_params import SamplingParams


@dataclass(frozen=True)
class RowFlags:
    """What any row of a batch needs, known on the host from the requests' parameters."""

    all_greedy: bool = True
    penalties: bool = False
    filters: bool = False  # top-k or top-p below their neutral values
    min_p: bool = False
    bans: bool = False  # some request still has min_new_tokens to reach
    logprobs: int = -1  # the largest top-N asked (-1: no row wants logprobs)
    coupled: bool = False  # some sampled row brought its own seed (speculation draws from its tape)
    constrained: bool = False  # some row has a grammar or a logit bias (mleagle.engine.constrain)

    @property
    def plain(self) -> bool:
        """Every row is a greedy argmax of the raw logits: no per-row parameters are needed at all."""
        return self.all_greedy and not self.penalties and not self.bans and not self.constrained

    @staticmethod
    def of(params: Sequence[SamplingParams], vocab: int, min_new_active: Sequence[bool] | None = None) -> RowFlags:
        return RowFlags(
            all_greedy=all(p.greedy for p in params),
            penalties=any(p.has_penalties for p in params),
            filters=any((0 < p.top_k < vocab) or p.top_p < 1.0 for p in params if not p.greedy),
            min_p=any(p.min_p > 0 for p in params if not p.greedy),
            bans=any(min_new_active) if min_new_active is not None else any(p.min_new_tokens > 0 for p in params),
            logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        )


@dataclass
class SamplingRows:
    """Per logit row: the request's sampling parameters and its random-stream counters (device tensors)."""

    greedy: torch.Tensor  # [N] bool
    temperature: torch.Tensor  # [N] float32 (1.0 where greedy)
    top_k: torch.Tensor  # [N] int64 (vocab when disabled)
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    rep: torch.Tensor  # [N] float32 repetition penalty (1 = off)
    pres: torch.Tensor  # [N] float32
    freq: torch.Tensor  # [N] float32
    seed: torch.Tensor  # [N] int64
    pos: torch.Tensor  # [N] int64: the output index this row decides
    it: torch.Tensor  # [N] int64: speculative iteration (0 for plain decoding)
    flags: RowFlags = field(default_factory=RowFlags)
    # [N] bool: a sampled row whose request brought its own seed; under speculation its tokens are the
    # target-only draws of its (seed, position) tape (`SpecWorker._reject`). None: no such row.
    coupled: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return int(self.greedy.shape[0])


def rows_from_params(params: Sequence[SamplingParams], seeds: Sequence[int], pos: Sequence[int], vocab: int,
                     device: torch.device | str = "cpu", it: Sequence[int] | None = None) -> SamplingRows:
    """Host-built rows (tests, and the engine's slot-state admission uses the same field mapping)."""
    p = list(params)

    def t(vals: list, dt: torch.dtype) -> torch.Tensor:
        return torch.tensor(vals, dtype=dt, device=device)

    return SamplingRows(
        greedy=t([x.greedy for x in p], torch.bool),
        temperature=t([x.temperature if not x.greedy else 1.0 for x in p], torch.float32),
        top_k=t([x.top_k if 0 < x.top_k < vocab else vocab for x in p], torch.int64),
        top_p=t([x.top_p for x in p], torch.float32), min_p=t([x.min_p for x in p], torch.float32),
        rep=t([x.repetition_penalty for x in p], torch.float32), pres=t([x.presence_penalty for x in p], torch.float32),
        freq=t([x.frequency_penalty for x in p], torch.float32), seed=t(list(seeds), torch.int64),
        pos=t(list(pos), torch.int64), it=t(list(it) if it is not None else [0] * len(p), torch.int64),
        flags=RowFlags.of(p, vocab),
    )


def penalize(logits: torch.Tensor, rows: SamplingRows, counts: torch.Tensor | None = None,
             seen: torch.Tensor | None = None, ban: torch.Tensor | None = None) -> torch.Tensor:
    """Penalised and banned logits ([N, V] float32); returns `logits` itself when nothing applies.

    counts: [N, V] output-token counts; seen: [N, V] prompt-or-output membership; ban: [N, V] tokens
    this row may not emit (already restricted to rows still under their min_new_tokens)."""
    x = logits
    f = rows.flags
    if f.penalties and counts is not None and seen is not None:
        rep = rows.rep.view(-1, 1)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        c = counts.to(x.dtype)
        x = x - rows.freq.view(-1, 1) * c - rows.pres.view(-1, 1) * (c > 0).to(x.dtype)
    if f.bans and ban is not None:
        x = x.masked_fill(ban, float("-inf"))
    return x


def probs_from_logits(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """[N, V] (penalised) logits → [N, V] probabilities after temperature and top-k/top-p/min-p."""
    v = logits.shape[1]
    f = rows.flags
    probs = torch.softmax(logits / rows.temperature.view(-1, 1), dim=-1)
    if f.filters:
        sp, idx = probs.sort(dim=-1, descending=True)
        keep = torch.arange(v, device=logits.device).view(1, v) < rows.top_k.view(-1, 1)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it < p.
        keep &= (sp.cumsum(-1) - sp) < rows.top_p.view(-1, 1)
        keep[:, 0] = True
        probs = torch.zeros_like(probs).scatter_(1, idx, sp * keep)
    if f.min_p:
        probs = torch.where(probs >= rows.min_p.view(-1, 1) * probs.max(-1, keepdim=True).values, probs, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(rows.greedy.view(-1, 1), onehot, probs)
