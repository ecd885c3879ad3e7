"""The target-only worker: prefill chunks and decode steps over the target runner, device-resident.

A worker turns scheduled requests into forward batches, runs them on its runners and samples. The
scheduler owns memory and request life; the worker owns forwards and the per-slot device state
(`SlotState`). Prefill is eager and host-described (ragged chunks); a decode step is `launch` (gather
the batch's rows from the slot state, forward — a graph replay where one is captured — sample,
scatter the new state back, and start one non-blocking copy of the results into pinned memory) then
`finish` (wait for that copy, turn it into per-request results). Nothing in between reads the device,
so the engine can launch step N+1 before it finishes step N (overlap scheduling). The speculative
worker (`mleagle.engine.spec.worker`) implements the same interface with draft runners beside the
target. `lookahead` says how many KV positions one decode step writes per request beyond `kv_len`.
A request that hit the prefix cache starts with `kv_len` at its cached length, so prefill computes only
the rest.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mleagle.engine.constrain.runtime import ConstrainRuntime
from mleagle.engine.contract.outputs import TokenLogprob
from mleagle.engine.core.request import Req
from mleagle.engine.executor.forward_batch import (
    ForwardBatch,
    ForwardMode,
    RowMeta,
    build_batch,
    uniform_batch,
)
from mleagle.engine.executor.iteration_graph import IterationGraph
from mleagle.engine.executor.runner import ForwardOutput, ModelRunner
from mleagle.engine.executor.slot_state import SlotState
from mleagle.engine.sampling.processor import RowFlags, penalize
from mleagle.engine.sampling.sampler import logprobs, sample


@dataclass
class StepResult:
    """New tokens (and their logprobs, when asked) for one request from one step."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class Timer:
    """Marks on the device's timeline (CUDA events) or the host clock (CPU); read after the sync."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        """Seconds between consecutive marks. On CUDA this waits for the last mark (a no-op once a later
        sync covered it): an event the device has not reached yet has no time to read."""
        m = self.marks
        if self.cuda:
            if m:
                m[-1].synchronize()
            return [m[i].elapsed_time(m[i + 1]) / 1e3 for i in range(len(m) - 1)]
        return [m[i + 1] - m[i] for i in range(len(m) - 1)]


@dataclass(frozen=True)
class FwdInfo:
    """What one forward of an iteration was, for events: host values only (no tensors kept)."""

    runner: str
    mode: str
    bs: int
    rids: tuple[str, ...]
    tokens_per_req: list[int]
    num_tokens: int
    graph_bs: int  # the bucket it replayed at; 0 = eager
    eager_reason: str | None
    # A forward inside a whole-iteration replay (no runner observer saw it): its row counts by the rule,
    # per rank, for the live batch (the replay checked its bucket's against the capture's).
    meta: RowMeta | None = None

    @staticmethod
    def of(runner: str, b: ForwardBatch, graph_bs: int, why: str | None, bs: int | None = None) -> FwdInfo:
        n = b.bs if bs is None else bs
        return FwdInfo(runner, b.mode.value, n, b.rids, [b.width] * n if b.mode.uniform else list(b.extend_lens),
                       n * b.width if b.mode.uniform else b.num_tokens, graph_bs, why)


@dataclass
class Pending:
    """An iteration launched on the device whose results are still on their way back."""

    reqs: list[Req]
    width: int  # token slots per request in the packed result
    flags: RowFlags
    packed: torch.Tensor  # host (pinned on CUDA) float64 [bs, K]: tokens, emitted count, logprobs
    done: torch.cuda.Event | None
    timer: Timer
    epoch: list[int]  # each request's epoch at launch: a request preempted since gets no results
    forwards: list[FwdInfo] = field(default_factory=list)  # every forward of the iteration (the target's first)


@dataclass(frozen=True)
class HostView:
    """The host's description of a decode batch: KV lengths as the host knows them (one iteration behind
    the device's while a step is in flight), a bound covering the device's, and the request ids."""

    kv_lens: list[int]
    max_seq_len: int
    rids: tuple[str, ...]


def pack(tokens: torch.Tensor, n_emit: torch.Tensor, lp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
         width: int) -> torch.Tensor:
    """One float64 [bs, K] tensor (ids < 2^53 and float32 logprobs are exact in float64), so one copy
    carries the whole iteration back: K = W tokens + 1 count (+ W·(1 + 2N) logprob fields)."""
    bs = tokens.shape[0]
    parts = [tokens.view(bs, width).double(), n_emit.view(bs, 1).double()]
    if lp is not None:
        chosen, tv, ti = lp
        n = tv.shape[1]
        parts += [chosen.view(bs, width).double(), tv.view(bs, width * n).double(), ti.view(bs, width * n).double()]
    return torch.cat(parts, dim=1)


def unpack(p: Pending) -> list[tuple[list[int], list[TokenLogprob] | None]]:
    """Per request: the emitted tokens, and their logprobs where the request asked for them."""
    w = p.width
    rows = p.packed.tolist()
    top_n = max(p.flags.logprobs, 0)
    res = []
    for r, row in zip(p.reqs, rows):
        n = int(row[w])
        toks = [int(t) for t in row[:n]]
        lps = None
        if p.flags.logprobs >= 0 and r.params.logprobs is not None:
            base = w + 1
            chosen = row[base : base + w]
            tv = row[base + w : base + w + w * top_n]
            ti = row[base + w + w * top_n : base + w + 2 * w * top_n]
            k = r.params.logprobs
            lps = [TokenLogprob(token_id=toks[j], logprob=chosen[j],
                                top=[(int(ti[j * top_n + i]), tv[j * top_n + i]) for i in range(k)])
                   for j in range(n)]
        res.append((toks, lps))
    return res


class TargetWorker:
    lookahead = 1
    prefix_margin = 0  # cached positions a hit leaves to recompute (see SpecWorker.prefix_margin)

    def __init__(self, target: ModelRunner, device: torch.device | str = "cpu", eos_ids: frozenset[int] = frozenset(),
                 vocab: int = 0, max_reqs: int = 0, steps: int = 0):
        self.target = target
        self.device = torch.device(device)
        self.eos_ids = eos_ids
        self.vocab = vocab or target.model.arch.vocab_size  # type: ignore[union-attr]
        max_reqs = max_reqs or target.binding.req_to_token.max_reqs
        self.state = SlotState(max_reqs, self.vocab, steps, self.device, sorted(eos_ids))
        self.constrain = ConstrainRuntime(self.vocab, self.device, steps)  # structured output (engine/constrain)
        self.last_batch: ForwardBatch | None = None
        self.inflight = 0  # iterations launched and not yet finished (0 or 1)
        self.forwards: list[FwdInfo] = []  # the last launch's forwards
        self.iter_graph: IterationGraph | None = None  # whole-iteration graphs (plain greedy batches)
        self._pinned = self.device.type == "cuda"

    @property
    def runners(self) -> list[ModelRunner]:
        return [self.target]

    @property
    def r2t(self) -> torch.Tensor:
        return self.target.binding.req_to_token.req_to_token

    # --- prefill (eager, host-described) --------------------------------------------------------
    def prefill_batch(self, reqs: list[Req], chunks: list[int]) -> ForwardBatch:
        ids: list[int] = []
        for r, c in zip(reqs, chunks):
            ids += r.fill_ids[r.kv_len : r.kv_len + c]
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

    def prefill(self, reqs: list[Req], chunks: list[int]) -> list[StepResult]:
        self.admit(reqs)
        batch = self.prefill_batch(reqs, chunks)
        out = self.target.forward(batch)
        self.last_batch = batch
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
        self.state.set_kv_len([reqs[i] for i in done])
        # A resumed request (preempted after generating) already has its next input token: no sample.
        first = [i for i in done if not reqs[i].output_ids]
        if first:
            fr = [reqs[i] for i in first]
            rpi = torch.tensor([r.req_pool_idx for r in fr], dtype=torch.int64).to(self.device)
            rows_t = torch.tensor([last_rows[i] for i in first], dtype=torch.int64).to(self.device)
            x_raw = logits.index_select(0, rows_t)
            flags = self.state.flags([r.req_pool_idx for r in fr], fr)  # type: ignore[misc]
            flags = self.constrain.begin(fr, flags)  # constrain: which rows have a grammar
            tok = self._sample(x_raw, rpi, flags)
            if flags.constrained:  # constrain: the matchers take the first tokens
                self.constrain.commit(tok.view(-1, 1), torch.ones_like(tok))
            lp = logprobs(x_raw, tok, max(flags.logprobs, 0)) if flags.logprobs >= 0 else None
            self.state.commit(rpi, tok.view(-1, 1), torch.ones_like(tok), flags, kv=False)
            host = pack(tok.view(-1, 1), torch.ones_like(tok), lp, 1).cpu()
            p = Pending(fr, 1, flags, host, None, Timer(self.device), [r.epoch for r in fr])
            for i, (toks, lps) in zip(first, unpack(p)):
                results[i].tokens = toks
                results[i].logprobs = lps
        return results

    def _sample(self, x_raw: torch.Tensor, rpi: torch.Tensor, flags: RowFlags) -> torch.Tensor:
        if flags.constrained:  # constrain: grammar masks and logit bias
            x_raw = self.constrain.mask(x_raw)
        if flags.plain:
            return x_raw.argmax(-1)
        rows = self.state.rows(rpi, 1, flags)
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
        t = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        return t.pin_memory().to(self.device, non_blocking=True) if self._pinned else t

    def view(self, mode: ForwardMode, rpi: torch.Tensor, input_ids: torch.Tensor, width: int,
             logit_rows: torch.Tensor, host: HostView, pruned: bool = False) -> ForwardBatch:
        """The iteration's shared view: positions, slots and lengths from the slot state, on the device."""
        return uniform_batch(mode, input_ids=input_ids, req_pool_indices=rpi, kv_lens=self.state.kv_len[rpi],
                             req_to_token=self.r2t, width=width, host_kv_lens=host.kv_lens,
                             max_seq_len=host.max_seq_len, logit_rows=logit_rows, pruned=pruned, rids=host.rids)

    def decode_batch(self, reqs: list[Req]) -> ForwardBatch:
        """A DECODE view built from host lists (reference probes and tests; the engine uses `launch`)."""
        b = build_batch(ForwardMode.DECODE, input_ids=[r.output_ids[-1] for r in reqs],
                        req_pool_indices=[r.req_pool_idx for r in reqs],  # type: ignore[misc]
                        prefix_lens=[r.kv_len for r in reqs], extend_lens=[1] * len(reqs),
                        req_to_token=self.r2t, device=self.device, rids=tuple(r.rid for r in reqs))
        return self.target.bind(b)

    def host_view(self, reqs: list[Req]) -> HostView:
        lag = self.inflight * self.lookahead  # an iteration in flight may still advance kv_len
        kv = [r.kv_len for r in reqs]
        return HostView(kv, max(kv, default=0) + lag + self.lookahead, tuple(r.rid for r in reqs))

    def capture_view(self, pbs: int) -> HostView:
        """The host description a whole-iteration capture records (its kernels read lengths on the device)."""
        return HostView([0] * pbs, self.r2t.shape[1], ())

    def launch(self, reqs: list[Req]) -> Pending:
        bs = len(reqs)
        timer = Timer(self.device)
        timer.mark()
        rpi = self.rpi_of(reqs)
        flags = self.state.flags([r.req_pool_idx for r in reqs], reqs)  # type: ignore[misc]
        flags = self.constrain.begin(reqs, flags)  # constrain: constrained batches are never `plain`
        g = self.iter_graph
        if g is not None and flags.plain and flags.logprobs < 0 and g.bucket(bs) is not None:
            packed, pbs = g.run(rpi, bs)
            self.forwards = [FwdInfo(self.target.name, "DECODE", bs, tuple(r.rid for r in reqs), [1] * bs, bs, pbs, None,
                                     self.target.rule_meta(ForwardMode.DECODE, bs, 1))]
        else:
            packed, _ = self._decode_body(rpi, None, flags, self.host_view(reqs), eager=False)
        timer.mark()
        return self._send(reqs, 1, flags, packed, timer)

    def _decode_body(self, rpi: torch.Tensor, live: torch.Tensor | None, flags: RowFlags, host: HostView,
                     eager: bool) -> tuple[torch.Tensor, list[RowMeta]]:
        """One decode step on the device: view from the slot state, forward, sample, commit, pack. `eager`
        runs the forward eagerly (inside a whole-iteration capture); `live` masks padded rows' writes."""
        st = self.state
        bs = int(rpi.shape[0])
        batch = self.target.bind(uniform_batch(
            ForwardMode.DECODE, input_ids=st.last_tok[rpi], req_pool_indices=rpi, kv_lens=st.kv_len[rpi],
            req_to_token=self.r2t, width=1, host_kv_lens=host.kv_lens, max_seq_len=host.max_seq_len,
            logit_rows=self._arange(bs), rids=host.rids))
        out = self.target.forward_eager(batch, observe=False) if eager else self.target.forward(batch)
        self.last_batch = batch
        self.forwards = [FwdInfo.of(self.target.name, batch, out.graph_bs, out.eager_reason)]
        tok = self._sample(out.logits, rpi, flags)
        lp = logprobs(out.logits, tok, max(flags.logprobs, 0)) if flags.logprobs >= 0 else None
        one = torch.ones_like(tok)
        if flags.constrained:  # constrain: the matchers take the step's tokens (reads them to the host)
            self.constrain.commit(tok.view(-1, 1), one)
        st.commit(rpi, tok.view(-1, 1), one, flags, live=live)
        return pack(tok.view(-1, 1), one, lp, 1), [self.target.row_meta(batch)]

    def _arange(self, n: int) -> torch.Tensor:
        a = getattr(self, "_ar_cache", None)
        if a is None or a.shape[0] < n:
            a = self._ar_cache = torch.arange(max(n, 64) * 2, device=self.device)
        return a[:n]

    def _send(self, reqs: list[Req], width: int, flags: RowFlags, packed: torch.Tensor, timer: Timer) -> Pending:
        """Start the one copy back of the iteration (pinned, non-blocking on CUDA)."""
        done = None
        if self._pinned:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host = packed
        self.inflight += 1
        return Pending(list(reqs), width, flags, host, done, timer, [r.epoch for r in reqs], self.forwards)

    def finish(self, p: Pending) -> list[StepResult]:
        """Wait for an iteration's results; a request preempted or finished since its launch gets none."""
        if p.done is not None:
            p.done.synchronize()
        self.inflight -= 1
        res = []
        for r, e, (toks, lps) in zip(p.reqs, p.epoch, unpack(p)):
            if r.finished or r.epoch != e:
                res.append(StepResult())
                continue
            r.kv_len += len(toks)
            res.append(StepResult(toks, lps))
        self.on_finish(p, res)
        return res

    def on_finish(self, p: Pending, res: list[StepResult]) -> None:
        """Hook for the speculative worker's accounting."""

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
