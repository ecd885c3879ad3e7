"""The one capture skeleton every CUDA graph of the engine goes through, and the bucket rule.

A graph is captured per padded batch size (bucket), largest first so that smaller graphs reuse the
memory pool's blocks. For each bucket `prepare(pbs)` fills the fixed inputs (every row padding) and
returns the metadata a replay of that bucket is sized by; on CUDA `body(pbs)` then runs twice outside
the capture (Triton JIT, cuBLAS handles and lazy inits must not happen inside it) and once inside it,
and its output tensors are what every replay rewrites. Each graph is then replayed once on its
all-padding inputs, so its first launch (the upload) is paid at start-up. `check(pbs, meta, out)` runs after each
bucket: it compares the recorded metadata (and, on CUDA, the captured output's shapes) with an
independent computation of what a live batch of that bucket needs, so a graph recording the wrong row
counts fails at start-up, never silently at serving time. Emulated (no CUDA: the CPU tests) only
`prepare` and `check` run; replays then run the body eagerly on the same buffers. Per-forward graphs
(`GraphRunner`) and whole-iteration graphs (`IterationGraph`) differ only in their three callbacks.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from mleagle.engine.executor.forward_batch import ForwardOutput

M = TypeVar("M")
Out = TypeVar("Out")


class MetaMismatch(AssertionError):
    """A graph's recorded row metadata differs from what a live batch of its bucket needs."""


def default_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, every 16 to 256: dense where decode batches usually are."""
    b = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 257, 16)]
    return sorted({x for x in b if x < max_bs} | {max_bs})


def bucket_for(buckets: list[int], bs: int) -> int | None:
    """The smallest captured batch size (ascending `buckets`) that holds `bs` requests, or None."""
    return next((b for b in buckets if b >= bs), None)


@dataclass
class Capture(Generic[M, Out]):
    graph: torch.cuda.CUDAGraph | None  # None: emulated (the body runs eagerly at replay)
    out: Out | None
    meta: M


@dataclass
class GraphStats:
    replays: Counter[int] = field(default_factory=Counter)
    eager: Counter[str] = field(default_factory=Counter)
    capture_s: float = 0.0
    capture_mb: float = 0.0


def capture_buckets(buckets: list[int], prepare: Callable[[int], M], body: Callable[[int], Out],
                    check: Callable[[int, M, Out | None], None], *, emulate: bool, pool: Any,
                    stats: GraphStats) -> dict[int, Capture[M, Out]]:
    """Capture `body` for every bucket (see the module docstring); fills `stats` with time and memory."""
    t0 = time.perf_counter()
    cuda = not emulate
    free0 = torch.cuda.mem_get_info()[0] if cuda else 0
    caps: dict[int, Capture[M, Out]] = {}
    with _no_gc(cuda):
        _capture_all(buckets, prepare, body, check, cuda, pool, caps)
    if cuda:
        # One replay of each graph on its all-padding inputs (they touch only the pad slot and pad row):
        # a graph's first launch uploads it, and that cost belongs to start-up, not to a first request.
        for cap in caps.values():
            assert cap.graph is not None
            cap.graph.replay()
        torch.cuda.synchronize()
        stats.capture_mb = (free0 - torch.cuda.mem_get_info()[0]) / 2**20
    stats.capture_s = time.perf_counter() - t0
    return caps


def _capture_all(buckets: list[int], prepare: Callable[[int], M], body: Callable[[int], Out],
                 check: Callable[[int, M, Out | None], None], cuda: bool, pool: Any,
                 caps: dict[int, Capture[M, Out]]) -> None:
    for pbs in sorted(set(buckets), reverse=True):
        meta = prepare(pbs)
        if not cuda:
            check(pbs, meta, None)
            caps[pbs] = Capture(None, None, meta)
            continue
        for _ in range(2):
            body(pbs)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            out = body(pbs)
        check(pbs, meta, out)
        caps[pbs] = Capture(g, out, meta)


@contextlib.contextmanager
def _no_gc(on: bool) -> Iterator[None]:
    """Python's cyclic garbage collector off while graphs are captured (after one collection): a
    collection during a capture can free another engine's graphs, and destroying a graph is not
    permitted while a stream captures, which invalidates the capture in progress (seen on the H200:
    every later capture of that process then failed too). torch no longer collects before a capture."""
    if not on or not gc.isenabled():
        yield
        return
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def held_output(store: dict[int, ForwardOutput], key: int, out: ForwardOutput) -> ForwardOutput:
    """An emulated replay's output copied into bucket `key`'s own tensors, which its next replay
    rewrites as a graph's are: a caller that keeps a view past that fails on the CPU too."""
    held = store.get(key)
    if (held is None or held.logits.shape != out.logits.shape or held.hidden.shape != out.hidden.shape
            or (held.tokens is None) != (out.tokens is None)):
        held = store[key] = ForwardOutput(out.logits.clone(), out.hidden.clone(),
                                          tokens=out.tokens.clone() if out.tokens is not None else None)
    else:
        held.logits.copy_(out.logits)
        held.hidden.copy_(out.hidden)
        if held.tokens is not None and out.tokens is not None:
            held.tokens.copy_(out.tokens)
    return held
