"""Tensor-parallel groups, the collectives the layers call, and one forward's communication plan.

A `TPGroup` is (rank, size, process group). Every parallel layer is built with one and keeps it, so
layers of different sharding live side by side in one process: a replicated draft block holds the
size-1 group beside a sharded target, and a TP=1 reference engine runs beside a TP=2 one in tests.
With size 1 every collective is the identity and costs nothing. `current()` is the process's group
(set by `engine/service/ranks.py` when the rank joins), the default for layers built without one.

`Comm` is one forward's plan: the group, the layout and the forward's `RowMeta`. In the "all_reduce"
layout every rank holds every token and row-parallel outputs are all-reduced. In the "scattered"
layout the residual stream is split by tokens (padded to a multiple of the TP size): row-parallel
outputs are reduce-scattered, and the normed stream is all-gathered before each consumer that needs
every token (attention's and the MLP's column-parallel projections, the hidden states a draft reads,
the LM head's rows). Every gather takes its per-rank sizes from `RowMeta` (`global_num_tokens`,
`global_num_tokens_for_logprob`), the one row-count rule, and places each rank's rows at the offset
the counts give: a count that disagrees with the forward leaves rows unfilled, which is exactly the
failure the capture-vs-replay metadata checks exist to catch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from mleagle.engine.executor.forward_batch import ForwardBatch, RowMeta

# torch 2.13 renamed the single-tensor collectives; the GPU machine runs torch 2.11.
_all_gather_1 = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_1 = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True, eq=False)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None with size > 1: the default (world) group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Equal shards along dim 0, concatenated in rank order: [m, ...] → [size·m, ...]."""
        if self.size == 1:
            return x
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_1(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, each rank keeping its equal share of dim 0: [size·m, ...] → [m, ...]."""
        if self.size == 1:
            return x
        out = torch.empty((x.shape[0] // self.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        _reduce_scatter_1(out, x.contiguous(), group=self.group)
        return out

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel logits: each rank's [R, V/size] slice side by side → [R, V]."""
        if self.size == 1:
            return x
        g = self.all_gather(x)  # [size·R, Vs], rank-major
        r = x.shape[0]
        return g.view(self.size, r, -1).permute(1, 0, 2).reshape(r, -1)

    def gatherv(self, x: torch.Tensor, counts: Sequence[int], out_rows: int) -> torch.Tensor:
        """Rank r contributes `counts[r]` rows (x holds this rank's), placed at offset sum(counts[:r]) of
        an [out_rows, ...] buffer; rows no count covers stay zero. Equal counts that fill the buffer are
        one plain all-gather; otherwise each rank pads to the largest count first."""
        if self.size == 1:
            return x
        if x.shape[0] != counts[self.rank]:
            raise AssertionError(f"rank {self.rank} holds {x.shape[0]} rows, its count says {counts[self.rank]}")
        m = max(counts)
        if min(counts) == m and m * self.size == out_rows:
            return self.all_gather(x)
        if x.shape[0] < m:
            x = torch.cat([x, x.new_zeros((m - x.shape[0], *x.shape[1:]))])
        g = self.all_gather(x).view(self.size, m, *x.shape[1:])
        out = x.new_zeros((out_rows, *x.shape[1:]))
        off = 0
        for r, c in enumerate(counts):
            n = max(0, min(c, out_rows - off))
            out[off : off + n] = g[r, :n]
            off += c
        return out

    def shard(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {self.size}")
        return n // self.size


LOCAL = TPGroup()
_CURRENT = LOCAL


def current() -> TPGroup:
    """The process's tensor-parallel group (size 1 until a rank joins one)."""
    return _CURRENT


def set_current(g: TPGroup) -> None:
    global _CURRENT
    _CURRENT = g


def pad_to(x: int, n: int) -> int:
    return -(-x // n) * n


@dataclass(frozen=True, eq=False)
class Comm:
    """One forward's communication: the group, the layout and the row metadata its gathers follow."""

    tp: TPGroup
    layout: str = "all_reduce"
    meta: RowMeta | None = None

    @property
    def scattered(self) -> bool:
        return self.layout == "scattered" and self.tp.size > 1

    @property
    def local_tokens(self) -> int:
        assert self.meta is not None
        return self.meta.global_num_tokens[self.tp.rank]

    def _padded(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        return x if x.shape[0] == rows else torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])

    def scatter_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Partial sums over all tokens [T, H] → this rank's reduced token rows [T_pad/N, H]."""
        assert self.meta is not None
        return self.tp.reduce_scatter(self._padded(x, sum(self.meta.global_num_tokens)))

    def shard_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """A full tensor [T, H] (every rank holds it) → this rank's token rows, no communication."""
        assert self.meta is not None
        n = self.meta.global_num_tokens
        off = sum(n[: self.tp.rank])
        return self._padded(x, sum(n))[off : off + n[self.tp.rank]]

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's token rows → all tokens [T, H] (the padding cut off), sized by `global_num_tokens`."""
        assert self.meta is not None
        n = self.meta.global_num_tokens
        return self.tp.gatherv(x, n, pad_to(self.meta.num_tokens, self.tp.size))[: self.meta.num_tokens]


def comm_for(tp: TPGroup, layout: str, batch: ForwardBatch) -> Comm:
    """The plan of one forward: the batch's own metadata (a graph runner's, stamped at capture and
    checked at replay) or, for an eager batch without it, the row-count rule's."""
    if tp.size == 1:
        return Comm(tp, layout, None)
    meta = batch.row_meta if batch.row_meta is not None else batch.meta(tp.size, layout)  # type: ignore[arg-type]
    return Comm(tp, layout, meta)
