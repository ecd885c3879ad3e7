"""The CPU's linear products (engine/layers/linear.py): each path the row count picks equals F.linear,
the packed weight follows writes to the weight, and the engine's setting turns the packed path off."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from mleagle.engine.layers import linear as L

needs_packed = pytest.mark.skipif(not L.PACKED_AVAILABLE, reason="this torch build has no oneDNN packed linear")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 8, 33, 64, 65, 300])
def test_every_row_count_equals_f_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 40, generator=g)
    torch.testing.assert_close(L.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    strided = torch.randn(rows, 80, generator=g)[:, ::2]  # a view, as a sliced hidden state is
    torch.testing.assert_close(L.linear(strided, w), F.linear(strided, w), rtol=1e-5, atol=1e-5)


@needs_packed
def test_the_packed_weight_is_made_once_and_again_after_a_write() -> None:
    w = torch.randn(64, 32)
    x = torch.randn(5, 32)
    y = L.linear(x, w)
    first = w._mleagle_packed[1]  # type: ignore[attr-defined]
    L.linear(x, w)
    assert w._mleagle_packed[1] is first  # type: ignore[attr-defined]
    w.mul_(3)  # a load or a training step writes the weight: the packed copy must follow
    torch.testing.assert_close(L.linear(x, w), 3 * y, rtol=1e-5, atol=1e-5)
    assert w._mleagle_packed[1] is not first  # type: ignore[attr-defined]
    # A product that autograd must see takes F.linear (the packed product has no backward).
    wg = torch.randn(64, 32, requires_grad=True)
    L.linear(x, wg).sum().backward()
    assert wg.grad is not None and not hasattr(wg, "_mleagle_packed")


@needs_packed
def test_the_engine_setting_turns_the_packed_path_off() -> None:
    from mleagle.engine.core.engine import Engine

    try:
        Engine("tiny-dummy", device="cpu", dtype="float32", cpu_packed_linear=False, max_running_requests=2,
               max_total_tokens=512, draft="none")
        assert L.PACKED["on"] is False
        w, x = torch.randn(16, 8), torch.randn(4, 8)
        L.linear(x, w)
        assert not hasattr(w, "_mleagle_packed")
        Engine("tiny-dummy", device="cpu", dtype="float32", max_running_requests=2, max_total_tokens=512, draft="none")
        assert L.PACKED["on"] is True
    finally:
        L.PACKED["on"] = L.PACKED_AVAILABLE


@needs_packed
def test_the_packed_copies_stay_off_where_they_would_not_fit_in_memory() -> None:
    """The packed copies hold the weights a second time: an engine whose float32 matrices would take
    over half the available memory keeps MKL's products and says why; with room, or with the amount
    unknown, it packs. Shared weights (a tied head) count once."""
    from mleagle.engine.core.engine import Engine

    try:
        e = Engine("tiny-dummy", device="cpu", dtype="float32", max_running_requests=2, max_total_tokens=512,
                   draft="none")
        mods = [r.model for r in e.runners]
        fits, n = L.packed_fits(mods, None)
        mats = {id(p): p for m in mods for p in m.parameters() if p.dim() == 2}
        assert fits and n == sum(p.numel() * 4 for p in mats.values()) > 0
        assert e.packed_linear["on"] and L.PACKED["on"] and e.stats()["cpu_packed_linear"]["on"]
        assert L.packed_fits(mods, 2 * n) == (True, n) and L.packed_fits(mods, 2 * n - 1) == (False, n)
        info = e._packed_linear(available=n)  # half of what is left is less than the copies
        assert info["on"] is False and L.PACKED["on"] is False and "available memory" in info["reason"]
        w, x = torch.randn(16, 8), torch.randn(4, 8)
        L.linear(x, w)
        assert not hasattr(w, "_mleagle_packed")
        assert e._packed_linear(available=None)["on"] and L.PACKED["on"]
        if os.path.exists("/proc/meminfo"):  # Linux: the kernel's figure, in bytes
            free = L.available_memory()
            assert free is not None and 2**20 < free < 2**50
    finally:
        L.PACKED["on"] = L.PACKED_AVAILABLE
