"""Model runners and step bindings.

A `StepBinding` is the explicit value that says which runner, KV pool, request-to-token map and
attention backend one forward uses. Each runner owns exactly one binding, built with its own pool
and backend; `ModelRunner.bind(batch)` stamps a batch view with it and `ModelRunner.forward`
refuses any batch that carries a different binding. There is no shared "current pool" anywhere, so
a draft step cannot silently read or write another step's KV. Runners know nothing of speculation:
the speculative worker composes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mleagle.engine.attention.base import AttentionBackend, BindingError
from mleagle.engine.executor.forward_batch import ForwardBatch
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

    @property
    def binding(self) -> StepBinding:
        """Read-only: a runner's pools and backend are fixed at construction (rebinding a shared
        runner object per step is the bug class this design rules out)."""
        return self._binding

    def bind(self, batch: ForwardBatch) -> ForwardBatch:
        return dataclasses.replace(batch, binding=self.binding)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        if batch.binding is not self.binding:
            raise BindingError(f"runner {self.name} refuses a batch bound to "
                               f"{batch.binding.name if batch.binding else 'nothing'}")
        self.binding.backend.plan(batch)
        hidden = self.model(batch)
        logits = self.model.compute_logits(hidden[batch.logit_rows]).float()
        rows = batch.expected_logit_rows
        if logits.shape[0] != rows:
            raise AssertionError(f"{self.name}: {logits.shape[0]} logit rows, the rule says {rows}")
        self.num_forwards += 1
        res = ForwardOutput(logits, hidden)
        if self.observer is not None:
            self.observer(self, batch, res)
        return res
