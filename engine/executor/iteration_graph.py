"""Whole-iteration CUDA graphs: one replay per decode step (target-only) or per speculative iteration.

The per-runner `GraphRunner`s replay each forward, but a step also gathers its rows from the slot
state, samples, accepts, writes the state back and packs its results: dozens of small launches the
host issues one by one, which at batch 1 cost more time than the forwards. For the common case — every
request greedy, no penalties, no logprobs — a worker hands its whole device-side iteration (`body`) to
an `IterationGraph`, which captures it per batch-size bucket through the shared skeleton
(`capture.py`). The only inputs are the request rows (`rpi`, padded with the pad row) and the live-row
count; the body computes positions, slots and lengths from the slot state, runs every forward eagerly
inside the capture (each through its own runner's `forward_eager`, so each runner's binding check
holds at capture as in eager mode), accepts, commits only live rows (padded rows never change the state
or a real request's KV: they read and write the pad row and the pad slot), and writes one packed
result. A replay is then one small copy, one fill and one graph launch. At capture the row metadata of
every forward the body ran is checked against the rule's for a live batch of the bucket (`meta`), so
a body that builds a forward of the wrong shape fails at start-up. Emulated on the CPU: the same
buffers and masking with the body run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mleagle.engine.executor.capture import Capture, GraphStats, MetaMismatch, bucket_for, capture_buckets
from mleagle.engine.executor.forward_batch import RowMeta

# body(rpi [pbs], live [pbs] bool) -> (packed [pbs, K] float64, row metadata of each forward it ran)
Body = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[RowMeta]]]
MetaFn = Callable[[int], list[RowMeta]]  # padded bs -> the metadata a live batch of that bucket produces


class IterationGraph:
    def __init__(self, name: str, body: Body, meta: MetaFn, buckets: list[int], pad_row: int,
                 device: torch.device, emulate: bool = False, pool: object | None = None,
                 rows_of: IterationGraph | None = None):
        self.name, self.body, self.meta = name, body, meta
        self.buckets = sorted(set(buckets))
        self.pad_row, self.emulate, self.pool = pad_row, emulate, pool
        mb = self.buckets[-1]
        self.rpi: torch.Tensor
        self.nreal: torch.Tensor
        self.ar: torch.Tensor
        # A later piece of one iteration shares the first piece's rows, which that one sets at its replay.
        self.shares_rows = rows_of is not None
        if rows_of is not None:
            assert rows_of.buckets == self.buckets
            self.rpi, self.nreal, self.ar = rows_of.rpi, rows_of.nreal, rows_of.ar
        else:
            self.rpi = torch.full((mb,), pad_row, dtype=torch.int64, device=device)
            self.nreal = torch.zeros((), dtype=torch.int64, device=device)
            self.ar = torch.arange(mb, device=device)
        self.caps: dict[int, Capture[list[RowMeta], torch.Tensor]] = {}
        self.stats = GraphStats()

    def bucket(self, bs: int) -> int | None:
        return bucket_for(self.buckets, bs)

    def _live(self, pbs: int) -> torch.Tensor:
        return self.ar[:pbs] < self.nreal

    def capture(self) -> None:
        self.nreal.fill_(0)  # every row padding: a capture changes no request's state
        seen: dict[int, list[RowMeta]] = {}
        rows: dict[int, int] = {}

        def prepare(pbs: int) -> list[RowMeta]:
            self.rpi[:pbs].fill_(self.pad_row)
            if self.emulate:  # the forwards the body runs and its result's rows (on CUDA: from `body`)
                out, seen[pbs] = self.body(self.rpi[:pbs], self._live(pbs))
                rows[pbs] = out.shape[0]
            return self.meta(pbs)

        def body(pbs: int) -> torch.Tensor:
            out, metas = self.body(self.rpi[:pbs], self._live(pbs))
            seen[pbs] = metas
            return out

        def check(pbs: int, meta: list[RowMeta], out: torch.Tensor | None) -> None:
            if seen.get(pbs) != meta:
                raise MetaMismatch(f"{self.name} iteration bucket {pbs}: its forwards ran with {seen.get(pbs)}; "
                                   f"a live batch of the bucket needs {meta}")
            n = out.shape[0] if out is not None else rows.get(pbs, pbs)
            if n != pbs:
                raise MetaMismatch(f"{self.name} iteration bucket {pbs}: packed result of {n} rows")

        self.caps = capture_buckets(self.buckets, prepare, body, check, emulate=self.emulate, pool=self.pool,
                                    stats=self.stats)

    def run(self, rpi: torch.Tensor, bs: int) -> tuple[torch.Tensor, int]:
        """Replay for `bs` live requests (rows `rpi`; a piece that shares another's rows finds them set
        by that one's replay of this iteration); returns (packed rows [bs, K], bucket)."""
        pbs = self.bucket(bs)
        assert pbs is not None and pbs in self.caps
        cap = self.caps[pbs]
        if not self.shares_rows:
            self.rpi[:bs].copy_(rpi)
            self.rpi[bs:pbs].fill_(self.pad_row)
            self.nreal.fill_(bs)
        if cap.graph is None:
            out, _ = self.body(self.rpi[:pbs], self._live(pbs))
        else:
            cap.graph.replay()
            assert cap.out is not None
            out = cap.out
        self.stats.replays[pbs] += 1
        return out[:bs], pbs


@dataclass
class MaskedGraphs:
    """A grammar-masked iteration's graphs at one depth: its forward half, which needs no mask, then the
    pieces of the rest, between which the host fills masks (one piece at depth 0: mask, sample and
    commit; a chain of them at a drafting depth, `mleagle.engine.spec.masked_chain`)."""

    forward: IterationGraph
    rest: list[IterationGraph]

    @property
    def replays(self) -> int:
        """Iterations run (each replays its first piece once)."""
        return sum(self.rest[0].stats.replays.values())

    def graphs(self) -> list[IterationGraph]:
        return [self.forward, *self.rest]
