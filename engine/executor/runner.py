"""Model runners and step bindings.

A `StepBinding` is the explicit value that says which runner, KV pool, request-to-token map and
attention backend one forward uses. Each runner owns exactly one binding, built with its own pool
and backend; `ModelRunner.bind(batch)` stamps a batch view with it and `ModelRunner.forward`
refuses any batch that carries a different binding. There is no shared "current pool" anywhere, so
a draft step cannot silently read or write another step's KV. Runners know nothing of speculation:
the speculative worker composes them. A runner may own a `GraphRunner` (CUDA graphs of its uniform
forwards): `forward` checks the binding first, then replays a captured graph when the batch fits one
and runs eagerly otherwise, counting every eager forward by its reason. Under tensor parallelism an
eager forward stamps the batch with the row-count rule's per-rank counts (`row_meta`) before the model
runs, so every gather of the forward is sized by the rule.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from mleagle.engine.executor.graph_runner import GraphRunner

from mleagle.engine.attention.base import AttentionBackend, BindingError
from mleagle.engine.executor.forward_batch import ForwardBatch, ForwardMode, Layout, RowMeta, row_meta
from mleagle.engine.memory.kv_pool import KVPool
from mleagle.engine.memory.req_to_token import ReqToTokenPool


@dataclass(frozen=True, eq=False)
class StepBinding:
    name: str
    kv_pool: KVPool
    req_to_token: ReqToTokenPool
    backend: AttentionBackend


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [num_logit_rows, V] float32
    hidden: torch.Tensor  # [T, H] last layer's hidden before the final norm
    graph_bs: int = 0  # the bucket a graph replay ran at; 0 = eager
    eager_reason: str | None = None


class ModelRunner:
    def __init__(self, name: str, model: nn.Module, kv_pool: KVPool, req_to_token: ReqToTokenPool,
                 backend: AttentionBackend):
        if backend.kv_pool is not kv_pool or backend.req_to_token is not req_to_token:
            raise BindingError(f"runner {name}: backend built for other pools")
        self.name = name
        self.model = model
        self._binding = StepBinding(name, kv_pool, req_to_token, backend)
        self.num_forwards = 0
        # Called after every forward with (runner, batch, output): the engine's telemetry hook.
        self.observer: Callable[[ModelRunner, ForwardBatch, ForwardOutput], None] | None = None
        self.graphs: GraphRunner | None = None
        self.no_graph_reason = "cpu" if kv_pool.k[0].device.type == "cpu" else "disabled"
        self.eager: Counter[str] = Counter()  # eager forwards by why no graph ran

    def eager_reason(self) -> str | None:
        """Why an EXTEND (prefill) forward of this runner ran eagerly: prefill is never captured."""
        return "extend" if self.graphs is not None else self.no_graph_reason

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
        if batch.binding is not self.binding:
            raise BindingError(f"runner {self.name} refuses a batch bound to "
                               f"{batch.binding.name if batch.binding else 'nothing'}")
        why = self.graphs.fits(batch) if self.graphs is not None else self.no_graph_reason
        if why is None:
            assert self.graphs is not None
            res = self.graphs.run(batch)
            self.num_forwards += 1
            if self.observer is not None:
                self.observer(self, batch, res)
            return res
        self.eager[why] += 1
        return self.forward_eager(batch, reason=why)

    @torch.inference_mode()
    def forward_eager(self, batch: ForwardBatch, *, observe: bool = True, reason: str | None = None) -> ForwardOutput:
        """The reference forward (graph capture runs it too, on the graph runner's buffers)."""
        if batch.binding is not self.binding:
            raise BindingError(f"runner {self.name} refuses a batch bound to "
                               f"{batch.binding.name if batch.binding else 'nothing'}")
        if self.tp_size > 1 and batch.row_meta is None:
            # Every tensor-parallel gather of this forward is sized by the one row-count rule.
            batch = dataclasses.replace(batch, row_meta=self.row_meta(batch))
        self.binding.backend.plan(batch)
        hidden = self.model(batch)
        if hasattr(self.model, "logits"):
            logits = self.model.logits(hidden, batch).float()
        else:
            logits = self.model.compute_logits(hidden[batch.logit_rows]).float()
        rows = batch.expected_logit_rows
        if logits.shape[0] != rows:
            raise AssertionError(f"{self.name}: {logits.shape[0]} logit rows, the rule says {rows}")
        res = ForwardOutput(logits, hidden, eager_reason=reason)
        if observe:
            self.num_forwards += 1
            if self.observer is not None:
                self.observer(self, batch, res)
        return res
