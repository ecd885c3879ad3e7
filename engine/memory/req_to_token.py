"""The request-to-token map: request slot × position → KV slot, plus the request-slot free list.

Each runner has its own map object (the contents are the same across runners: the shared allocator
decides the slots); the scheduler's memory manager writes every runner's map when it allocates. The
draft runners' maps are each a slice of one stacked tensor (`stacked`, the maps' `group`), so one write
fills all of them: on a GPU each write is a copy the host pays a launch for, at every arrival and every
block of pages a decoding request takes, and S+1 of them per allocation were most of a speculative
server's allocation cost. The maps stay distinct tensors (their own storage, their own objects), so a
forward bound to the wrong runner's map is still refused by the binding check, not hidden by sharing. The map
has one row more than there are request slots: the pad row (`pad_row`), all zeros, so a padded graph
row reads and writes only the pad slot 0 and never a real request's KV.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, name: str, max_reqs: int, max_context: int, device: torch.device | str,
                 group: torch.Tensor | None = None, index: int = 0):
        self.name = name
        self.max_reqs, self.max_context = max_reqs, max_context
        self.pad_row = max_reqs
        # `group`: the [n, rows, context] tensor this map is slice `index` of (`stacked`), else None.
        self.group = group
        self.req_to_token: torch.Tensor = group[index] if group is not None else torch.zeros(
            max_reqs + 1, max_context, dtype=torch.int64, device=device)

    @staticmethod
    def stacked(names: list[str], max_reqs: int, max_context: int, device: torch.device | str) -> list[ReqToTokenPool]:
        """Maps named `names`, each a slice of one tensor that a single write fills for all of them."""
        group = torch.zeros(len(names), max_reqs + 1, max_context, dtype=torch.int64, device=device)
        return [ReqToTokenPool(n, max_reqs, max_context, device, group, k) for k, n in enumerate(names)]
