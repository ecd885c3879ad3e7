"""Forward batches: the mode, the token rows, where their KV goes, and the one rule for logit rows.

A `ForwardBatch` is an immutable view of one forward. Its `binding` names the runner, pools and
attention backend it is for; a runner refuses a batch bound to anything else. The speculative worker
derives each draft step's batch from one shared view with `dataclasses.replace`, changing only the
input ids, the input hidden states and the binding, so positions, slots, sequence lengths and
request indices are the same objects in every step. `num_logit_rows` is the single place that says
how many logit rows a forward makes; the logits buffer, the per-rank counts and (later) graph
capture metadata all derive from it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mleagle.engine.executor.runner import StepBinding


class ForwardMode(enum.Enum):
    EXTEND = "EXTEND"  # prefill (possibly one chunk of it), any number of tokens per request
    DECODE = "DECODE"  # one token per request
    TARGET_VERIFY = "TARGET_VERIFY"  # W = S+1 tokens per request: bonus + S drafts
    DRAFT_EXTEND = "DRAFT_EXTEND"  # draft step over the same W rows per request

    @property
    def uniform(self) -> bool:
        """Every request contributes the same number of rows (the batch is [bs, W])."""
        return self is not ForwardMode.EXTEND


def num_logit_rows(mode: ForwardMode, bs: int, width: int = 1, *, all_rows: bool = False,
                   num_tokens: int = 0, pruned: bool = False) -> int:
    """The one rule for how many logit rows a forward produces.

    DECODE: one per request. TARGET_VERIFY: every row (bs·W). DRAFT_EXTEND: bs·W un-pruned, bs when
    pruned to each request's last accepted row. EXTEND: the last token of each request, or every
    token when prompt logprobs are wanted (`all_rows`).
    """
    if mode is ForwardMode.DECODE:
        return bs
    if mode is ForwardMode.TARGET_VERIFY:
        return bs * width
    if mode is ForwardMode.DRAFT_EXTEND:
        return bs if pruned else bs * width
    return num_tokens if all_rows else bs


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] KV slot each row writes
    req_pool_indices: torch.Tensor  # [bs]
    seq_lens: torch.Tensor  # [bs] KV length after this forward (prefix + this forward's rows)
    extend_lens: list[int]  # rows per request in this forward (host-side; no device sync)
    prefix_lens: list[int]  # KV length before this forward (host-side)
    logit_rows: torch.Tensor  # [num_logit_rows] row indices into [T]
    binding: StepBinding | None = None
    width: int = 1
    hidden_in: torch.Tensor | None = None  # [T, H] input hidden states (draft steps)
    rids: tuple[str, ...] = field(default=())
    all_logit_rows: bool = False  # EXTEND: logits for every row (prompt logprobs)
    pruned: bool = False  # DRAFT_EXTEND: logits only at each request's last accepted row

    @property
    def expected_logit_rows(self) -> int:
        return num_logit_rows(self.mode, self.bs, self.width, all_rows=self.all_logit_rows,
                              num_tokens=self.num_tokens, pruned=self.pruned)

    @property
    def bs(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens_cpu(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]


def build_batch(mode: ForwardMode, *, input_ids: list[int] | torch.Tensor, req_pool_indices: list[int],
                prefix_lens: list[int], extend_lens: list[int], req_to_token: torch.Tensor,
                width: int = 1, all_logit_rows: bool = False, pruned_rows: list[int] | None = None,
                device: torch.device | str = "cpu", rids: tuple[str, ...] = ()) -> ForwardBatch:
    """Build the host-side view of a forward from per-request lengths and the slot map.

    Positions are prefix_len..prefix_len+extend_len-1 per request and the KV slots come from the
    request-to-token map, so every runner (whose maps hold the same slots) writes the same rows.
    """
    bs = len(extend_lens)
    if mode.uniform and any(e != width for e in extend_lens):
        raise ValueError(f"{mode.value} needs exactly {width} rows per request, got {extend_lens}")
    pos = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)]) if bs else torch.zeros(0, dtype=torch.int64)
    rpi = torch.tensor(req_pool_indices, dtype=torch.int64)
    row_req = torch.repeat_interleave(rpi, torch.tensor(extend_lens))
    loc = req_to_token[row_req, pos]
    ends = torch.tensor(extend_lens).cumsum(0) - 1 if bs else torch.zeros(0, dtype=torch.int64)
    if pruned_rows is not None:
        rows = torch.tensor(pruned_rows, dtype=torch.int64)
    elif mode is ForwardMode.EXTEND and not all_logit_rows:
        rows = ends
    elif mode is ForwardMode.DECODE:
        rows = torch.arange(bs)
    else:
        rows = torch.arange(int(sum(extend_lens)))
    n = num_logit_rows(mode, bs, width, all_rows=all_logit_rows, num_tokens=int(sum(extend_lens)),
                       pruned=pruned_rows is not None)
    if rows.numel() != n:
        raise AssertionError(f"logit rows {rows.numel()} != num_logit_rows {n} for {mode.value}")
    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(input_ids, dtype=torch.int64)
    return ForwardBatch(
        mode=mode, input_ids=ids.to(device), positions=pos.to(device), out_cache_loc=loc.to(device),
        req_pool_indices=rpi.to(device), seq_lens=torch.tensor([p + e for p, e in zip(prefix_lens, extend_lens)], device=device),
        extend_lens=list(extend_lens), prefix_lens=list(prefix_lens), logit_rows=rows.to(device),
        width=width, rids=rids, all_logit_rows=all_logit_rows, pruned=pruned_rows is not None,
    )
