"""Measuring devices for speculation, kept out of the serving worker: the recompute boundary-KV
reference policy and forced acceptance. Neither serves requests; benchmarks and tests build an engine
with one of them (`Engine(..., spec_worker=RecomputeSpecWorker)`), and `SpecWorker` itself has no mode
for either.

`RecomputeSpecWorker` is the reference for the serving policy's staleness: after every iteration it
reads the accepted counts back and re-runs every draft layer over the whole committed sequence of each
request (O(sequence) per iteration), so every draft pool holds what a fresh prefill would. Running it
beside the serving worker on the same requests measures what staleness costs in acceptance. It needs
every committed position's target hidden state, which a prefix-cache hit never computes, so it refuses
to run with the cache on; and its iterations never replay the whole-iteration graph.

`ForcedAcceptSpecWorker` makes every iteration accept a fixed number of drafts (accept length n+1),
so the speed of speculation can be measured before a draft that earns it exists. Output is then not
the target's; every figure made with it must be labelled "simulated". Both run the full depth S
every iteration (speculation policy `always`). The count is a device scalar
read inside the captured graphs too.
"""

from __future__ import annotations

from typing import Any

import torch

from mleagle.engine.core.request import Req
from mleagle.engine.errors import EngineInputError
from mleagle.engine.executor.forward_batch import ForwardBatch, RowMeta
from mleagle.engine.executor.results import Pending, StepPlan, Timer
from mleagle.engine.executor.worker import GraphSettings
from mleagle.engine.sampling.processor import RowFlags
from mleagle.engine.spec.worker import SpecWorker


class RecomputeSpecWorker(SpecWorker):
    """The recompute boundary-KV policy (see the module docstring)."""

    def __init__(self, *args: Any, prefix_cache: bool = False, **kw: Any):
        """`prefix_cache`: whether the engine runs one (the builder passes it to every worker class)."""
        if prefix_cache:
            raise EngineInputError("the recompute boundary-KV reference needs the prefix cache off "
                                   "(enable_prefix_cache=false): a cache hit has no target hidden states to "
                                   "re-run the draft layers from")
        super().__init__(*args, **{**kw, "policy": "always"})  # it measures the full depth
        self._hidden: torch.Tensor | None = None

    def capture_graphs(self, s: GraphSettings) -> str:
        from dataclasses import replace

        return super().capture_graphs(replace(s, iteration=False)) + " (recompute reference: no iteration graph)"

    def _after_draft_prefill(self, reqs: list[Req], lens: list[int]) -> None:
        """Keep every committed position's target hidden state for the next full pass."""
        for r, n in zip(reqs, lens):
            r.draft_state.hidden_stash = [torch.cat(r.draft_state.hidden_stash)[:n]]

    def _draft_extend(self, rpi: torch.Tensor, view: ForwardBatch, target_hidden: torch.Tensor, emitted: torch.Tensor,
                      n: torch.Tensor, flags: RowFlags, timer: Timer | None, live: torch.Tensor | None = None,
                      eager: bool = False) -> list[RowMeta]:
        self._hidden = target_hidden  # the draft layers run in `launch`, over every committed position
        return []

    def launch(self, reqs: list[Req], plan: StepPlan | None = None) -> Pending:
        p = super().launch(reqs, plan)
        if p.done is not None:
            p.done.synchronize()
        assert self._hidden is not None
        w = p.width
        emitted = [[int(t) for t in row[: int(row[w])]] for row in p.packed.tolist()]
        for i, (r, toks) in enumerate(zip(p.reqs, emitted)):
            # The committed rows' target hidden (cloned: a graph's output buffer is rewritten next replay).
            r.draft_state.hidden_stash.append(self._hidden[i * w : i * w + len(toks)].clone())
            r.output_ids.extend(toks)  # temporarily: the windows read the committed tokens
            r.kv_len += len(toks)
        try:
            self._draft_prefill(p.reqs, [toks[-1] for toks in emitted])
        finally:
            for r, toks in zip(p.reqs, emitted):
                del r.output_ids[len(r.output_ids) - len(toks) :]
                r.kv_len -= len(toks)
        p.timer.mark()
        return p

    def _layer_spans(self, spans: list[float]) -> list[float]:
        return [sum(spans[1:]) / self.steps] * self.steps  # one span for the whole recompute pass

    def stale_positions(self, n: int, depth: int | None = None) -> int:
        return 0  # every draft position is recomputed from committed tokens


class ForcedAcceptSpecWorker(SpecWorker):
    """Every iteration accepts `accept` drafts (see the module docstring)."""

    def __init__(self, *args: Any, accept: int = 0, **kw: Any):
        super().__init__(*args, **{**kw, "policy": "always"})  # it measures the full depth
        self._accept_n = torch.full((), max(0, min(accept, self.steps)), dtype=torch.int64, device=self.device)

    def _forced(self) -> torch.Tensor | None:
        return self._accept_n
