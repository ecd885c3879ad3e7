"""A grammar-constrained drafting iteration under CUDA graphs: a chain of small graphs, so the host's
grammar work runs while the device computes.

A greedy iteration whose requests carry grammars masks its verify rows and each of its draft steps.
The verify rows' masks were made by the drafting before (draft step j's mask is verify row j's), so
they are known at launch; but draft step k's mask is the grammar after the tokens this iteration
accepts and the drafts d1..dk it proposes, which the host's matchers see only once the device made
them. One graph of the whole iteration cannot hold that; a graph per piece, with the host stepping
in between, can, and each host step overlaps a forward that does not need its result:

    verify forward  |  masks of the verify rows (kept)          ->  the forward half (`launch_split`)
    accept          |  (result copy starts)
    draft 0 forward |  host: the accepted tokens into the matchers, draft step 0's masks
    select 0        |  (d1 copy starts)
    draft 1 forward |  host: d1 into the matchers (tentatively), draft step 1's masks
    select 1        |  ...
    select S-1      |  host, at the result's `finish`: dS, the bonus row's mask, the drafts rolled back

`accept` masks the verify logits from the static verify-mask buffer, accepts, commits the slot
state and packs the result; `draft k` runs draft runner k over the same rows (its input window and
hidden states from static buffers); `select k` masks draft k's logits with the static draft-mask
buffer (mapped to the draft's vocabulary), takes the argmax and writes draft k+1 and the next window.
Every view is built from the lengths the slot state had before `accept` committed (`kv`), so all
pieces see the positions and slots of one iteration, as the whole-iteration graph does. Each piece is
an `IterationGraph` per batch bucket (emulated on the CPU, the same buffers with eager bodies).
The matchers take each step's tokens as soon as they are on the host (here, not at `finish`), so a
later step may commit before the scheduler applies this one: the cuts travel with the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from mleagle.engine.constrain.bitmask import apply_bitmask
from mleagle.engine.executor.forward_batch import ForwardMode, RowMeta
from mleagle.engine.executor.iteration_graph import IterationGraph, MaskedGraphs
from mleagle.engine.executor.results import Pending, SplitLaunch, device_wait, unpack
from mleagle.engine.executor.worker import MASKED

Body = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[RowMeta]]]


class MaskedChain:
    # `worker` is the `SpecWorker` that owns the chain (typed Any: this module is imported by it).
    def __init__(self, worker: Any, fwd: IterationGraph, pool: object | None, emulate: bool) -> None:
        w = self.w = worker
        s, dev = w.steps, w.device
        self.steps, self.width = s, s + 1
        rows = fwd.buckets[-1]
        heads = [w._layer(k).head.vocab_ids for k in range(s)]
        vd = max(w.vocab if v is None else int(v.shape[0]) for v in heads)
        # The static buffers between the pieces (for the largest bucket; a piece reads its bucket's rows).
        self.kv = torch.zeros(rows, dtype=torch.int64, device=dev)  # lengths before the commit
        self.ids = torch.zeros(rows, self.width, dtype=torch.int64, device=dev)  # the next draft step's window
        self.n = torch.zeros(rows, dtype=torch.int64, device=dev)  # accepted drafts
        self.dlogits = torch.zeros(rows, vd, dtype=torch.float32, device=dev)  # the last draft step's logits
        self.dmask = torch.zeros(rows, w.constrain.words, dtype=torch.int32, device=dev)  # its masks (host-filled)
        self.d = torch.zeros(rows, dtype=torch.int64, device=dev)  # its drafts, for the host
        hid = w._layer(1).hidden_in_size if s > 1 and w.chain else 1
        self.h = torch.zeros(rows * self.width, hid, dtype=w.hidden_dtype, device=dev)  # chain: its hidden states
        # Each select's drafts on their way to the host (pinned; read before the next iteration reuses them).
        self.dhost = torch.zeros(s, rows, dtype=torch.int64, pin_memory=dev.type == "cuda")

        def piece(name: str, body: Body, meta: Callable[[int], list[RowMeta]]) -> IterationGraph:
            def run(rpi: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, list[RowMeta]]:
                w.depth = s  # captured (and, emulated, replayed) at full depth
                return body(rpi, live)

            def m(pbs: int) -> list[RowMeta]:
                w.depth = s
                return meta(pbs)

            return IterationGraph(f"grammar-masked {name}", run, m, fwd.buckets, w.target.binding.req_to_token.pad_row,
                                  dev, emulate=emulate, pool=pool, rows_of=fwd)  # the rows the forward set

        self.accept = piece("accept", self._accept, lambda pbs: [])
        self.draft = [piece(f"draft {k}", self._draft(k), self._meta(k)) for k in range(s)]
        self.select = [piece(f"select {k}", self._select(k), lambda pbs: []) for k in range(s)]

    @property
    def pieces(self) -> list[IterationGraph]:
        """The rest of the iteration after its forward half, in the order they run."""
        out = [self.accept]
        for k in range(self.steps):
            out += [self.draft[k], self.select[k]]
        return out

    def _meta(self, k: int) -> Callable[[int], list[RowMeta]]:
        return lambda pbs: self.w.iteration_meta(pbs)[1 + k : 2 + k]

    # --- the pieces' bodies (captured per bucket) -----------------------------------------------
    def _accept(self, rpi: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, list[RowMeta]]:
        w, pbs = self.w, int(rpi.shape[0])
        assert w._mlogits is not None
        view, drafts = w._verify_view(rpi, w.capture_view(pbs))
        self.kv[:pbs].copy_(w.state.kv_len[rpi])
        with w.constrain.static_masks():  # the verify rows' masks: the static buffer's
            emitted, n, packed = w._accept(w._mlogits[: view.num_tokens], rpi, live, MASKED, drafts, self.width)
        self.ids[:pbs].copy_(emitted)
        self.n[:pbs].copy_(n)
        return packed, []

    def _draft(self, k: int) -> Body:
        def body(rpi: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, list[RowMeta]]:
            w, pbs, wd = self.w, int(rpi.shape[0]), self.width
            rows = pbs * wd
            view = w.view(ForwardMode.TARGET_VERIFY, rpi, self.ids[:pbs], wd, w._arange(rows), w.capture_view(pbs),
                          kv_lens=self.kv[:pbs])
            sel = w._arange(pbs) * wd + self.n[:pbs]  # each request's last accepted row
            assert w._mhidden is not None
            h = w._mhidden[:rows] if k == 0 or not w.chain else self.h[:rows]
            runner = w.drafts[k]
            b = dataclasses.replace(view, mode=ForwardMode.DRAFT_EXTEND, logit_rows=sel, pruned=True,
                                    input_ids=self.ids[:pbs].reshape(-1), hidden_in=h, binding=runner.binding)
            w.forwards = []
            o = w._forward(runner, b, True)
            vd = int(o.logits.shape[1])
            self.dlogits[:pbs, :vd].copy_(o.logits)
            if w.chain and k + 1 < self.steps:
                self.h[:rows].copy_(o.hidden)
            return self.dlogits[:pbs, :vd], [runner.row_meta(b)]

        return body

    def _select(self, k: int) -> Body:
        def body(rpi: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, list[RowMeta]]:
            w, pbs = self.w, int(rpi.shape[0])
            vocab_ids = w._layer(k).head.vocab_ids
            allowed = w.constrain.dmask.expand(self.dmask[:pbs])
            if vocab_ids is not None:
                allowed = allowed[:, vocab_ids]
            # A row with nothing allowed in the draft's vocabulary drafts unmasked (its verify row rejects it).
            allowed = allowed | ~allowed.any(-1, keepdim=True)
            logits = apply_bitmask(self.dlogits[:pbs, : allowed.shape[1]], allowed)
            d, ids = w.state.draft_greedy(logits, vocab_ids, rpi, k, live, self.ids[:pbs], self.n[:pbs])
            self.ids[:pbs].copy_(ids)
            self.d[:pbs].copy_(d)
            return self.d[:pbs], []

        return body

    # --- one iteration (the host's side) ----------------------------------------------------------
    def run(self, s: SplitLaunch) -> Pending:
        """The rest of a masked drafting iteration whose verify forward (`s`) is launched."""
        w, c = self.w, self.w.constrain
        bs, rpi = len(s.reqs), s.rpi
        c.fill_static(bs, self.width)  # the verify rows' masks, kept by the drafting before
        packed, _ = self.accept.run(rpi, bs)
        w.forwards = w.replay_forwards(s.reqs, s.pbs)
        p = w._send(s.reqs, self.width, s.flags, packed, s.timer)  # the result on its way (its event)
        self.draft[0].run(rpi, bs)  # needs no mask: runs while the matchers take the accepted tokens
        if p.done is not None:
            device_wait.wait(p.done)
        p.cuts = c.commit_rows([toks for toks, _ in unpack(p)])
        d: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        for k in range(self.steps):
            c.fill_draft_static(k, bs, self.dmask)
            self.select[k].run(rpi, bs)
            d = self._to_host(k, bs)
            if k + 1 < self.steps:
                self.draft[k + 1].run(rpi, bs)
                c.draft_accept(self._read(d), k)  # while draft k+1's forward runs
        s.timer.mark()
        p.plan, p.masked = s.plan, True
        last, cons = d, s.cons
        assert last is not None

        def deferred() -> None:  # at the result's finish: dS, the bonus row's mask, the rollback
            c.draft_accept(self._read(last), self.steps - 1, cons)

        p.deferred = deferred
        return p

    def _to_host(self, k: int, bs: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Select k's drafts on their way to the host (queued behind it, ahead of the next forward)."""
        host = self.dhost[k, :bs]
        if not host.is_pinned():
            return host.copy_(self.d[:bs]), None
        host.copy_(self.d[:bs], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return host, ev

    @staticmethod
    def _read(d: tuple[torch.Tensor, torch.cuda.Event | None]) -> list[int]:
        if d[1] is not None:
            device_wait.wait(d[1])
        return d[0].tolist()

    def graphs(self, forward: IterationGraph) -> MaskedGraphs:
        return MaskedGraphs(forward, self.pieces)
