"""Tensor-parallel group state: rank, world size and the collectives the layers call.

Layers are written tensor-parallel from the start (column/row-parallel linears, vocab-parallel
embedding and head) and ask this module for their shard. With world size 1 every collective is the
identity, so the CPU engine pays nothing; the TP issue initialises a real `torch.distributed` group
(gloo on CPU, NCCL on GPU) through `init_tp` without touching the layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None


_TP = TPGroup()


def tp() -> TPGroup:
    return _TP


def init_tp(rank: int, size: int, group: dist.ProcessGroup | None = None) -> None:
    global _TP
    _TP = TPGroup(rank, size, group)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
    dist.all_reduce(x, group=_TP.group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dim (vocab-parallel logits)."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=-1)


def shard(n: int, what: str) -> int:
    if n % _TP.size:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {_TP.size}")
    return n // _TP.size
