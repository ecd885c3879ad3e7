"""The target-only worker: prefill chunks and decode steps over the target runner, device-resident.

A worker turns scheduled requests into forward batches, runs them on its runners and samples. The
scheduler owns memory and request life; the worker owns forwards, the per-slot device state
(`SlotState`) and its runners' CUDA graphs (`capture_graphs`: each runner's uniform forward through
a `GraphRunner`, and the whole device-side iteration through an `IterationGraph`, both on the one
capture skeleton; prefill by token bucket through an `ExtendGraphRunner` per runner). Prefill is
host-described (ragged chunks): it replays a prefill graph where the chunk fits one, else runs
eagerly, and its first tokens come back like an iteration's results, read only when the scheduler
applies the step (`settle_prefill`), after it has launched the next iteration. A decode step is `launch`
(gather the batch's rows from the slot state, forward, sample, scatter the new state back, and start
one non-blocking copy of the results into pinned memory) then `finish` (wait for that copy, turn it
into per-request results). `launch` replays the whole-iteration graph where `iteration_miss` finds no
reason against it, and otherwise runs the same body with each forward replaying its runner's graph or
running eagerly; the reason is kept with the step. Nothing in between reads the device, so the engine
can launch step N+1 before it finishes step N (overlap scheduling). The speculative worker
(`mleagle.engine.spec.worker`) overrides the iteration body, the forwards it reports and the graph
modes. `lookahead` says how many KV positions one decode step writes per request beyond `kv_len`. A
request that hit the prefix cache starts with `kv_len` at its cached length, so prefill computes only
the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mleagle.engine.constrain.runtime import ConstrainRuntime
from mleagle.engine.contract.outputs import TokenLogprob
from mleagle.engine.core.request import Req
from mleagle.engine.executor.capture import default_buckets
from mleagle.engine.executor.extend_graph import ExtendGraphRunner, token_buckets
from mleagle.engine.executor.forward_batch import (
    ForwardBatch,
    ForwardMode,
    ForwardOutput,
    RowMeta,
    build_batch,
    uniform_batch,
)
from mleagle.engine.executor.graph_runner import GraphRunner
from mleagle.engine.executor.iteration_graph import IterationGraph, MaskedGraphs
from mleagle.engine.executor.results import (
    FwdInfo,
    HostView,
    Pending,
    SplitLaunch,
    StepPlan,
    StepResult,
    Timer,
    device_busy,
    device_wait,
    pack,
    unpack,
)
from mleagle.engine.executor.runner import ModelRunner
from mleagle.engine.executor.slot_state import ADMIT_ROWS, PLAIN, SlotState
from mleagle.engine.sampling.processor import RowFlags, penalize
from mleagle.engine.sampling.sampler import logprobs, sample

log = logging.getLogger("mleagle.engine")
MASKED = dataclasses.replace(PLAIN, constrained=True)  # a plain greedy batch with grammars (the masked graph)
# The target prefill graph's tail rows per request (`prefill_input`, `graph_tail`): commit the greedy first
# token, set the KV length, admit, then the admitted row's field values (`SlotState.ADMIT_ROWS`).
TAIL_ROWS = 3 + ADMIT_ROWS
_NO_STREAM = contextlib.nullcontext()  # `prefill_stream` without a prefill stream (entered every step)


@dataclass(frozen=True)
class GraphSettings:
    """What graph capture may do: per-forward graphs (`cuda_graph`, or `emulate` on a CPU: the same
    buffers and padding with eager forwards), whole-iteration graphs (`iteration`), the largest
    bucket, and the tensor-parallel size (a rank cannot fall back to eager alone)."""

    cuda_graph: bool = True
    emulate: bool = False
    iteration: bool = True
    max_bs: int = 1
    tp_size: int = 1
    tp_rank: int = 0
    dtype: torch.dtype = torch.float32
    # Prefill (EXTEND) graphs up to this many tokens per forward (0: prefill runs eagerly), with up to
    # `prefill_max_reqs` requests per bucket.
    prefill_max_tokens: int = 0
    prefill_max_reqs: int = 1


class TargetWorker:
    lookahead = 1
    # A mixed step may run as one forward (`can_fuse`, `launch_mixed`): one token a decoding row, which
    # only target-only decoding has; the engine sets it from `fuse_mixed_steps` (off by default).
    fuse_mixed = True
    # A prefill may run on a stream of its own beside the iteration in flight (`prefill_stream`): the
    # target-only prefill touches only its own requests' rows and pages.
    side_ok = True

    def __init__(self, target: ModelRunner, device: torch.device | str = "cpu", eos_ids: frozenset[int] = frozenset(),
                 vocab: int = 0, max_reqs: int = 0, steps: int = 0):
        self.target = target
        self.device = torch.device(device)
        self.eos_ids = eos_ids
        m: Any = target.model
        self.vocab = vocab or int(m.arch.vocab_size)
        max_reqs = max_reqs or target.binding.req_to_token.max_reqs
        self.state = SlotState(max_reqs, self.vocab, steps, self.device, sorted(eos_ids))
        self.constrain = ConstrainRuntime(self.vocab, self.device, steps)  # structured output (engine/constrain)
        self.inflight = 0  # iterations launched and not yet finished (0 or 1)
        self.forwards: list[FwdInfo] = []  # the last launch's forwards
        # Whole-iteration graphs (plain greedy batches), one set per iteration depth (a speculative
        # worker's policy may run 0..S draft steps); `depth` is the depth of the iteration being built.
        self.iter_graphs: dict[int, IterationGraph] = {}
        # The same for greedy iterations whose constraints are grammars only, per depth: the forward half
        # (its logits into `_mlogits`), then the rest in pieces between which the host fills the masks
        # into static buffers (`_capture_masked`): while the device runs the forward, and under overlap
        # while the step before finishes too.
        self.masked_graphs: dict[int, MaskedGraphs] = {}
        self._mlogits: torch.Tensor | None = None
        self.depth = 0
        self.graph_report = "cuda graphs: not captured"
        self._pinned = self.device.type == "cuda"
        # The last rows' index tensor: a decoding batch keeps its rows from step to step, and the tensor
        # is only ever read (graphs copy it into their own buffers), so most launches reuse it.
        self._rpi_rows: list[int | None] = []
        self._rpi: torch.Tensor | None = None
        # The last prefill's first tokens, on their way back, and the results they belong to (`settle_prefill`;
        # None for a row of the copy that is not a first token).
        self._first: tuple[Pending, list[StepResult | None]] | None = None
        # The prefill batch `prefill_input` staged into the target's prefill graph, and whether that graph
        # commits its first tokens (else `finish_prefill` samples them).
        self._staged: tuple[ForwardBatch, bool] | None = None
        self.graph_first_tokens = 0  # first tokens a prefill graph sampled and committed (the rest: `finish_prefill`)
        self.graph_fused_steps = 0  # fused mixed steps staged whole into a prefill graph (`launch_mixed`)
        # The prefill stream (`prefill_stream`; the engine sets it: target-only, CUDA, overlap, prefill graphs):
        # a prefill runs there beside the iteration in flight instead of behind it.
        self.side: torch.cuda.Stream | None = None
        self.side_prefills = 0  # prefills that ran on it
        self.prefills = 0  # prefill forwards of the target (`prefill_input`)
        self._ar = torch.arange(128, device=self.device)

    @property
    def runners(self) -> list[ModelRunner]:
        return [self.target]

    @property
    def active_runners(self) -> list[ModelRunner]:
        """The runners an iteration of the current `depth` runs (all of them at full depth)."""
        return [self.target]

    @property
    def full_depth(self) -> int:
        """The deepest iteration (draft steps): 0 here, S for the speculative worker."""
        return 0

    def graph_depths(self) -> list[int]:
        """The iteration depths graphs are captured for."""
        return [self.full_depth]

    @property
    def iter_graph(self) -> IterationGraph | None:
        """The full-depth iteration's graphs (the ones every batch replays unless a policy chose less)."""
        return self.iter_graphs.get(self.full_depth)

    @property
    def width(self) -> int:
        """Token rows per request in one decode iteration."""
        return 1

    @property
    def prefix_margin(self) -> int:
        """Cached positions a prefix-cache hit leaves to recompute (see `SpecWorker.prefix_margin`)."""
        return 0

    @property
    def r2t(self) -> torch.Tensor:
        return self.target.binding.req_to_token.req_to_token

    # --- graphs -------------------------------------------------------------------------------------
    def graph_mode(self, r: ModelRunner) -> tuple[ForwardMode, int, bool]:
        """(mode, width, pruned) of runner r's uniform forward in a decode iteration."""
        return ForwardMode.DECODE, 1, False

    def iteration_meta(self, pbs: int) -> list[RowMeta]:
        """The rule's row counts of every forward of one iteration at batch size `pbs`."""
        metas = []
        for r in self.active_runners:
            mode, w, pruned = self.graph_mode(r)
            metas.append(r.rule_meta(mode, pbs, w, pruned=pruned))
        return metas

    def capture_graphs(self, s: GraphSettings) -> str:
        """CUDA graphs for every runner's uniform forward, each captured against that runner's own
        binding, then whole-iteration graphs where every runner has graphs and no backend plans from
        host lengths (a single replay leaves no room to plan each forward). Returns the start-up
        report: what was captured, its memory and its time (or why not)."""
        cuda = self.device.type == "cuda"
        if not s.cuda_graph or not (cuda or s.emulate):
            for r in self.runners:
                r.no_graph_reason = r.no_extend_reason = "disabled" if cuda or not s.cuda_graph else "cpu"
            self.graph_report = "cuda graphs: off" + ("" if cuda else " (cpu)")
            return self.graph_report
        buckets = default_buckets(s.max_bs)
        pool = torch.cuda.graph_pool_handle() if cuda else None
        self._arange(buckets[-1] * (self.full_depth + 1))  # grown before any capture, never inside one
        # The prefill graphs in a memory pool of their own: graphs of one pool may share intermediate
        # buffers, so a prefill could then never run beside an iteration (`prefill_stream`).
        lines = self._capture_prefill(s, torch.cuda.graph_pool_handle() if cuda else None, cuda)
        failed: set[str] = set()
        # The full depth first: its shapes are each runner's `graphs`, the others' `more_graphs`.
        depths = sorted(self.graph_depths(), key=lambda d: d != self.full_depth)
        try:
            for d in depths:
                self.depth = d
                for r in self.active_runners:
                    if r.name in failed:
                        continue
                    if cuda and not r.binding.backend.supports_graphs:
                        r.no_graph_reason = f"backend {r.binding.backend.name}"
                        lines.append(f"{r.name}: eager (backend {r.binding.backend.name} cannot be captured)")
                        failed.add(r.name)
                        continue
                    mode, w, pruned = self.graph_mode(r)
                    have = [g for g in [r.graphs, *r.more_graphs] if g is not None]
                    if any((g.mode, g.width) == (mode, w) for g in have):
                        continue
                    # A draft-extend graph's input hidden is as wide as its layer reads (fused target features).
                    hidden = int(getattr(r.model, "hidden_in_size", 0))
                    g = GraphRunner(r, mode=mode, width=w, buckets=buckets, hidden_size=hidden, dtype=s.dtype,
                                    pruned=pruned, emulate=not cuda, pool=pool, tp_size=r.tp_size, layout=r.layout)
                    why = self._try_capture(r.name, g.capture, s)
                    if why is not None:
                        r.no_graph_reason = why
                        lines.append(f"{r.name}: eager ({why})")
                        failed.add(r.name)
                        continue
                    if r.graphs is None:
                        r.graphs = g
                    else:
                        r.more_graphs.append(g)
                    lines.append(f"{r.name}: {mode.value} W={w} buckets {g.buckets[0]}..{g.buckets[-1]} "
                                 f"({len(g.buckets)}), {g.stats.capture_mb:.0f} MiB, {g.stats.capture_s:.2f} s")
                lines.append(self._capture_iteration(buckets, pool, cuda, s))
        finally:
            self.depth = self.full_depth
        self.graph_report = "cuda graphs" + (" (emulated)" if not cuda else "") + ":\n  " + "\n  ".join(lines)
        log.info(self.graph_report)
        return self.graph_report

    def _capture_prefill(self, s: GraphSettings, pool: object | None, cuda: bool) -> list[str]:
        """Prefill graphs for every runner (the target's prompts, each draft layer's draft prefill and
        catch-up), by token bucket; the start-up report's lines."""
        buckets = token_buckets(s.prefill_max_tokens)
        if not buckets:
            for r in self.runners:
                r.no_extend_reason = "prefill graphs off"
            return ["prefill: eager (prefill_graph_max_tokens = 0)"]
        lines = []
        for r in self.runners:
            if cuda and not getattr(r.binding.backend, "supports_extend_graphs", False):
                r.no_extend_reason = f"backend {r.binding.backend.name}"
                lines.append(f"{r.name} prefill: eager (backend {r.binding.backend.name} cannot be captured)")
                continue
            g = ExtendGraphRunner(r, buckets=buckets, max_reqs=s.prefill_max_reqs,
                                  hidden_size=int(getattr(r.model, "hidden_in_size", 0)), dtype=s.dtype,
                                  emulate=not cuda, pool=pool, tp_size=r.tp_size, layout=r.layout,
                                  # the target's graph also admits, and takes the first tokens
                                  tail=self.graph_tail if r is self.target else None, tail_rows=TAIL_ROWS,
                                  # a fused mixed step's decoding rows read their ids on the device
                                  ids_from=self.state.last_tok if r is self.target and self.fuse_mixed else None)
            why = self._try_capture(f"{r.name} prefill", g.capture, s)
            if why is not None:
                r.no_extend_reason = why
                lines.append(f"{r.name} prefill: eager ({why})")
                continue
            r.extend_graphs = g
            lines.append(f"{r.name}: EXTEND tokens {buckets[0]}..{buckets[-1]} ({len(buckets)}), up to "
                         f"{g.slots(buckets[-1])} requests, {g.stats.capture_mb:.0f} MiB, {g.stats.capture_s:.2f} s")
        return lines

    def _try_capture(self, what: str, capture: Callable[[], None], s: GraphSettings) -> str | None:
        """Run a capture; None when it worked, else why it did not (the forwards then run eagerly).
        Under tensor parallelism a failure ends the engine instead: an eager forward's collectives are
        sized by the live batch, a replay's by its bucket, so a rank that fell back alone would no
        longer meet the others."""
        try:
            capture()
            return None
        except Exception as err:
            if s.tp_size > 1:
                raise RuntimeError(f"rank {s.tp_rank}: graph capture of {what} failed under tensor parallelism: "
                                   f"{type(err).__name__}: {err}") from err
            log.exception("graph capture of %s failed; it runs eagerly", what)
            return f"capture failed: {type(err).__name__}: {err}"

    def _capture_iteration(self, buckets: list[int], pool: object | None, cuda: bool, s: GraphSettings) -> str:
        """Whole-iteration graphs for plain greedy batches. Under tensor parallelism every rank captures
        the same body with its collectives inside and takes the same path for a step (the choice
        depends only on the batch, the same everywhere), so the ranks replay one bucket's graph together."""
        if not s.iteration:
            return "iteration: off (iteration_graph = false)"
        if any(r.graphs is None or r.binding.backend.needs_host_lens for r in self.active_runners):
            return "iteration: per-forward graphs only"
        depth = self.depth

        def body(rpi: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, list[RowMeta]]:
            self.depth = depth  # captured (and, emulated, replayed) at this depth
            return self._body(rpi, live, PLAIN, self.capture_view(int(rpi.shape[0])), True, None)

        def meta(pbs: int) -> list[RowMeta]:
            self.depth = depth
            return self.iteration_meta(pbs)

        g = IterationGraph(self.iteration_name, body, meta, buckets,
                           self.target.binding.req_to_token.pad_row, self.device, emulate=not cuda, pool=pool)
        why = self._try_capture("the whole iteration", g.capture, s)
        if why is not None:
            return f"iteration: per-forward graphs only ({why})"
        self.iter_graphs[depth] = g
        line = (f"iteration ({self.iteration_name}): buckets {g.buckets[0]}..{g.buckets[-1]} ({len(g.buckets)}), "
                f"{g.stats.capture_mb:.0f} MiB, {g.stats.capture_s:.2f} s")
        return line + self._capture_masked(buckets, pool, cuda, s)

    def _capture_masked(self, buckets: list[int], pool: object | None, cuda: bool, s: GraphSettings) -> str:
        """The grammar-masked iteration at the current depth under graphs: its forward half (the logits
        into a static buffer; no mask needed yet), then the pieces of the rest (`_masked_pieces`),
        between which the host fills masks while the device runs."""
        depth, rows = self.depth, buckets[-1] * (self.full_depth + 1)
        if self._mlogits is None:  # one static logits and mask buffer for every depth (the widest rows)
            self._mlogits = torch.zeros(rows, self.vocab, dtype=torch.float32, device=self.device)
            self.constrain.init_graph(rows)

        def fwd(rpi: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, list[RowMeta]]:
            self.depth = depth
            return self._masked_forward(rpi)

        def meta(pbs: int) -> list[RowMeta]:
            self.depth = depth
            return self.iteration_meta(pbs)[:1]

        f = IterationGraph(f"{self.iteration_name}: forward (grammar masks later)", fwd, meta, buckets,
                           self.target.binding.req_to_token.pad_row, self.device, emulate=not cuda, pool=pool)
        rest = self._masked_pieces(f, pool, cuda)
        if rest is None:
            return ""
        m = MaskedGraphs(f, rest)
        for g in m.graphs():
            why = self._try_capture(g.name, g.capture, s)
            if why is not None:
                return f"; grammar-masked iterations eager ({why})"
        self.masked_graphs[depth] = m
        mb = sum(g.stats.capture_mb for g in m.graphs())
        return f"; with grammar masks ({len(m.graphs())} graphs a bucket) {mb:.0f} MiB"

    def _masked_pieces(self, fwd: IterationGraph, pool: object | None, cuda: bool) -> list[IterationGraph] | None:
        """The rest of a masked decode step after its forward `fwd` (whose rows it shares), one graph:
        mask (the static buffer), sample, commit, pack."""
        def rest(rpi: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, list[RowMeta]]:
            assert self._mlogits is not None
            self.depth = 0
            with self.constrain.static_masks():
                return self._decode_sample(self._mlogits[: int(rpi.shape[0])], rpi, live, MASKED, None), []

        return [IterationGraph("grammar mask + sample", rest, lambda pbs: [], fwd.buckets,
                               self.target.binding.req_to_token.pad_row, self.device, emulate=not cuda, pool=pool,
                               rows_of=fwd)]

    def _masked_forward(self, rpi: torch.Tensor) -> tuple[torch.Tensor, list[RowMeta]]:
        """A masked iteration's forward half (captured): the decode forward, its logits into `_mlogits`."""
        assert self._mlogits is not None
        pbs = int(rpi.shape[0])
        batch, out = self._decode_forward(rpi, self.capture_view(pbs), True)
        self._mlogits[:pbs].copy_(out.logits)
        return self._mlogits[:pbs], [self.target.row_meta(batch)]

    # --- a grammar-masked iteration: its forward half, then the rest once the host has the masks -----------
    def launch_split(self, reqs: list[Req], plan: StepPlan | None = None) -> SplitLaunch | None:
        """The forward half of a masked iteration over `reqs`, replayed now (under overlap, while the step
        in flight finishes); `complete` runs the rest once the matchers have that step's tokens. None
        when the batch cannot take this path (then nothing was launched)."""
        plan = plan if plan is not None else self.plan(reqs)
        if plan.depth not in self.masked_graphs or plan.catch_up:
            return None
        flags = self.state.flags([r.req_pool_idx for r in reqs], reqs)  # type: ignore[misc]
        flags = self.constrain.begin(reqs, flags)
        self.depth = plan.depth
        if not flags.constrained or self.iteration_miss(flags, len(reqs)) is not None:
            return None
        timer = Timer(self.device)
        timer.mark()
        rpi = self.rpi_of(reqs)
        _, pbs = self.masked_graphs[plan.depth].forward.run(rpi, len(reqs))
        return SplitLaunch(list(reqs), rpi, flags, timer, plan, list(self.constrain.batch), pbs)

    def complete(self, s: SplitLaunch) -> Pending:
        """The rest of a split iteration: the masks into the static buffers, between its graphs."""
        self.depth = s.plan.depth
        self.constrain.batch = s.cons
        return self._complete_masked(s)

    def _complete_masked(self, s: SplitLaunch) -> Pending:
        """A masked decode step's rest: every row's mask, then mask + sample + commit; the matchers take
        its tokens at `finish`."""
        self.constrain.fill_static(len(s.reqs))
        packed, _ = self.masked_graphs[0].rest[0].run(s.rpi, len(s.reqs))
        self.forwards = self.replay_forwards(s.reqs, s.pbs)
        s.timer.mark()
        p = self._send(s.reqs, self.width, s.flags, packed, s.timer)
        p.plan, p.masked, p.cons = s.plan, True, s.cons
        return p

    @property
    def iteration_name(self) -> str:
        return "decode + sample"

    # --- prefill (host-described; a prefill graph where it fits) --------------------------------------------------------
    def prefill_input(self, reqs: list[Req], chunks: list[int]) -> ForwardBatch:
        """Admit the requests that start (or resume) here and return the target's prefill batch: staged
        straight into a captured prefill graph's buffers where one holds it, whose tail (`graph_tail`)
        then also fills the admitted rows, sets the finished prompts' KV lengths and, where every prompt
        sampling a first token is plain greedy, samples and commits those; else admitted here and built
        from host lists (`prefill_batch`), everything after the forward left to `finish_prefill`."""
        self._staged = None
        self.prefills += 1
        g = self.target.extend_graphs
        n = sum(chunks)
        if (not isinstance(g, ExtendGraphRunner) or g.tail is None or g.stage_bucket(n, len(reqs)) is None
                or any(r.params.prompt_logprobs is not None and r.prompt_logprobs is None for r in reqs)):
            self.admit(reqs)
            return self.prefill_batch(reqs, chunks)
        done = [r.kv_len + c >= r.prefill_len for r, c in zip(reqs, chunks)]
        first = [d and not r.output_ids for r, d in zip(reqs, done)]
        # The graph commits the first tokens where every one is a plain greedy argmax; else the host's
        # path samples them (`finish_prefill`).
        if not all(_plain_first(r) for r, f in zip(reqs, first) if f):
            first = [False] * len(reqs)
        tail = self._admit_tail(reqs, first, done)
        staged = g.stage(_chunk_ids(reqs, chunks), [r.req_pool_idx for r in reqs], [r.kv_len for r in reqs],  # type: ignore[misc]
                         chunks, tail, rids=tuple(r.rid for r in reqs))
        assert staged is not None  # (`stage_bucket` said it fits)
        self._staged = (staged, any(first))
        return staged

    def _admit_tail(self, cols: list[Req], commit: Sequence[int], kv_set: Sequence[int]) -> np.ndarray:
        """A staged prefill graph's tail rows (`TAIL_ROWS` x `cols`): row 0 what its tail commits (0, 1: a
        first token, 2: a decoding row's next), row 1 whose KV length it sets, and the requests that
        start (or resume) here admitted, their host mirrors now and their device rows by the tail (row 2,
        and their values in rows 3..)."""
        new = [i for i, r in enumerate(cols) if r.state_slot != r.req_pool_idx]
        vals = self.state.admit([cols[i] for i in new], device_copy=False)
        for i in new:
            cols[i].state_slot = cols[i].req_pool_idx
        tail = np.zeros((TAIL_ROWS, len(cols)), dtype=np.int64)
        tail[0], tail[1] = commit, kv_set
        if new:
            assert vals is not None
            tail[2, new] = 1
            tail[3:, new] = vals
        return tail

    def prefill_batch(self, reqs: list[Req], chunks: list[int]) -> ForwardBatch:
        """The target's prefill batch built from host lists (an eager forward, or a prefill graph's
        static batch)."""
        ids = _chunk_ids(reqs, chunks)
        want_prompt_lp = any(r.params.prompt_logprobs is not None and r.prompt_logprobs is None for r in reqs)
        b = build_batch(ForwardMode.EXTEND, input_ids=ids, req_pool_indices=[r.req_pool_idx for r in reqs],  # type: ignore[misc]
                        prefix_lens=[r.kv_len for r in reqs], extend_lens=chunks, req_to_token=self.r2t,
                        all_logit_rows=want_prompt_lp, device=self.device, rids=tuple(r.rid for r in reqs))
        return self.target.bind(b)

    def admit(self, reqs: list[Req]) -> None:
        """Fill the slot-state rows of requests that start (or resume) in this prefill."""
        new = [r for r in reqs if r.state_slot != r.req_pool_idx]
        self.state.admit(new)
        for r in new:
            r.state_slot = r.req_pool_idx

    def prefill_stream(self) -> contextlib.AbstractContextManager[None]:
        """Where the scheduler schedules and runs a prefill: on the prefill stream while this lasts (its
        KV pages' map writes, its input copy, its graph and first tokens), after which the main stream
        waits for it (when a prefill was scheduled: a step without one queues nothing there), so the next
        iteration (which decodes the new requests too) comes after the prefill and the iteration in
        flight runs beside it. Two graphs at once need their own memory pools (the
        prefill graphs have one, `capture_graphs`), and a row or page a finished request gave back must
        not be reused while that iteration may still write it (`MemoryManager.hold_frees`). Without a
        prefill stream, nothing changes (and a step pays no more than entering a null context)."""
        return _NO_STREAM if self.side is None else self._on_side()

    @contextlib.contextmanager
    def _on_side(self) -> Iterator[None]:
        assert self.side is not None
        main = torch.cuda.current_stream(self.device)
        n = self.prefills
        with torch.cuda.stream(self.side):
            yield
        if self.prefills != n:  # (no prefill scheduled: nothing went to the stream, a decode step pays nothing)
            main.wait_stream(self.side)
            self.side_prefills += self.prefills - n

    def prefill(self, reqs: list[Req], chunks: list[int], defer_fill: bool = False) -> list[StepResult]:
        # (`defer_fill` is the speculative worker's: its draft layers' pass may wait for the next call.)
        batch = self.prefill_input(reqs, chunks)
        out = self.target.forward(batch)
        self.forwards = [FwdInfo.of(self.target.name, batch, out.graph_bs, out.eager_reason)]
        return self.finish_prefill(reqs, chunks, batch, out)

    def finish_prefill(self, reqs: list[Req], chunks: list[int], batch: ForwardBatch, out: ForwardOutput) -> list[StepResult]:
        """Sample the first token of requests whose prefill completes; prompt logprobs; advance kv_len."""
        logits = out.logits
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + c)
        last_rows = [s - 1 for s in starts[1:]] if batch.all_logit_rows else list(range(len(reqs)))
        results = [StepResult() for _ in reqs]
        for i, (r, c) in enumerate(zip(reqs, chunks)):
            if batch.all_logit_rows and r.params.prompt_logprobs is not None and r.prompt_logprobs is None:
                results[i].prompt_logprobs = self._prompt_logprobs(r, logits[starts[i] : starts[i + 1]], c)
            r.kv_len += c
        done = [i for i, r in enumerate(reqs) if not r.prefilling]
        # A resumed request (preempted after generating) already has its next input token: no sample.
        first = [i for i in done if not reqs[i].output_ids]
        staged, self._staged = self._staged, None
        graph = staged is not None and staged[0] is batch  # the graph set the finished rows' KV lengths
        if graph and out.tokens is None:
            raise AssertionError("a staged prefill batch ran without its prefill graph's tail")
        if not done:
            return results
        if graph and first and staged[1]:  # type: ignore[index]
            # ... and committed the first tokens: they only travel back (every request's greedy token, the
            # rows that are not first tokens skipped when read).
            assert out.tokens is not None
            p = self._copy_back(reqs, 1, PLAIN, out.tokens.view(-1, 1), Timer(self.device))
            keep = set(first)
            self.graph_first_tokens += len(keep)
            self._first = (p, [res if i in keep else None for i, res in enumerate(results)])
            return results
        # The finished rows' KV lengths, and the first tokens' slots and logit rows, in one copy (a first
        # token waits for every operation queued before it: on a GPU each costs the host a launch).
        host: list[list[int]] = [[] if graph else [reqs[i].req_pool_idx for i in done],  # type: ignore[misc]
                                 [] if graph else [reqs[i].kv_len for i in done],
                                 [reqs[i].req_pool_idx for i in first], [last_rows[i] for i in first]]  # type: ignore[misc]
        kv_rows, kv_lens, rpi, rows_t = torch.tensor([x for h in host for x in h], dtype=torch.int64).to(
            self.device, non_blocking=True).split_with_sizes([len(h) for h in host])
        if not graph:
            self.state.set_kv_len(kv_rows, kv_lens)
        if first:
            fr = [reqs[i] for i in first]
            # Each request's last row in order (no prompt logprobs): those rows as they are, no gather.
            in_order = host[3] == list(range(len(fr)))
            x_raw = logits[: len(fr)] if in_order else logits.index_select(0, rows_t)
            flags = self.state.flags(host[2], fr)
            flags = self.constrain.begin(fr, flags)  # constrain: which rows have a grammar
            tok = self._sample(x_raw, rpi, flags)
            if flags.constrained:  # constrain: the matchers take the first tokens
                self.constrain.commit(tok.view(-1, 1), torch.ones_like(tok))
            lp = logprobs(x_raw, tok, max(flags.logprobs, 0)) if flags.logprobs >= 0 else None
            self.state.commit_first(rpi, tok, flags)
            # The first tokens travel back like an iteration's results, and are read by `settle_prefill`
            # when the scheduler applies the step: reading them here would wait for the iteration in flight
            # and this prefill before the next iteration is even launched (the GPU would idle meanwhile).
            # Without logprobs the tokens themselves are the result (`unpack` reads them as they are).
            packed = tok.view(-1, 1) if lp is None else pack(tok.view(-1, 1), torch.ones_like(tok), lp, 1)
            p = self._copy_back(fr, 1, flags, packed, Timer(self.device))
            self._first = (p, [results[i] for i in first])
        return results

    def graph_tail(self, batch: ForwardBatch, out: ForwardOutput, tail: torch.Tensor) -> torch.Tensor:
        """The target prefill graph's tail (`ExtendGraphRunner.tail`) over its request slots, from the rows
        `prefill_input` (or a fused mixed step, `launch_mixed`) staged (`TAIL_ROWS`): the admitted
        requests' slot-state rows filled, then each slot's greedy token [slots], committed where row 0
        says (1: a first token, as `finish_prefill` would: the row's last token and count; 2: a decoding
        row's next token), and the KV lengths of row 1's slots set (prompts that finish here, and a fused
        step's decoding rows)."""
        rpi = batch.req_pool_indices
        self.state.admit_where(rpi, tail[2] != 0, tail[3:])
        tok = out.logits.argmax(-1)
        self.state.commit_where(rpi, tok, batch.seq_lens, tail[0], tail[1] != 0)
        return tok

    # --- the fused mixed step (target-only) ---------------------------------------------------------
    def can_fuse(self, decode: list[Req], reqs: list[Req], chunks: list[int]) -> bool:
        """May the prefill of `reqs` run in one forward with the next token of each `decode` request?
        Target-only (one token a decoding row, so the host knows every row's KV length while an
        iteration is in flight), every prompt completing here and sampling its first token, no grammar
        or prompt logprobs, and the batch on a captured prefill graph where the runner has them (an
        eager forward of it would cost more than the decode rows' whole-iteration graph saves)."""
        if not self.fuse_mixed or not decode:
            return False
        for r, c in zip(reqs, chunks):
            if (r.kv_len + c < r.prefill_len or r.output_ids or r.constraint is not None
                    or r.params.prompt_logprobs is not None):
                return False
        if any(r.constraint is not None for r in decode):
            return False
        g = self.target.extend_graphs
        if not isinstance(g, ExtendGraphRunner):
            return g is None
        t = g.bucket(len(decode) + sum(chunks), len(decode) + len(reqs))
        return t is not None and t in g.caps

    def launch_mixed(self, decode: list[Req], inflight: Pending | None, reqs: list[Req], chunks: list[int]) -> Pending:
        """One forward over the decoding requests' next tokens (one-token extends, first) and the
        arrivals' prompts (`can_fuse` said it may), sampled and committed like an iteration and a
        prefill's first tokens, with one copy back: the mixed step of a target-only engine. `inflight`
        is the iteration still on the device, whose rows' KV lengths there are one past the host's (a
        fused step's prefill rows: none past). The arrivals' host lengths advance now."""
        timer = Timer(self.device)
        ahead: dict[int, int] = {}
        if inflight is not None:
            adds = inflight.kv_add or [1] * len(inflight.reqs)
            ahead = {id(r): a for r, a, e in zip(inflight.reqs, adds, inflight.epoch) if r.epoch == e}
        n = len(decode)
        every = [*decode, *reqs]
        batch = self._stage_mixed(decode, ahead, reqs, chunks)
        if batch is not None:
            # Staged whole into the prefill graph: the decoding rows' ids read there from the iteration in
            # flight's commits, the arrivals admitted, every row's greedy token committed (a decoding row's
            # as its next token, an arrival's as its first) and its KV length set by the graph's tail.
            timer.mark()  # the device's part starts here: the staging before is the host's
            out = self.target.forward(batch)
            if out.tokens is None:
                raise AssertionError("a staged fused step ran without its prefill graph's tail")
            flags, packed = PLAIN, out.tokens.view(-1, 1)
            self.graph_fused_steps += 1
        else:
            self.admit(reqs)
            b = build_batch(ForwardMode.EXTEND, input_ids=_chunk_ids(reqs, chunks, [0] * n),
                            req_pool_indices=[r.req_pool_idx for r in every],  # type: ignore[misc]
                            prefix_lens=[r.kv_len + ahead.get(id(r), 0) for r in decode] + [r.kv_len for r in reqs],
                            extend_lens=[1] * n + list(chunks), req_to_token=self.r2t, device=self.device,
                            rids=tuple(r.rid for r in every))
            rpi = b.req_pool_indices
            # The decoding rows' inputs are the tokens the iteration in flight commits on the device. A new
            # tensor object, so the prefill graph copies the ids from the device rather than the host's zeros.
            ids_d = b.input_ids.view(-1)
            timer.mark()
            torch.index_select(self.state.last_tok, 0, rpi[:n], out=ids_d[:n])
            batch = self.target.bind(dataclasses.replace(b, input_ids=ids_d))
            out = self.target.forward(batch)
            flags = self.state.flags([r.req_pool_idx for r in every], every)  # type: ignore[misc]
            flags = self.constrain.begin(every, flags)
            tok = self._sample(out.logits, rpi, flags)
            lp = logprobs(out.logits, tok, max(flags.logprobs, 0)) if flags.logprobs >= 0 else None
            one = torch.ones_like(tok)
            self.state.commit(rpi[:n], tok[:n].view(-1, 1), one[:n], flags)
            self.state.set_kv_len(rpi[n:], b.seq_lens[n:])
            self.state.commit_first(rpi[n:], tok[n:], flags)
            packed = pack(tok.view(-1, 1), one, lp, 1)
        self.forwards = [FwdInfo.of(self.target.name, batch, out.graph_bs, out.eager_reason)]
        for r, c in zip(reqs, chunks):
            r.kv_len += c
        timer.mark()
        p = self._send(every, 1, flags, packed, timer)
        p.kv_add = [1] * n + [0] * len(reqs)
        p.iteration_miss = "fused with a prefill"
        return p

    def _stage_mixed(self, decode: list[Req], ahead: dict[int, int], reqs: list[Req],
                     chunks: list[int]) -> ForwardBatch | None:
        """A fused mixed step staged into the target's prefill graph (one host array, one copy; its tail
        does the rest), where one holds it and every row is a plain greedy argmax without logprobs (the
        decoding rows by their flags, the arrivals by their parameters); else None (`launch_mixed`
        samples and commits on the host). The decoding rows' ids are staged as -1: the graph reads them
        from the slot state (`ExtendGraphRunner.ids_from`)."""
        g = self.target.extend_graphs
        n = len(decode)
        if (not isinstance(g, ExtendGraphRunner) or g.tail is None or g.ids_from is None
                or g.stage_bucket(n + sum(chunks), n + len(reqs)) is None):
            return None
        flags = self.state.flags([r.req_pool_idx for r in decode], decode)  # type: ignore[misc]
        if not flags.plain or flags.logprobs >= 0 or not all(_plain_first(r) for r in reqs):
            return None
        every = [*decode, *reqs]
        # A decoding row's next token and an arrival's first committed; every row's KV length set (a
        # decoding row's one past its prefix, an arrival's whole prompt).
        tail = self._admit_tail(every, [2] * n + [1] * len(reqs), [1] * len(every))
        staged = g.stage(_chunk_ids(reqs, chunks, [-1] * n), [r.req_pool_idx for r in every],  # type: ignore[misc]
                         [r.kv_len + ahead.get(id(r), 0) for r in decode] + [r.kv_len for r in reqs],
                         [1] * n + list(chunks), tail, rids=tuple(r.rid for r in every))
        assert staged is not None  # (`stage_bucket` said it fits; the arrivals are admitted on the host now)
        return staged

    def settle_prefill(self) -> None:
        """Fill in the first tokens of the last prefill's results (waiting for their copy, if still on its
        way). The scheduler calls it before it applies a step's results, after launching the next
        iteration: the device has that queued behind the prefill, so the wait does not leave it idle."""
        first, self._first = self._first, None
        if first is None:
            return
        p, results = first
        if p.done is not None:
            device_wait.wait(p.done)
        for res, (toks, lps) in zip(results, unpack(p)):
            if res is not None:  # (None: a row of the batch whose token is not a first token)
                res.tokens = toks
                res.logprobs = lps
        _attach_cuts([r for r in results if r is not None], p.cuts)

    def _sample(self, x_raw: torch.Tensor, rpi: torch.Tensor, flags: RowFlags) -> torch.Tensor:
        if flags.constrained:  # constrain: grammar masks and logit bias
            x_raw = self.constrain.mask(x_raw)
            flags = dataclasses.replace(flags, constrained=False)  # masked: the rest is as for any row
        if flags.plain:
            return x_raw.argmax(-1)
        rows = self.state.rows(rpi, 1, flags)
        # One token per request: the key's iteration field is 0, as target-only decoding's always is, so a
        # speculative worker's plain decode step (depth 0) draws what target-only would (a seeded request
        # keeps its tape). Each output position is drawn once, so no key is used twice.
        rows = dataclasses.replace(rows, it=torch.zeros_like(rows.it))
        x = penalize(x_raw, rows, *self.state.context(rpi, flags))
        return sample(x, rows)[0]

    def _prompt_logprobs(self, r: Req, logits: torch.Tensor, c: int) -> list[TokenLogprob | None]:
        """Row p predicts token p+1; the chunk covers positions kv_len..kv_len+c-1 of the prompt."""
        start = r.kv_len
        res: list[TokenLogprob | None] = [None] if start == 0 else []
        targets = list(r.prompt_ids[start + 1 : start + c + 1])
        k = len(targets)  # the chunk's last row predicts beyond the prompt when the prompt ends here
        if k:
            n = int(r.params.prompt_logprobs or 0)
            chosen, tv, ti = logprobs(logits[:k], torch.tensor(targets, device=logits.device), n)
            cl, tvl, til = chosen.tolist(), tv.tolist(), ti.tolist()
            res += [TokenLogprob(token_id=t, logprob=cl[j], top=list(zip(til[j], tvl[j]))) for j, t in enumerate(targets)]
        return res

    # --- decode (device-resident) ----------------------------------------------------------------
    def rpi_of(self, reqs: Sequence[Req]) -> torch.Tensor:
        rows = [r.req_pool_idx for r in reqs]
        if rows == self._rpi_rows and self._rpi is not None:
            return self._rpi
        t = torch.tensor(rows, dtype=torch.int64)
        t = t.pin_memory().to(self.device, non_blocking=True) if self._pinned else t
        self._rpi_rows, self._rpi = rows, t
        return t

    def view(self, mode: ForwardMode, rpi: torch.Tensor, input_ids: torch.Tensor, width: int,
             logit_rows: torch.Tensor, host: HostView, pruned: bool = False,
             kv_lens: torch.Tensor | None = None) -> ForwardBatch:
        """The iteration's shared view: positions, slots and lengths from the slot state (or `kv_lens`,
        the lengths it had before this iteration's commit), on the device."""
        kv = self.state.kv_len[rpi] if kv_lens is None else kv_lens
        return uniform_batch(mode, input_ids=input_ids, req_pool_indices=rpi, kv_lens=kv,
                             req_to_token=self.r2t, width=width, host_kv_lens=host.kv_lens,
                             max_seq_len=host.max_seq_len, logit_rows=logit_rows, pruned=pruned, rids=host.rids)

    def host_view(self, reqs: list[Req]) -> HostView:
        lag = self.inflight * self.lookahead  # an iteration in flight may still advance kv_len
        kv = [r.kv_len for r in reqs]
        return HostView(kv, max(kv, default=0) + lag + self.lookahead, tuple(r.rid for r in reqs))

    def capture_view(self, pbs: int) -> HostView:
        """The host description a whole-iteration capture records (its kernels read lengths on the device)."""
        return HostView([0] * pbs, self.r2t.shape[1], ())

    def iteration_miss(self, flags: RowFlags, bs: int) -> str | None:
        """Why a batch cannot replay the whole-iteration graph (None: it can)."""
        g = self.iter_graphs.get(self.depth)
        if g is None:
            return "no iteration graph"
        if flags.constrained:  # grammars: the masked graphs, if the rest of the batch is plain greedy
            if self.depth not in self.masked_graphs:
                return "constrained"
            if not self.constrain.graphable():
                return "logit bias"
            flags = dataclasses.replace(flags, constrained=False)
        if not flags.plain:
            return "sampling"
        if flags.logprobs >= 0:
            return "logprobs"
        if g.bucket(bs) is None:
            return "bs>max_bucket"
        return None

    def replay_forwards(self, reqs: list[Req], pbs: int) -> list[FwdInfo]:
        """The forwards a whole-iteration replay ran (no runner observed them), by the rule."""
        bs, rids = len(reqs), tuple(r.rid for r in reqs)
        out = []
        for r in self.active_runners:
            mode, w, pruned = self.graph_mode(r)
            out.append(FwdInfo(r.name, mode.value, bs, rids, [w] * bs, bs * w, pbs, None,
                               r.rule_meta(mode, bs, w, pruned=pruned)))
        return out

    def plan(self, reqs: list[Req]) -> StepPlan:
        """What the next iteration over `reqs` runs (a target-only worker has one choice)."""
        return StepPlan()

    def hold(self, plan: StepPlan) -> None:
        """Keep a plan that could not launch yet for the next launch (nothing to keep here)."""

    def launch(self, reqs: list[Req], plan: StepPlan | None = None) -> Pending:
        """Start one decode iteration on the device: a whole-iteration replay, or the body with each
        forward on its runner's graph or eager. Returns with the result copy on its way."""
        plan = plan if plan is not None else self.plan(reqs)
        bs = len(reqs)
        timer = Timer(self.device)
        rpi = self.rpi_of(reqs)
        flags = self.state.flags([r.req_pool_idx for r in reqs], reqs)  # type: ignore[misc]
        flags = self.constrain.begin(reqs, flags)  # constrain: constrained batches are never `plain`
        why = self.iteration_miss(flags, bs)
        timer.mark()  # after the host's part (`device_busy` counts from here)
        masked = why is None and flags.constrained
        if masked:  # its forward half, then the rest (the host fills the masks while the forward runs)
            _, pbs = self.masked_graphs[self.depth].forward.run(rpi, bs)
            p = self.complete(SplitLaunch(list(reqs), rpi, flags, timer, plan, list(self.constrain.batch), pbs))
            p.iteration_miss = None
            return p
        if why is None:
            packed, pbs = self.iter_graphs[self.depth].run(rpi, bs)
            self.forwards = self.replay_forwards(reqs, pbs)
            timer.mark()  # one span: the whole iteration (nothing is timed inside a graph)
        else:
            packed, _ = self._body(rpi, None, flags, self.host_view(reqs), False, timer)
        p = self._send(reqs, self.width, flags, packed, timer)
        p.iteration_miss, p.plan = why, plan
        return p

    def _forward(self, r: ModelRunner, batch: ForwardBatch, eager: bool) -> ForwardOutput:
        """One forward of an iteration: eager inside a whole-iteration capture, else replay-or-eager;
        recorded in `self.forwards` for the step report."""
        out = r.forward_eager(batch, observe=False) if eager else r.forward(batch)
        self.forwards.append(FwdInfo.of(r.name, batch, out.graph_bs, out.eager_reason))
        return out

    def _body(self, rpi: torch.Tensor, live: torch.Tensor | None, flags: RowFlags, host: HostView, eager: bool,
              timer: Timer | None) -> tuple[torch.Tensor, list[RowMeta]]:
        """One decode step on the device: view from the slot state, forward, sample, commit, pack. `eager`
        runs the forward eagerly (inside a whole-iteration capture); `live` masks padded rows' writes."""
        batch, out = self._decode_forward(rpi, host, eager)
        packed = self._decode_sample(out.logits, rpi, live, flags, timer)
        return packed, [self.target.row_meta(batch)]

    def _decode_forward(self, rpi: torch.Tensor, host: HostView, eager: bool) -> tuple[ForwardBatch, ForwardOutput]:
        """A decode step's forward over the rows `rpi`, from the slot state."""
        st = self.state
        bs = int(rpi.shape[0])
        batch = self.target.bind(uniform_batch(
            ForwardMode.DECODE, input_ids=st.last_tok[rpi], req_pool_indices=rpi, kv_lens=st.kv_len[rpi],
            req_to_token=self.r2t, width=1, host_kv_lens=host.kv_lens, max_seq_len=host.max_seq_len,
            logit_rows=self._arange(bs), rids=host.rids))
        self.forwards = []
        out = self._forward(self.target, batch, eager)
        self._keep_hidden(batch, out)
        return batch, out

    def _decode_sample(self, logits: torch.Tensor, rpi: torch.Tensor, live: torch.Tensor | None, flags: RowFlags,
                       timer: Timer | None) -> torch.Tensor:
        """A decode step's sample, state commit and packed result, from its logits."""
        tok = self._sample(logits, rpi, flags)
        lp = logprobs(logits, tok, max(flags.logprobs, 0)) if flags.logprobs >= 0 else None
        one = torch.ones_like(tok)
        if flags.constrained:  # constrain: the matchers take the step's tokens (reads them to the host)
            self.constrain.commit(tok.view(-1, 1), one)
        self.state.commit(rpi, tok.view(-1, 1), one, flags, live=live)
        if timer is not None:
            timer.mark()
        return pack(tok.view(-1, 1), one, lp, 1)

    def _keep_hidden(self, batch: ForwardBatch, out: ForwardOutput) -> None:
        """A decode step's target hidden states, for a speculative worker whose draft layers will catch
        up on these positions (nothing to keep here)."""

    def _arange(self, n: int) -> torch.Tensor:
        """0..n-1 on the device, grown (outside any capture) and then sliced, never allocated per step."""
        if self._ar.shape[0] < n:
            self._ar = torch.arange(max(n, 64) * 2, device=self.device)
        return self._ar[:n]

    def _send(self, reqs: list[Req], width: int, flags: RowFlags, packed: torch.Tensor, timer: Timer) -> Pending:
        """Start the one copy back of the iteration (pinned, non-blocking on CUDA)."""
        self.inflight += 1
        return self._copy_back(reqs, width, flags, packed, timer)

    def _copy_back(self, reqs: list[Req], width: int, flags: RowFlags, packed: torch.Tensor, timer: Timer) -> Pending:
        """A packed result on its way to the host: a non-blocking copy into pinned memory and an event
        on CUDA (a pageable or blocking copy would wait for everything queued), the tensor itself on the CPU."""
        done = None
        if self._pinned:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host = packed.clone()
        p = Pending(list(reqs), width, flags, host, done, timer, [r.epoch for r in reqs], self.forwards)
        p.cuts = self.constrain.take_cuts()  # an eager commit's, made while building this step
        return p

    def finish(self, p: Pending) -> list[StepResult]:
        """Wait for an iteration's results; a request preempted or finished since its launch gets none."""
        if p.deferred is not None:
            p.deferred()
        if p.done is not None:
            device_wait.wait(p.done)
            device_busy.add(p.timer)
        self.inflight -= 1
        res = []
        for r, e, (toks, lps) in zip(p.reqs, p.epoch, unpack(p)):
            if r.finished or r.epoch != e:
                res.append(StepResult())
                continue
            r.kv_len += len(toks)
            res.append(StepResult(toks, lps))
        if p.kv_add is not None:  # a fused mixed step's: its prefill rows' first tokens have no KV yet
            for r, a, x in zip(p.reqs, p.kv_add, res):
                if x.tokens:
                    r.kv_len += a - len(x.tokens)
        cuts = p.cuts
        if p.cons is not None:  # the matchers take the masked graph's tokens now
            cuts = self.constrain.commit_rows([x.tokens for x in res], p.cons)
        _attach_cuts(res, cuts)
        self.on_finish(p, res)
        return res

    def on_finish(self, p: Pending, res: list[StepResult]) -> None:
        """Hook for the speculative worker's accounting."""

    def reset_counters(self, keep_policy_costs: bool = False) -> None:
        """Forget what was counted so far (forwards, eager reasons, graph replays): the engine's warm-up.
        (`keep_policy_costs` is the speculative worker's: its policy keeps the timings.)"""
        self.graph_first_tokens = self.side_prefills = self.prefills = self.graph_fused_steps = 0
        for r in self.runners:
            r.eager.clear()
            r.num_forwards = 0
            if r.graphs is not None:
                r.graphs.stats.replays.clear()
        for g in [*self.iter_graphs.values(), *(g for m in self.masked_graphs.values() for g in m.graphs())]:
            g.stats.replays.clear()
        for r in self.runners:
            for m in [*r.more_graphs, *([r.extend_graphs] if r.extend_graphs is not None else [])]:
                m.stats.replays.clear()

    def decode(self, reqs: list[Req]) -> list[StepResult]:
        return self.finish(self.launch(reqs))

    def kv_valid_len(self, req: Req) -> int:
        """Leading positions of `req` whose KV is computed in every runner's pool: what the prefix
        cache may keep when the request ends or is preempted. The target's pool is all there is here."""
        return req.kv_len

    def release(self, req: Req) -> None:
        """Drop per-request worker state (the speculative worker keeps prefill hidden states here)."""
        req.draft_state = None
        req.state_slot = None
        req.epoch += 1


def _attach_cuts(res: list[StepResult], cuts: list[Any] | None) -> None:
    """Each result's grammar cut (from the commit of its own tokens), for the scheduler's `settle`."""
    if cuts is not None:
        for x, c in zip(res, cuts):
            if x.tokens:
                x.grammar_cut = c


def _chunk_ids(reqs: Sequence[Req], chunks: Sequence[int], head: list[int] | None = None) -> list[int]:
    """The token ids of each request's next chunk, in order (after `head`'s)."""
    ids = head if head is not None else []
    for r, c in zip(reqs, chunks):
        ids += r.fill_ids[r.kv_len : r.kv_len + c]
    return ids


def _plain_first(r: Req) -> bool:
    """Would `SlotState.flags` call this request's first token a plain greedy argmax? From its parameters:
    no grammar, no bans before a first token unless min_new_tokens, no logprobs, no penalties."""
    p = r.params
    return (r.constraint is None and p.temperature == 0.0 and not p.has_penalties and p.min_new_tokens <= 0
            and p.logprobs is None)

