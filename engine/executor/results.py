"""What a decode iteration hands back to the host: the packed result row, its unpacking, the record
of every forward it ran, and the timer marks around them.

An iteration's device results (tokens, emitted count, logprobs) travel in one float64 row per
request (`pack`), so one non-blocking copy carries the whole iteration back; `Pending` holds that copy
until the host waits for it, and `unpack` turns it into per-request tokens and logprobs. `FwdInfo`
describes each forward with host values only (for the step report and the state events). These are
the workers' data types, kept apart so the slot state and the spec bookkeeping can pack results
without importing a worker. `device_wait` counts the host's time blocked on those copies: where a
served engine's loop spends its step time waiting for the device, the device is its limit; where it
does not, the host is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mleagle.engine.contract.outputs import TokenLogprob
from mleagle.engine.core.request import Req
from mleagle.engine.executor.forward_batch import ForwardBatch, RowMeta
from mleagle.engine.sampling.processor import RowFlags


@dataclass
class StepResult:
    """New tokens (and their logprobs, when asked) for one request from one step."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    grammar_cut: tuple[int, str] | None = None  # a grammar took only the first n tokens, and why it ends


class DeviceWait:
    """Host seconds spent waiting for the device at the engine's sync points (a result copy's event),
    since start: the engine reports it (`Engine.stats`) and `bench serve` sets it against the loop."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wait(self, ev: Any) -> None:
        t0 = time.perf_counter()
        ev.synchronize()
        self.seconds += time.perf_counter() - t0


device_wait = DeviceWait()  # one engine per process: the process's count


class DeviceBusy:
    """Device seconds of the engine's decode iterations (fused mixed steps included; prefill-only
    steps not), each from its timer's first mark to its last, read once the iteration's results are
    back: CUDA only (on the CPU the marks are the host's clock and nothing is counted). Over a run's
    wall time it says how much of it the device spent on iterations: where the device is the limit it
    is near 1, where the host makes it wait between steps it is not. Each worker puts its first mark
    where the iteration's device work starts (after the host staged it), so that host work before a
    launch on an idle device is not counted as the device's."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.iterations = 0

    def add(self, timer: Timer) -> None:
        m = timer.marks
        if timer.cuda and len(m) >= 2 and m[-1].query():  # a mark after the result's copy may still be on its way
            self.seconds += m[0].elapsed_time(m[-1]) / 1e3
            self.iterations += 1


device_busy = DeviceBusy()


class Timer:
    """Marks on the device's timeline (CUDA events) or the host clock (CPU); read after the sync."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def ready(self) -> bool:
        """Has the device passed the last mark (always, on the CPU)? Then `spans` does not wait."""
        return not self.cuda or not self.marks or bool(self.marks[-1].query())

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
class StepPlan:
    """What the next decode iteration runs, decided before its launch: the draft depth S' (0 for a
    plain decode step, the only depth of a target-only worker), why (the speculation policy's
    reason), its predicted gain over depth 0 (0.0: none), and the requests whose draft layers must
    catch up first (a host-described forward: the launch needs no iteration in flight)."""

    depth: int = 0
    reason: str = ""
    predicted_gain: float = 0.0
    catch_up: list[Req] = field(default_factory=list)


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
    iteration_miss: str | None = None  # why the whole-iteration graph did not run it (None: it did)
    plan: StepPlan = field(default_factory=StepPlan)  # its depth and why
    # Replayed grammar-masked graphs (the scheduler may keep it in flight). The matchers (`cons`, the
    # batch's constraint states) take its tokens at `finish`, on the host; or they took them already,
    # and `cuts` (one per request) say where they cut them. `deferred`: host work `finish` does first
    # (a masked drafting iteration's last draft into the matchers).
    masked: bool = False
    cons: list[Any] | None = None
    cuts: list[Any] | None = None
    deferred: Callable[[], None] | None = None
    # KV positions each request's host length gains at `finish` (None: its emitted count): a fused mixed
    # step's prefill rows gained theirs at launch and their first token has no KV yet, so 0 there.
    kv_add: list[int] | None = None
    seq: int = 0  # the scheduler's count of launches when it was launched (`MemoryManager.settle`)


@dataclass
class SplitLaunch:
    """The forward half of a grammar-masked iteration, launched; `TargetWorker.complete` runs the rest."""

    reqs: list[Req]
    rpi: torch.Tensor
    flags: RowFlags
    timer: Timer
    plan: StepPlan
    cons: list[Any]
    pbs: int


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
    """Per request: the emitted tokens, and their logprobs where the request asked for them. A packed
    result may also be the tokens alone (int64 [bs, W], every one emitted, no logprobs: a prefill's
    first tokens, which need no pack)."""
    w = p.width
    rows = p.packed.tolist()
    if p.packed.dtype == torch.int64:
        return [([int(t) for t in row], None) for row in rows]
    if p.flags.logprobs < 0:  # no row asked for logprobs: tokens only
        if w == 1:  # a decode step's row is [token, count]
            return [([int(row[0])] if row[1] else [], None) for _, row in zip(p.reqs, rows)]
        return [([int(t) for t in row[: int(row[w])]], None) for _, row in zip(p.reqs, rows)]
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
