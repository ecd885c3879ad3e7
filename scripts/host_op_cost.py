"""What one small device operation costs the host on this machine: a 60-element host-to-device copy
(from pageable memory, from a fresh pinned copy, through a persistent pinned buffer) and a one-element
kernel, each with the device idle and with a sleep kernel in flight. `python scripts/host_op_cost.py`
on a CUDA machine; prints the median and p90 of 50 calls each. Much of an engine step's host time on a
GPU is such operations, launched one by one, so this says what one costs on that host, and whether
pinned memory would make the copies cheaper."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    a = np.arange(60)
    pin = torch.empty(4096, dtype=torch.int64, pin_memory=True)
    dst = torch.empty(4096, dtype=torch.int64, device="cuda")

    def persistent() -> None:
        pin[:60].numpy()[:] = a
        dst[:60].copy_(pin[:60], non_blocking=True)

    def probe(name: str, f: Callable[[], object], busy: bool) -> None:
        ts = []
        for _ in range(50):
            if busy:
                torch.cuda._sleep(int(2e6))  # keeps the device busy past the call
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
            torch.cuda.synchronize()
        ts.sort()
        print(f"{name:45s} {'busy' if busy else 'idle'}: median {ts[25] * 1e6:7.1f} us  p90 {ts[45] * 1e6:7.1f} us")

    for busy in (False, True):
        probe("pageable from_numpy(60).to(non_blocking)", lambda: torch.from_numpy(a).to("cuda", non_blocking=True), busy)
        probe("torch.tensor(list).to(non_blocking)", lambda: torch.tensor([1, 2, 3, 4]).to("cuda", non_blocking=True), busy)
        probe("pin_memory() then to", lambda: torch.from_numpy(a).pin_memory().to("cuda", non_blocking=True), busy)
        probe("persistent pinned buffer copy_", persistent, busy)
        probe("small kernel (add_)", lambda: dst.add_(1), busy)


if __name__ == "__main__":
    main()
