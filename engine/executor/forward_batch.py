"""Forward batches: the mode, the token rows, where their KV goes, and the one rule for logit rows.

A `ForwardBatch` is an immutable view of one forward. Its `binding` names the runner, pools and
attention backend it is for; a runner refuses a batch bound to anything else. The speculative worker
derives each draft step's batch from one shared view with `dataclasses.replace`, changing only the
input ids, the input hidden states and the binding, so positions, slots, sequence lengths and
request indices are the same objects in every step. `num_logit_rows` is the single place that says
how many logit rows a forward makes; `row_meta` derives from it everything else that counts rows (the
per-rank token and logprob counts of both tensor-parallel layouts, which the graph runners record at
capture and recompute at replay, and telemetry publishes). `build_batch` builds a view from host lists
(prefill); `uniform_batch` builds decode / verify views from the device-resident slot state, so a decode
iteration needs no per-request host lists and no device round trip.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
import torch

from mleagle.engine.memory.kv_pool import KVPool
from mleagle.engine.memory.req_to_token import ReqToTokenPool


class BindingError(RuntimeError):
    """A forward reached a runner, pool or backend it is not bound to."""


class Backend(Protocol):
    """What a binding needs of an attention backend (`mleagle.engine.attention.base.AttentionBackend`):
    the pools it was built for, and the plan it makes per forward."""

    name: str
    kv_pool: KVPool
    req_to_token: ReqToTokenPool
    supports_graphs: bool
    needs_host_lens: bool

    def plan(self, batch: ForwardBatch) -> None: ...

    def init_graph(self, max_bs: int, max_width: int) -> None: ...


@dataclass(frozen=True, eq=False)
class StepBinding:
    """Which runner, KV pool, request-to-token map and attention backend one forward uses. Each runner
    owns exactly one, built with its own pool and backend; a batch carries the one it was bound to."""

    name: str
    kv_pool: KVPool
    req_to_token: ReqToTokenPool
    backend: Backend


def check_binding(batch: ForwardBatch, binding: StepBinding, who: str) -> None:
    """Refuse a batch bound to anything but `binding` (runner, graph runner: the one check of every path)."""
    if batch.binding is not binding:
        raise BindingError(f"{who} refuses a batch bound to {batch.binding.name if batch.binding else 'nothing'}")


@dataclass
class ForwardOutput:
    """One forward's results: `num_logit_rows` logit rows and the last layer's hidden states."""

    logits: torch.Tensor  # [num_logit_rows, V] float32
    hidden: torch.Tensor  # [T, H] last layer's hidden before the final norm
    graph_bs: int = 0  # the bucket a graph replay ran at; 0 = eager
    eager_reason: str | None = None
    # A target's prefill graph also takes each request's greedy first token and commits the ones its
    # batch asked it to (`ExtendGraphRunner.stage`): those tokens, [bs]. None elsewhere.
    tokens: torch.Tensor | None = None


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


Layout = Literal["all_reduce", "scattered"]


@dataclass(frozen=True)
class RowMeta:
    """Row counts of one forward, all from `num_logit_rows`: what a graph records at capture and a live
    batch must reproduce after padding. Per rank: `global_num_tokens[r]` tokens and
    `global_num_tokens_for_logprob[r]` logit rows. In the all-reduce layout every rank holds every token
    and row; in the token-scattered layout tokens and rows are padded to a multiple of the TP size and
    split evenly, so the gathers before the consumer and the head are equal-sized."""

    mode: ForwardMode
    bs: int
    width: int
    pruned: bool
    num_tokens: int
    logit_rows: int
    layout: Layout
    tp_size: int
    global_num_tokens: tuple[int, ...]
    global_num_tokens_for_logprob: tuple[int, ...]

    @property
    def agree(self) -> bool:
        """The per-rank counts are consistent with the row-count rule for this layout."""
        n = self.tp_size
        if len(self.global_num_tokens) != n or len(self.global_num_tokens_for_logprob) != n:
            return False
        if self.layout == "all_reduce":
            return (all(t == self.num_tokens for t in self.global_num_tokens)
                    and all(r == self.logit_rows for r in self.global_num_tokens_for_logprob))
        return (sum(self.global_num_tokens) == _pad(self.num_tokens, n)
                and sum(self.global_num_tokens_for_logprob) == _pad(self.logit_rows, n)
                and len(set(self.global_num_tokens)) == 1 and len(set(self.global_num_tokens_for_logprob)) == 1)


def _pad(x: int, n: int) -> int:
    return -(-x // n) * n


def row_meta(mode: ForwardMode, bs: int, width: int = 1, *, pruned: bool = False, num_tokens: int | None = None,
             all_rows: bool = False, tp_size: int = 1, layout: Layout = "all_reduce") -> RowMeta:
    """The one place that turns (mode, bs, width, pruned) into every row count of a forward."""
    t = num_tokens if num_tokens is not None else bs * width
    rows = num_logit_rows(mode, bs, width, all_rows=all_rows, num_tokens=t, pruned=pruned)
    if layout == "all_reduce":
        gnt, gntl = (t,) * tp_size, (rows,) * tp_size
    else:
        gnt, gntl = (_pad(t, tp_size) // tp_size,) * tp_size, (_pad(rows, tp_size) // tp_size,) * tp_size
    return RowMeta(mode, bs, width, pruned, t, rows, layout, tp_size, gnt, gntl)


@dataclass(frozen=True, eq=False)
class HostArrays:
    """What `build_batch` computed on the host, each beside the device tensor it became: a prefill graph
    packs its fixed buffers from these in one copy instead of a device copy per field. A value is used
    only while the batch still holds that very tensor (`get`), so a field replaced since (a draft's
    input ids, say) is copied from the device as before."""

    fields: dict[str, tuple[np.ndarray, torch.Tensor]]

    def get(self, name: str, dev: torch.Tensor) -> np.ndarray | None:
        got = self.fields.get(name)
        return got[0] if got is not None and got[1] is dev else None


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
    # Host bound on every seq_len of the batch (exact for prefill; for device-built decode views an upper
    # bound that covers an iteration still in flight). Backends size gathers by it without a sync.
    max_seq_len: int = 0
    graph_bs: int = 0  # the padded batch size a graph replay ran at (0: eager); set by the graph runner
    # The row counts this forward's tensor-parallel gathers follow: a graph runner's bucket views carry
    # their capture's (checked at replay); an eager forward under TP is stamped by its runner from the
    # rule. None elsewhere (a TP-size-1 eager forward gathers nothing).
    row_meta: RowMeta | None = None
    # A prefill graph's EXTEND view (`ExtendGraphRunner`): each request's first query row and row count
    # on the device, and the bucket's token count bounding every request's rows, so the attention
    # kernel's grid and its inputs stay fixed across replays. None / 0 for an eager EXTEND (the backend
    # builds them from the host lists).
    extend_start: torch.Tensor | None = None
    extend_lens_t: torch.Tensor | None = None
    max_extend: int = 0
    host: HostArrays | None = None  # `build_batch`'s host values (None for a device-built view)

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

    def meta(self, tp_size: int = 1, layout: Layout = "all_reduce") -> RowMeta:
        return row_meta(self.mode, self.bs, self.width, pruned=self.pruned, num_tokens=self.num_tokens,
                        all_rows=self.all_logit_rows, tp_size=tp_size, layout=layout)


def ragged_rows(prefix_lens: list[int], extend_lens: list[int], req_pool_indices: list[int],
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A ragged batch's host arithmetic, in numpy (a prefill step does it for every request it carries,
    and each small torch op costs a few microseconds where numpy's costs one): each token row's position
    (prefix_len..prefix_len+extend_len-1 per request) and request slot, then per request its slot, first
    row, last row and KV length after the forward."""
    el = np.asarray(extend_lens, dtype=np.int64)
    pl = np.asarray(prefix_lens, dtype=np.int64)
    rpi = np.asarray(req_pool_indices, dtype=np.int64)
    ends = np.cumsum(el)
    starts = ends - el
    pos = np.arange(int(ends[-1]) if el.size else 0, dtype=np.int64) + np.repeat(pl - starts, el)
    return pos, np.repeat(rpi, el), rpi, starts, ends - 1, pl + el


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
    pos, row_req, rpi, _, last, seq = ragged_rows(prefix_lens, extend_lens, req_pool_indices)
    n_tok = int(pos.size)
    if pruned_rows is not None:
        rows = np.asarray(pruned_rows, dtype=np.int64)
    elif mode is ForwardMode.EXTEND and not all_logit_rows:
        rows = last
    elif mode is ForwardMode.DECODE:
        rows = np.arange(bs, dtype=np.int64)
    else:
        rows = np.arange(n_tok, dtype=np.int64)
    n = num_logit_rows(mode, bs, width, all_rows=all_logit_rows, num_tokens=n_tok, pruned=pruned_rows is not None)
    if rows.size != n:
        raise AssertionError(f"logit rows {rows.size} != num_logit_rows {n} for {mode.value}")
    # Everything the host built goes to the device in one non-blocking copy, split there into views:
    # a copy per tensor costs a launch each, and a prefill's first token waits for all of them. (Indexing
    # a CUDA tensor with CPU indices would copy them synchronously, waiting for the iteration in flight.)
    # Input ids already on the device (a draft's) are not copied back and forth.
    on_host = not isinstance(input_ids, torch.Tensor) or input_ids.device.type == "cpu"
    host = [pos, row_req, rpi, seq, rows]
    if on_host:
        host.append(input_ids.to(torch.int64).numpy() if isinstance(input_ids, torch.Tensor)
                    else np.asarray(input_ids, dtype=np.int64))
    pos_d, row_req_d, rpi_d, seq_d, rows_d, *rest = torch.from_numpy(np.concatenate(host)).to(
        device, non_blocking=True).split_with_sizes([t.size for t in host])
    ids_d = rest[0] if on_host else input_ids.to(device, non_blocking=True)  # type: ignore[union-attr]
    kept = {"positions": (pos, pos_d), "req_pool_indices": (rpi, rpi_d), "logit_rows": (rows, rows_d),
            "row_req": (row_req, row_req_d)}
    if on_host:
        kept["input_ids"] = (host[-1], ids_d)
    if req_to_token.device == pos_d.device:
        loc = req_to_token[row_req_d, pos_d]
    else:
        loc = req_to_token[torch.from_numpy(row_req).to(req_to_token.device),
                           torch.from_numpy(pos).to(req_to_token.device)].to(device)
    return ForwardBatch(
        mode=mode, input_ids=ids_d, positions=pos_d, out_cache_loc=loc,
        req_pool_indices=rpi_d, seq_lens=seq_d,
        extend_lens=list(extend_lens), prefix_lens=list(prefix_lens), logit_rows=rows_d,
        width=width, rids=rids, all_logit_rows=all_logit_rows, pruned=pruned_rows is not None,
        max_seq_len=max((p + e for p, e in zip(prefix_lens, extend_lens)), default=0), host=HostArrays(kept),
    )


def uniform_batch(mode: ForwardMode, *, input_ids: torch.Tensor, req_pool_indices: torch.Tensor,
                  kv_lens: torch.Tensor, req_to_token: torch.Tensor, width: int, host_kv_lens: list[int],
                  max_seq_len: int, logit_rows: torch.Tensor, pruned: bool = False,
                  rids: tuple[str, ...] = ()) -> ForwardBatch:
    """A DECODE / TARGET_VERIFY / DRAFT_EXTEND view computed on the device from the slot state.

    Request b's W rows sit at positions kv_lens[b] .. kv_lens[b]+W-1 (kv_lens: [bs] device, the KV
    length before this forward) and write the slots the request-to-token map holds there. Nothing is
    read back: `host_kv_lens` (the host's view, exact unless an iteration is still in flight) and
    `max_seq_len` (a bound covering that) are the host-side description the backends may use."""
    bs = int(req_pool_indices.shape[0])
    ar = torch.arange(width, device=kv_lens.device)
    pos = kv_lens.view(-1, 1) + ar.view(1, -1)  # [bs, W]
    loc = req_to_token[req_pool_indices.view(-1, 1), pos]
    return ForwardBatch(
        mode=mode, input_ids=input_ids.reshape(-1), positions=pos.view(-1), out_cache_loc=loc.view(-1),
        req_pool_indices=req_pool_indices, seq_lens=kv_lens + width, extend_lens=[width] * bs,
        prefix_lens=list(host_kv_lens), logit_rows=logit_rows, width=width, rids=rids, pruned=pruned,
        max_seq_len=max_seq_len,
    )
