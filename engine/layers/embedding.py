"""Vocab-parallel token embedding and LM head.

The vocabulary is padded to a multiple of the TP size and split into equal shards, so the logits
gather is one equal-sized all-gather (rows past the real vocabulary are zero and cut off). The
embedding masks ids outside its shard and all-reduces (or, in the token-scattered layout, leaves the
partial sums to a reduce-scatter). The head's `logits` computes only the rows that need logits: in the
all-reduce layout every rank holds every row; in the token-scattered layout rank r normalises its
`global_num_tokens_for_logprob[r]` rows and the rows are all-gathered by those counts before the head,
then each rank's vocab slice is gathered. A tied head shares the embedding's parameter object, so the
weights are held once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mleagle.engine.distributed import Comm, TPGroup, current, pad_to
from mleagle.engine.layers.linear import linear


def vocab_shard(vocab: int, tp: TPGroup) -> tuple[int, int]:
    """(start, rows) of this rank's shard of the padded vocabulary: equal shards of ceil(V/N)."""
    per = -(-vocab // tp.size)
    return tp.rank * per, per


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or current()
        self.vocab_size = vocab_size
        self.start, per = vocab_shard(vocab_size, self.tp)
        self.end = min(vocab_size, self.start + per)  # real ids of this shard; the rest is padding
        self.weight = nn.Parameter(torch.empty(per, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.start) & (ids < self.end)
        y = F.embedding(torch.where(inside, ids - self.start, 0), self.weight)
        y = y * inside.unsqueeze(-1).to(y.dtype)
        return self.tp.all_reduce(y) if reduce else y

    def load(self, w: torch.Tensor) -> None:
        n = self.end - self.start
        self.weight.data[:n].copy_(w[self.start : self.end])
        self.weight.data[n:].zero_()


class ParallelLMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 tied: VocabParallelEmbedding | None = None, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tied.tp if tied is not None else (tp or current())
        self.vocab_size = vocab_size
        if tied is not None:
            self.weight = tied.weight  # the same Parameter: one copy in memory
        else:
            _, per = vocab_shard(vocab_size, self.tp)
            self.weight = nn.Parameter(torch.empty(per, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of rows every rank holds: [R, H] → [R, V]."""
        return self.tp.gather_vocab(linear(h, self.weight))[..., : self.vocab_size]

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor, norm: nn.Module, comm: Comm) -> torch.Tensor:
        """The final norm and the head over the rows that need logits (`rows` index `hidden` [T, H],
        which every rank holds), gathered by the forward's per-rank logprob counts."""
        if not comm.scattered:
            x = norm(hidden[rows])
            m = comm.meta
            if m is not None and x.shape[0] != m.global_num_tokens_for_logprob[comm.tp.rank]:
                raise AssertionError(f"{x.shape[0]} logit rows on rank {comm.tp.rank}, the metadata says "
                                     f"{m.global_num_tokens_for_logprob[comm.tp.rank]}")
            return self(x)
        m = comm.meta
        assert m is not None
        n, r = comm.tp.size, comm.tp.rank
        counts = m.global_num_tokens_for_logprob
        # The buffer is sized by the row-count rule; the counts say which rows each rank fills.
        total = pad_to(m.logit_rows, n)
        off = sum(counts[:r])
        idx = torch.cat([rows, rows.new_zeros(total - rows.shape[0])]) if total > rows.shape[0] else rows
        mine = idx[off : off + counts[r]]
        if mine.shape[0] < counts[r]:  # a count past the buffer (only a wrong count gets here)
            mine = torch.cat([mine, mine.new_zeros(counts[r] - mine.shape[0])])
        x = comm.tp.gatherv(norm(hidden[mine]), counts, total)
        return self(x)[: rows.shape[0]]

    def load(self, w: torch.Tensor) -> None:
        s, per = vocab_shard(self.vocab_size, self.tp)
        n = max(0, min(self.vocab_size, s + per) - s)
        self.weight.data[:n].copy_(w[s : s + n])
        self.weight.data[n:].zero_()
