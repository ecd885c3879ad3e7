"""Model runners: one model, its own KV pool, request map and attention backend, behind one binding.

Each runner owns exactly one `StepBinding` (runner, KV pool, request-to-token map, backend), built
with its own pool and backend; `ModelRunner.bind(batch)` stamps a batch view with it and every path
into the model — `forward`, `forward_eager`, a graph replay, a graph capture (which runs
`forward_eager` on the graph runner's buffers) — refuses a batch that carries a different binding
(`check_binding`). There is no shared "current pool" anywhere, so a draft step cannot silently read or
write another step's KV. Runners know nothing of speculation: the speculative worker composes them. A
runner may own graphs (`GraphRunner`s, set by its worker's capture: the full-depth iteration's shape
in `graphs`, the speculation policy's shallower ones in `more_graphs`; prefill by token bucket in
`extend_graphs`): `forward` replays a captured graph when the batch fits one and runs eagerly
otherwise, counting every eager forward by its reason.
Under tensor parallelism an eager forward stamps the batch with the row-count rule's per-rank counts
(`row_meta`) before the model runs, so every gather of the forward is sized by the rule.
`build_runner` makes a runner with pools sized for a model's attention layers.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from mleagle.engine.attention import create_backend
from mleagle.engine.executor.capture import GraphStats
from mleagle.engine.executor.forward_batch import (
    BindingError,
    ForwardBatch,
    ForwardMode,
    ForwardOutput,
    Layout,
    RowMeta,
    StepBinding,
    check_binding,
    row_meta,
)
from mleagle.engine.memory.kv_pool import KVPool
from mleagle.engine.memory.req_to_token import ReqToTokenPool


class Graphs(Protocol):
    """A runner's captured graphs (`GraphRunner`), as the runner and telemetry see them."""

    mode: ForwardMode
    width: int
    buckets: list[int]
    stats: GraphStats

    def fits(self, batch: ForwardBatch) -> str | None: ...

    def run(self, batch: ForwardBatch) -> ForwardOutput: ...


class ModelRunner:
    def __init__(self, name: str, model: nn.Module, kv_pool: KVPool, req_to_token: ReqToTokenPool,
                 backend: Any):
        if backend.kv_pool is not kv_pool or backend.req_to_token is not req_to_token:
            raise BindingError(f"runner {name}: backend built for other pools")
        self.name = name
        self.model = model
        self._binding = StepBinding(name, kv_pool, req_to_token, backend)
        self.num_forwards = 0
        # Called after every forward with (runner, batch, output): the engine process's telemetry hook.
        self.observer: Callable[[ModelRunner, ForwardBatch, ForwardOutput], None] | None = None
        self.graphs: Graphs | None = None  # the full-depth iteration's shape (what telemetry shows)
        self.more_graphs: list[Graphs] = []  # other shapes: the shallower iterations of the spec policy
        self.extend_graphs: Graphs | None = None  # prefill (EXTEND) by token bucket (`ExtendGraphRunner`)
        self.no_graph_reason = "cpu" if kv_pool.k[0].device.type == "cpu" else "disabled"
        self.no_extend_reason = self.no_graph_reason  # why prefill runs eagerly when it has no graphs
        self.eager: Counter[str] = Counter()  # eager forwards by why no graph ran


    @property
    def binding(self) -> StepBinding:
        """Read-only: a runner's pools and backend are fixed at construction (rebinding a shared
        runner object per step is the bug class this design rules out)."""
        return self._binding

    def bind(self, batch: ForwardBatch) -> ForwardBatch:
        return dataclasses.replace(batch, binding=self.binding)

    @property
    def tp_size(self) -> int:
        return int(getattr(self.model, "tp_size", 1))

    @property
    def layout(self) -> Layout:
        return getattr(self.model, "layout", "all_reduce")

    def row_meta(self, batch: ForwardBatch) -> RowMeta:
        """The row counts this runner's forward of `batch` is sized by: the batch's own (a graph bucket's)
        or the rule's for this runner's tensor-parallel size and layout."""
        return batch.row_meta if batch.row_meta is not None else batch.meta(self.tp_size, self.layout)

    def rule_meta(self, mode: ForwardMode, bs: int, width: int, pruned: bool = False) -> RowMeta:
        """The rule's row counts of a uniform forward of this runner (what a graph of it records)."""
        return row_meta(mode, bs, width, pruned=pruned, tp_size=self.tp_size, layout=self.layout)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Replay a graph where the batch fits one, else run eagerly (and count why)."""
        check_binding(batch, self.binding, f"runner {self.name}")
        if batch.mode is ForwardMode.EXTEND:
            g = self.extend_graphs
            why = g.fits(batch) if g is not None else self.no_extend_reason
            if why is not None:
                g = None
        else:
            why = self.graphs.fits(batch) if self.graphs is not None else self.no_graph_reason
            g = self.graphs
            if why is not None:
                g = next((m for m in self.more_graphs if m.fits(batch) is None), None)
        if g is None:
            assert why is not None  # the primary graph did not fit, or there is none
            self.eager[why] += 1
            return self.forward_eager(batch, reason=why)
        res = g.run(batch)
        self.num_forwards += 1
        if self.observer is not None:
            self.observer(self, batch, res)
        return res

    @torch.inference_mode()
    def forward_eager(self, batch: ForwardBatch, *, observe: bool = True, reason: str | None = None) -> ForwardOutput:
        """The reference forward (graph capture runs it too, on the graph runner's buffers)."""
        check_binding(batch, self.binding, f"runner {self.name}")
        if self.tp_size > 1 and batch.row_meta is None:
            # Every tensor-parallel gather of this forward is sized by the one row-count rule.
            batch = dataclasses.replace(batch, row_meta=self.row_meta(batch))
        self.binding.backend.plan(batch)
        hidden = self.model(batch)
        m: Any = self.model  # a target (`logits`: its own head over the batch) or a draft layer
        if hasattr(m, "logits"):
            logits = m.logits(hidden, batch).float()
        else:
            logits = m.compute_logits(hidden[batch.logit_rows]).float()
        rows = batch.expected_logit_rows
        if logits.shape[0] != rows:
            raise AssertionError(f"{self.name}: {logits.shape[0]} logit rows, the rule says {rows}")
        res = ForwardOutput(logits, hidden, eager_reason=reason)
        if observe:
            self.num_forwards += 1
            if self.observer is not None:
                self.observer(self, batch, res)
        return res


def rank_heads(model: nn.Module) -> tuple[int, int]:
    """(query heads, KV heads) of this rank's attention in `model` (a target or one draft layer)."""
    block = getattr(model, "block", None)
    attn = block.self_attn if block is not None else model.layers[0].self_attn  # type: ignore[index,union-attr]
    return int(attn.hq), int(attn.hk)


def build_runner(name: str, model: nn.Module, *, num_slots: int, head_dim: int, backend: str, max_reqs: int,
                 max_context: int, dtype: torch.dtype, device: torch.device | str, page_size: int,
                 r2t: ReqToTokenPool | None = None) -> ModelRunner:
    """A runner with its own KV pool (this rank's KV heads for each of the model's attention layers,
    `num_kv_layers`: the target's decoder layers or a draft step's blocks), request-to-token map (`r2t`
    where given: the draft runners' are made together, `ReqToTokenPool.stacked`) and attention backend."""
    hq, hk = rank_heads(model)
    layers: Any = model.num_kv_layers  # the target's decoder layers or a draft step's blocks
    pool = KVPool(name, int(layers), num_slots, hk, head_dim, dtype, device, page_size)
    r2t = r2t if r2t is not None else ReqToTokenPool(name, max_reqs, max_context, device)
    return ModelRunner(name, model, pool, r2t, create_backend(backend, pool, r2t, hq))
