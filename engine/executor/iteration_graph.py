"""Whole-iteration CUDA graphs: one replay per decode step (target-only) or per speculative iteration.

The per-runner `GraphRunner`s replay each forward, but a step also gathers its rows from the slot
state, samples, accepts, writes the state back and packs its results: dozens of small launches the
host issues one by one, which at batch 1 cost more time than the forwards. For the common case — every
request greedy, no penalties, no logprobs — a worker hands its whole device-side iteration (`body`) to
an `IterationGraph`, which captures it per batch-size bucket. The only inputs are the request rows
(`rpi`, padded with the pad row) and the live-row count; the body computes positions, slots and
lengths from the slot state, runs every forward eagerly inside the capture (each through its own
runner's `forward_eager`, so each runner's binding check holds at capture as in eager mode), accepts,
commits only live rows (padded rows never change the state or a real request's KV: they read and write
the pad row and the pad slot), and writes one packed result. A replay is then one small copy, one fill
and one graph launch. Row metadata is recorded per bucket at capture (`row_meta` of every forward) and
must equal the live batch's after padding at replay, as for the per-runner graphs. Emulated on the CPU:
the same buffers and masking with the body run eagerly.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mleagle.engine.executor.forward_batch import RowMeta
from mleagle.engine.executor.graph_runner import MetaMismatch, bucket_for


@dataclass
class IterationCapture:
    graph: torch.cuda.CUDAGraph | None
    out: torch.Tensor | None
    meta: list[RowMeta]


@dataclass
class IterationGraphStats:
    replays: Counter[int] = field(default_factory=Counter)
    capture_s: float = 0.0
    capture_mb: float = 0.0


# body(rpi [pbs], live [pbs] bool) -> (packed [pbs, K] float64, row metadata of each forward it ran)
Body = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[RowMeta]]]
MetaFn = Callable[[int], list[RowMeta]]  # padded bs -> the metadata a live batch of that bucket produces


class IterationGraph:
    def __init__(self, name: str, body: Body, meta: MetaFn, buckets: list[int], pad_row: int,
                 device: torch.device, emulate: bool = False, pool: object | None = None):
        self.name, self.body, self.meta = name, body, meta
        self.buckets = sorted(set(buckets))
        self.pad_row, self.emulate, self.pool = pad_row, emulate, pool
        mb = self.buckets[-1]
        self.rpi = torch.full((mb,), pad_row, dtype=torch.int64, device=device)
        self.nreal = torch.zeros((), dtype=torch.int64, device=device)
        self.ar = torch.arange(mb, device=device)
        self.caps: dict[int, IterationCapture] = {}
        self.stats = IterationGraphStats()

    def bucket(self, bs: int) -> int | None:
        return bucket_for(self.buckets, bs)

    def _live(self, pbs: int) -> torch.Tensor:
        return self.ar[:pbs] < self.nreal

    def capture(self) -> None:
        t0 = time.perf_counter()
        cuda = not self.emulate
        free0 = torch.cuda.mem_get_info()[0] if cuda else 0
        self.nreal.fill_(0)  # every row padding: a capture changes no request's state
        for pbs in sorted(self.buckets, reverse=True):
            self.rpi[:pbs].fill_(self.pad_row)
            if not cuda:
                _, meta = self.body(self.rpi[:pbs], self._live(pbs))
                self.caps[pbs] = IterationCapture(None, None, meta)
                continue
            for _ in range(2):  # warm-up outside the capture: Triton JIT, cuBLAS handles
                self.body(self.rpi[:pbs], self._live(pbs))
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out, meta = self.body(self.rpi[:pbs], self._live(pbs))
            self.caps[pbs] = IterationCapture(g, out, meta)
        if cuda:
            torch.cuda.synchronize()
            self.stats.capture_mb = (free0 - torch.cuda.mem_get_info()[0]) / 2**20
        self.stats.capture_s = time.perf_counter() - t0

    def run(self, rpi: torch.Tensor, bs: int) -> tuple[torch.Tensor, int]:
        """Replay for `bs` live requests (rows `rpi`); returns (packed rows [bs, K], bucket)."""
        pbs = self.bucket(bs)
        assert pbs is not None and pbs in self.caps
        cap = self.caps[pbs]
        meta = self.meta(pbs)
        if meta != cap.meta:
            raise MetaMismatch(f"{self.name} iteration bs {bs}→{pbs}: replay {meta} != capture {cap.meta}")
        self.rpi[:bs].copy_(rpi)
        self.rpi[bs:pbs].fill_(self.pad_row)
        self.nreal.fill_(bs)
        if cap.graph is None:
            out, _ = self.body(self.rpi[:pbs], self._live(pbs))
        else:
            cap.graph.replay()
            out = cap.out
            assert out is not None
        self.stats.replays[pbs] += 1
        return out[:bs], pbs
