"""Vocab-parallel token embedding and LM head.

Each rank holds a contiguous slice of the vocabulary. The embedding masks ids outside its slice and
all-reduces; the head computes logits for its slice and the logits processor gathers them. A tied
head shares the embedding's parameter object, so the weights are held once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mleagle.engine.distributed import all_gather_last_dim, all_reduce, tp
from mleagle.engine.layers.linear import linear


def _vocab_range(vocab: int) -> tuple[int, int]:
    per = -(-vocab // tp().size)  # ceil: the last shard may be short
    start = tp().rank * per
    return start, min(vocab, start + per)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.start, self.end = _vocab_range(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp().size == 1:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.start) & (ids < self.end)
        y = F.embedding(torch.where(inside, ids - self.start, 0), self.weight)
        y = y * inside.unsqueeze(-1).to(y.dtype)
        return all_reduce(y)

    def load(self, w: torch.Tensor) -> None:
        self.weight.data.copy_(w[self.start : self.end])


class ParallelLMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 tied: VocabParallelEmbedding | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        if tied is not None:
            self.weight = tied.weight  # the same Parameter: one copy in memory
        else:
            s, e = _vocab_range(vocab_size)
            self.weight = nn.Parameter(torch.empty(e - s, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(linear(h, self.weight))
        return logits[..., : self.vocab_size]

    def load(self, w: torch.Tensor) -> None:
        s, e = _vocab_range(self.vocab_size)
        self.weight.data.copy_(w[s:e])
