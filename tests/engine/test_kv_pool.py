"""The KV pool's buffers: one allocation viewed per layer, zero, and on the CPU free until written (an
engine's start-up no longer writes every page of a pool it may never fill)."""

from __future__ import annotations

import torch

from mleagle.engine.memory.kv_pool import KVPool
from mleagle.engine.memory.zeros import lazy_zeros


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_a_large_cpu_pool_costs_only_what_is_written() -> None:
    before = rss_mb()
    pool = KVPool("p", 8, 1 << 16, 4, 64, torch.float32, "cpu")  # 1 GiB of K and V
    assert pool.nbytes == 8 * 2 * (1 << 16) * 4 * 64 * 4
    assert rss_mb() - before < 64  # nothing touched yet
    loc = torch.tensor([0, 5, 70_000 % (1 << 16)])
    k = torch.randn(3, 4, 64)
    pool.write(3, loc, k, -k)
    assert torch.equal(pool.k[3][loc], k) and torch.equal(pool.v[3][loc], -k)
    assert not pool.k[2][:4096].any() and not pool.v[7][1:5].any()  # (reading every page would map them)
    # Per-layer views of one buffer: writes to one layer land nowhere else.
    assert pool.k[3].data_ptr() != pool.k[4].data_ptr() and float(pool.k[4][loc].abs().sum()) == 0.0
    assert rss_mb() - before < 64


def test_lazy_zeros_shapes_dtypes_and_small_buffers() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for shape in ((3, 5), (1 << 12, 1 << 8)):  # below and above the lazy threshold
            t = lazy_zeros(shape, dtype, "cpu")
            assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
            assert not t.any()
            t[1, 2] = 7
            assert int(t.sum()) == 7
