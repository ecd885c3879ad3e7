"""Fixtures shared by several test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module of tiny matrices (restored afterwards): on a loaded 2-core box two
    OpenMP threads can be 10x slower than one. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
