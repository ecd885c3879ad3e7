"""The request-to-token map: request slot × position → KV slot, plus the request-slot free list.

Each runner has its own map object (the contents are the same across runners: the shared allocator
decides the slots); the scheduler's memory manager writes every runner's map when it allocates. The map
has one row more than there are request slots: the pad row (`pad_row`), all zeros, so a padded graph
row reads and writes only the pad slot 0 and never a real request's KV.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, name: str, max_reqs: int, max_context: int, device: torch.device | str):
        self.name = name
        self.max_reqs, self.max_context = max_reqs, max_context
        self.pad_row = max_reqs
        self.req_to_token = torch.zeros(max_reqs + 1, max_context, dtype=torch.int64, device=device)
