"""The engine: model, pools, runners, worker and scheduler put together, and the offline Python API.

`Engine(config)` loads the model and tokenizer, sizes the KV pools (one per runner, all of the same
slot count), builds the target runner (and, with a draft, the speculative worker) and the scheduler,
and has the worker capture its graphs on CUDA (the start-up report says what, how much memory and how
long). `add_request` / `abort` / `step` are the loop the engine process drives; `generate` and
`stream` are the offline API on top of them. Bad input raises `EngineInputError` before anything is
allocated, so it never harms other requests.

The engine knows neither tensor-parallel rank control nor telemetry. With `tp_size > 1` it runs on
the process's tensor-parallel group (`tp`, or `mleagle.engine.distributed.current()`), and whoever
started the ranks installs a `StepControl` (`mleagle.engine.service.tp_driver`), which sees every
replicable operation (`submit`) and wraps every step (`run_step`); followers replay the operations
with `apply_control`. Each step leaves a `StepReport` (`last_report`) and calls the step observers
with it: the engine process attaches its telemetry there (`mleagle.engine.service.telemetry`).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mleagle.engine.attention import resolve_backend
from mleagle.engine.contract.config import (
    MAX_SPEC_STEPS,
    EngineConfig,
    MleagleConfig,
    ModelArch,
    load_config,
    resolve_draft,
)
from mleagle.engine.contract.detokenizer import StopChecker
from mleagle.engine.contract.outputs import SpecStats, StepOutput, TokenLogprob
from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.contract.tokenizer import Tokenizer
from mleagle.engine.core.request import Req
from mleagle.engine.core.scheduler import Scheduler, StepReport
from mleagle.engine.distributed import LOCAL, TPGroup, current
from mleagle.engine.errors import EngineInputError
from mleagle.engine.executor.extend_graph import ExtendGraphRunner
from mleagle.engine.executor.results import device_busy, device_wait
from mleagle.engine.executor.runner import ModelRunner, build_runner, rank_heads
from mleagle.engine.executor.worker import GraphSettings, TargetWorker
from mleagle.engine.kernels import set_fused_layers
from mleagle.engine.layers.linear import (
    PACKED,
    PACKED_AVAILABLE,
    available_memory,
    packed_fits,
    tp_shape_errors,
)
from mleagle.engine.memory.allocator import SlotAllocator
from mleagle.engine.memory.kv_pool import KVPool
from mleagle.engine.memory.manager import MemoryManager
from mleagle.engine.model_loader import load_model
from mleagle.engine.models.llama import LlamaForCausalLM
from mleagle.engine.sampling.rng import mix

if TYPE_CHECKING:
    from mleagle.engine.spec.worker import SpecWorker

__all__ = ["Completion", "Engine", "EngineInputError", "StepControl", "tp_shape_errors"]

# A verify window reaches S positions past a request's last token, so the slot maps and the RoPE table
# extend past the context limit by the largest S an engine runs plus the bonus row.
LOOKAHEAD_MARGIN = MAX_SPEC_STEPS + 1

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger("mleagle.engine")


class StepControl(Protocol):
    """Whoever must see this engine's replicable operations and steps besides the engine itself (the
    tensor-parallel driver: rank 0 broadcasts them, followers apply them)."""

    def submit(self, msg: tuple[Any, ...]) -> None: ...

    def run_step(self, step: Callable[[], list[StepOutput]]) -> list[StepOutput]: ...

    def close(self) -> None: ...


StepObserver = Callable[[list[StepOutput], StepReport], None]


def check_constraint(runtime: Any, params: SamplingParams) -> None:
    """A constrained request's grammar compiled (and cached) by `runtime`, or its error as input."""
    from mleagle.engine.constrain.compiler import ConstraintError

    try:
        runtime.check(params)
    except ConstraintError as err:
        f = err.field
        param = f if f in ("logit_bias", "min_new_tokens", "structured_outputs") else f"structured_outputs.{f}"
        raise EngineInputError(f"{param}: {err}", param=param) from None


@dataclass
class Completion:
    """A finished request, as the offline API returns it."""

    rid: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    matched_stop: int | str | None
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None
    spec: SpecStats | None = None
    timings: dict[str, float] = field(default_factory=dict)


def _draft_arch(draft: str) -> ModelArch | None:
    """A draft folder's architecture, read before the model loads (to refuse a TP shape early); None for
    random drafts (the target's shape) and for imported checkpoints (checked when built)."""
    f = Path(draft) / "draft_config.json"
    if draft in ("", "none") or draft.startswith("random:") or not f.is_file():
        return None
    try:
        return ModelArch.model_validate(json.loads(f.read_text())["arch"])
    except (ValueError, KeyError):
        return None  # reported properly when the draft is read


def resolve_engine_config(config: MleagleConfig | str | None = None,
                          **engine_overrides: Any) -> tuple[MleagleConfig, bool]:
    """A configuration (a bundled name, a file, a model path, or None for the default) with overrides
    validated like a config file's [engine] table, the draft resolved for the device, and device and
    dtype resolved ("auto"); and whether the draft is the model's default. Raises `EngineInputError`
    for what a user must fix."""
    cfg = config if isinstance(config, MleagleConfig) else load_config(config)
    if engine_overrides:
        engine = EngineConfig.model_validate({**cfg.engine.model_dump(), **engine_overrides})
        cfg = cfg.model_copy(update={"engine": engine})
    dev = cfg.engine.resolved_device()
    draft, is_default = resolve_draft(cfg, dev)
    if is_default and draft == "none" and cfg.model.default_draft not in ("", "none"):
        log.info("default draft %s not loaded on %s (it pays on: %s); --draft %s loads it here",
                 cfg.model.default_draft, dev, ", ".join(cfg.model.default_draft_devices), cfg.model.default_draft)
    if is_default and draft not in ("", "none") and not draft.startswith("random:") and not Path(draft).is_dir():
        raise EngineInputError(f"the default draft of {cfg.model.name} ({cfg.model.default_draft}) is not at {draft}: "
                               "train it (`mleagle train-draft`, see the README), or pass --draft none")
    e = cfg.engine
    if e.device == "cuda" and not torch.cuda.is_available():
        raise EngineInputError("device 'cuda' requested but CUDA is not available")
    e = EngineConfig.model_validate({**e.model_dump(), "draft": draft, "device": dev, "dtype": e.resolved_dtype(dev)})
    return cfg.model_copy(update={"engine": e}), is_default


def check_tp_shapes(cfg: MleagleConfig, arch: ModelArch) -> None:
    """Refuse, with each fix named, a model or draft that cannot be sharded over `tp_size` ranks."""
    e = cfg.engine
    errs = tp_shape_errors(arch, e.tp_size, "")
    darch = _draft_arch(e.draft or "")
    if darch is not None and e.draft_tp == "shard":
        errs += [f"{x} (or set draft_tp = \"replicate\")" for x in tp_shape_errors(darch, e.tp_size, "draft ")]
    if errs:
        raise EngineInputError(f"model {cfg.model.name} cannot run with tensor parallelism: " + "; ".join(errs))


class Engine:
    def __init__(self, config: MleagleConfig | str | None = None, *,
                 tp: TPGroup | Callable[[], TPGroup] | None = None,
                 spec_worker: type[SpecWorker] | None = None, spec_worker_kw: dict[str, Any] | None = None,
                 **engine_overrides: Any):
        """`tp`: the tensor-parallel group to run on (default: the process's), or a function that joins
        one, called once the model's shape has been found shardable (so no rank starts for a model that
        cannot run). `spec_worker` (and its keyword arguments): a measuring subclass of the speculative
        worker (`mleagle.engine.spec.reference`)."""
        cfg, self.draft_is_default = resolve_engine_config(config, **engine_overrides)
        self.cfg = cfg
        e = cfg.engine
        if e.threads:
            torch.set_num_threads(e.threads)
        # The CPU's float32 GEMMs (layers/linear.py); `_packed_linear` decides again once the weights,
        # drafts and pools are in place and the memory left is known.
        PACKED["on"] = e.cpu_packed_linear and PACKED_AVAILABLE
        try:
            self.attention_backend = resolve_backend(e.attention_backend, e.device)
            if self.attention_backend == "flashinfer":
                from mleagle.engine.attention.flashinfer_backend import import_flashinfer

                import_flashinfer()
        except (ValueError, RuntimeError) as err:
            raise EngineInputError(str(err)) from err
        set_fused_layers(e.fused_layers)
        self.dtype = DTYPES[e.dtype]
        self.device = torch.device(e.device)
        t0 = time.perf_counter()
        # Dummy weights are generated on the device; real ones load on the CPU (dequantised, cached).
        loaded = load_model(cfg.model, self.dtype, self.device if cfg.model.load_format == "dummy" else "cpu")
        self.arch = loaded.arch
        self.control: StepControl | None = None  # installed by whoever started the ranks (tp_size > 1)
        if e.tp_size > 1:
            check_tp_shapes(cfg, self.arch)
        # TP size 1 never shards, even inside a process whose tensor-parallel group is larger.
        self.tp: TPGroup = tp() if callable(tp) else tp if tp is not None else current() if e.tp_size > 1 else LOCAL
        if e.tp_size > 1:
            if self.tp.size != e.tp_size:
                raise EngineInputError(
                    f"tp_size={e.tp_size}, but this process is in a tensor-parallel group of {self.tp.size}: start the "
                    "engine with mleagle.engine.service.tp_driver.start_engine (what serve, generate and bench do), "
                    "or inside a torch.distributed group of that size")
        self.tokenizer: Tokenizer | None = Tokenizer.from_source(cfg.model)
        self.max_context_len = min(e.max_context_len or self.arch.max_position_embeddings,
                                   self.arch.max_position_embeddings)
        with torch.device(self.device):  # parameters allocated where they run (an 8B shape never sits on the host)
            model = LlamaForCausalLM(self.arch, self.dtype, max_positions=self.max_context_len + LOOKAHEAD_MARGIN,
                                     tp=self.tp, layout=e.tp_layout)
        model.load_weights(loaded.weights)
        del loaded
        self.model = model.to(self.device).eval()
        self.load_time_s = time.perf_counter() - t0

        # Per rank: this rank's KV heads (a replicated head where there are fewer heads than ranks).
        slot_bytes = KVPool.slot_bytes(self.arch.num_hidden_layers, rank_heads(self.model)[1],
                                       self.arch.head_dim or 0, self.dtype)
        num_slots = e.max_total_tokens or int(e.kv_memory_mb * 2**20 // slot_bytes)
        num_slots = max(num_slots // e.page_size, 2) * e.page_size
        self.max_reqs = e.max_running_requests
        self.target = build_runner("target", self.model, num_slots=num_slots, head_dim=self.arch.head_dim or 0,
                                   backend=e.attention_backend, max_reqs=self.max_reqs,
                                   max_context=self.max_context_len + LOOKAHEAD_MARGIN, dtype=self.dtype,
                                   device=self.device, page_size=e.page_size)
        self.allocator = SlotAllocator(num_slots, e.page_size)
        self.mem = MemoryManager(self.allocator, [self.target.binding.req_to_token], prefix_cache=e.enable_prefix_cache)
        self.eos_ids = set(self.arch.eos_ids) | (set(self.tokenizer.eos_ids) if self.tokenizer else set())
        self.draft_stack: Any = None
        self.worker = self._build_worker(spec_worker, spec_worker_kw or {})
        self.worker.constrain.bind(self.tokenizer, sorted(self.eos_ids))  # structured output (engine/constrain)
        self.packed_linear = self._packed_linear(available_memory())
        self.worker.fuse_mixed = e.fuse_mixed_steps and self.worker.fuse_mixed  # (before its graphs are captured)
        self.graph_report = self.worker.capture_graphs(GraphSettings(
            cuda_graph=e.cuda_graph, emulate=e.graph_emulate, iteration=e.iteration_graph,
            max_bs=min(e.cuda_graph_max_bs or self.max_reqs, self.max_reqs), tp_size=self.tp.size,
            tp_rank=self.tp.rank, dtype=self.dtype, prefill_max_tokens=e.prefill_graph_max_tokens,
            prefill_max_reqs=self.max_reqs))
        self.scheduler = Scheduler(self.worker, self.mem, max_running=self.max_reqs,
                                   max_context=self.max_context_len, chunk_size=e.chunked_prefill_size,
                                   max_prefill_tokens=e.max_prefill_tokens, eos_ids=self.eos_ids,
                                   stop_cut=self._stop_cut, overlap=self._overlap(),
                                   prefill_wait=e.prefill_wait_steps)
        if self._side_stream():
            self.worker.side = torch.cuda.Stream(self.device, priority=-1)  # the first token comes first
            self.mem.hold_frees()
        self._seeds = itertools.count()
        self.model_name = cfg.model.name
        self.observers: list[StepObserver] = []  # called after every step (the engine process's telemetry)
        self.last_report: StepReport | None = None
        self._added: list[tuple[str, int]] = []  # (rid, prompt tokens) added since the last step

    def _build_worker(self, cls: type[SpecWorker] | None, kw: dict[str, Any]) -> TargetWorker:
        if self.cfg.engine.draft not in ("none", "", None):
            from mleagle.engine.spec.build import build_spec_worker  # the speculative path, when asked
            from mleagle.engine.spec.worker import SpecWorker

            e = self.cfg.engine
            kw = {"prefix_cache": self.mem.cache is not None,  # a reference worker may refuse the cache
                  "policy": e.spec_policy, "depths": e.spec_depths, "tp_size": e.tp_size, **kw}
            parts = build_spec_worker(self.cfg.engine, self.arch, self.model, self.target, self.mem,
                                      max_reqs=self.max_reqs, dtype=self.dtype, device=self.device,
                                      eos_ids=frozenset(self.eos_ids), cls=cls or SpecWorker, **kw)
            self.draft_stack = parts.stack
            self.model.aux_layers = parts.stack.aux_layers  # the target also returns the streams layer 0 reads
            return parts.worker
        return TargetWorker(self.target, self.device, frozenset(self.eos_ids), self.arch.vocab_size, self.max_reqs)

    def _side_stream(self) -> bool:
        """A prefill stream (`TargetWorker.prefill_stream`): target-only under overlap scheduling (CUDA
        only) with prefill graphs, one rank, no fused mixed steps (which read the iteration in flight)."""
        return (self.cfg.engine.prefill_side_stream and self.scheduler.overlap and self.tp.size == 1
                and self.worker.side_ok and isinstance(self.target.extend_graphs, ExtendGraphRunner)
                and not self.worker.fuse_mixed)

    def _overlap(self) -> bool:
        """Overlap scheduling on CUDA, unless a backend plans from exact host lengths (FlashInfer)."""
        e = self.cfg.engine
        return (e.overlap_schedule and self.device.type == "cuda"
                and not any(r.binding.backend.needs_host_lens for r in self.runners))

    def _packed_linear(self, available: int | None) -> dict[str, Any]:
        """Whether this engine's float32 CPU products of 3 rows or more run on packed weights
        (`cpu_packed_linear`, layers/linear.py), and why not where they do not: the packed copies hold
        the weights a second time, so where they would take over half the memory left once the model,
        its drafts and the KV pools are in place, the engine keeps MKL's products instead of swapping."""
        e = self.cfg.engine
        info: dict[str, Any] = {"on": False, "packed_mb": 0.0, "available_mb": None, "reason": None}
        if not e.cpu_packed_linear:
            info["reason"] = "cpu_packed_linear = false"
        elif not PACKED_AVAILABLE:
            info["reason"] = "this torch has no oneDNN packed linear"
        elif self.device.type != "cpu" or self.dtype != torch.float32:
            info["reason"] = "not float32 on the CPU"
        else:
            fits, n = packed_fits([r.model for r in self.runners], available)
            info.update(packed_mb=round(n / 2**20, 1),
                        available_mb=round(available / 2**20, 1) if available is not None else None)
            if fits:
                info["on"] = True
            else:
                info["reason"] = "the packed copies would take over half the available memory"
                log.warning("packed CPU weights off: %.0f MB of them against %.0f MB available (set "
                            "engine.cpu_packed_linear = false to silence)", n / 2**20, (available or 0) / 2**20)
        PACKED["on"] = info["on"]
        return info

    @property
    def runners(self) -> list[ModelRunner]:
        return self.worker.runners

    # --- the engine loop API -------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if rid in self.scheduler.reqs:
            raise EngineInputError(f"request id {rid!r} is already in use")
        ids = list(prompt_ids)
        if not ids:
            raise EngineInputError("the prompt is empty")
        v = self.arch.vocab_size
        bad = [t for t in ids if not 0 <= t < v]
        if bad:
            raise EngineInputError(f"prompt token ids out of range [0, {v}): {bad[:5]}")
        n, c = len(ids), self.max_context_len
        if n >= c:
            raise EngineInputError(f"the prompt has {n} tokens; the context limit is {c} (prompt + at least 1 new token)")
        if n + params.max_new_tokens > c:
            raise EngineInputError(f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                                   f"context limit ({c})")
        need = n + params.max_new_tokens + self.worker.lookahead
        if need > self.allocator.capacity_tokens:
            raise EngineInputError(f"the request needs up to {need} KV slots; the pool holds {self.allocator.capacity_tokens}")
        if params.stop and self.tokenizer is None:
            raise EngineInputError("stop strings need a tokenizer; this model has none")
        if params.constrained:  # structured output: compile (or find cached) now, so bad input is a 400
            check_constraint(self.worker.constrain, params)
        seed = params.seed if params.seed is not None else mix(self.cfg.engine.seed, next(self._seeds))
        self._add(rid, ids, params, seed)
        if self.control is not None:
            self.control.submit(("add", rid, ids, params, seed))

    def _add(self, rid: str, ids: list[int], params: SamplingParams, seed: int) -> None:
        req = Req(rid, ids, params, seed)
        req.constraint = self.worker.constrain.new_state(params)  # None for an unconstrained request
        if params.stop and self.tokenizer is not None:
            req.stop_state = StopChecker(self.tokenizer, params.stop, ids, params.skip_special_tokens)
        self.scheduler.add(req)
        self._added.append((rid, len(ids)))

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)
        if self.control is not None:
            self.control.submit(("abort", rid))

    def apply_control(self, msg: tuple[Any, ...]) -> None:
        """A follower rank: apply one of rank 0's operations (validated there, seed resolved)."""
        if msg[0] == "add":
            _, rid, ids, params, seed = msg
            self._add(rid, ids, params, seed)
        elif msg[0] == "abort":
            self.scheduler.abort(msg[1])
        elif msg[0] == "reset_cache":
            self.mem.reset_cache()
        elif msg[0] == "spec_warming":
            self.worker.policy.warming = msg[1]  # type: ignore[attr-defined]
        elif msg[0] == "spec_priming":
            self.worker.policy.priming = msg[1]  # type: ignore[attr-defined]
        elif msg[0] == "reset_counters":
            self.worker.reset_counters(*msg[1:])
        elif msg[0] == "spec_cost":  # rank 0's iteration timings: every rank's policy learns the same
            self.worker.policy.apply_published(msg[1])  # type: ignore[attr-defined]
        else:
            raise ValueError(f"unknown control message {msg[0]!r}")

    def step(self) -> list[StepOutput]:
        """One scheduler step (under tensor parallelism, through the control that keeps the ranks together)."""
        return self._step() if self.control is None else self.control.run_step(self._step)

    def _step(self) -> list[StepOutput]:
        outs = self.scheduler.step()
        policy = getattr(self.worker, "policy", None)
        if policy is not None and policy.publish and self.control is not None:
            timed = policy.take_published()  # rank 0's only; a follower's are dropped
            if timed and self.tp.rank == 0:
                policy.apply_published(timed)
                self.control.submit(("spec_cost", timed))
        report = self.scheduler.report
        report.added, self._added = self._added, []
        self.last_report = report
        for obs in self.observers:
            obs(outs, report)
        return outs

    def warm_up(self, lengths: Sequence[int] = (32, 256)) -> float:
        """Meet, before any request does, the shapes a first request meets: a prefill at each of a few
        prompt lengths with a few decode steps, greedy alone and sampled side by side (so the sampler's
        and the batch's paths run too); under `auto`, time the speculation policy's depths at each batch
        size it has `spec_prime_s` for (`_prime_policy`); then forget it all but those timings: the
        prefix cache emptied, every counter back to zero, the request seeds starting over. Returns the
        seconds it took. Under tensor
        parallelism the followers run it too (it goes through `add_request` and `step`)."""
        t0 = time.perf_counter()
        v = self.arch.vocab_size
        room = min(self.max_context_len, self.allocator.capacity_tokens // 2) - 8 - self.worker.lookahead
        prompts = [[(7 * i + 3) % v for i in range(n)] for n in lengths if n <= room] or [[1, 2, 3]]
        greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        sampled = SamplingParams(max_new_tokens=4, temperature=0.8, top_p=0.9, seed=0, ignore_eos=True)
        self._warming(True)  # the policy alternates its depths: the catch-ups between them run too
        try:
            for p in prompts:
                self.generate([p], greedy)
            self.generate(prompts, [sampled] * len(prompts))
        finally:
            self._warming(False)
        primed = self._prime_policy(self.cfg.engine.spec_prime_s)
        self.reset_prefix_cache()
        s, w = self.scheduler, self.worker
        s.num_steps = s.num_preemptions = s.prefix_queries = s.prefix_hits = s.num_mixed = s.num_fused = s.num_held = 0
        # The speculation policy forgets the warm-up's prompts (their acceptance), on every rank alike,
        # but keeps what it timed.
        w.reset_counters(primed)
        if self.control is not None:
            self.control.submit(("reset_counters", primed))
        self._seeds = itertools.count()
        self._added = []
        return time.perf_counter() - t0

    def _prime_policy(self, budget_s: float) -> bool:
        """Time each depth `auto` chooses from in each batch-size bucket, smallest first, within about
        `budget_s`: per bucket, that many greedy requests run until the policy has timed every depth
        there `window` times (it explores what it has not timed, as it would under traffic), then are
        aborted. A bucket is not started when the one before, scaled by size, says it would overrun.
        Returns whether anything was timed (the policy then keeps its timings through the reset)."""
        policy = getattr(self.worker, "policy", None)
        if policy is None or policy.mode != "auto" or budget_s <= 0:
            return False
        n_new = (policy.steps + 1) * (3 * policy.window + 4)  # the batch must not shrink before it is timed
        per_req = 24 + n_new + self.worker.lookahead
        if per_req > self.max_context_len:
            return False
        cap = min(self.scheduler.max_running, self.allocator.capacity_tokens // per_req)
        # Only these timings are kept: the warm-up before met each shape for the first time (one-time
        # costs, a CPU's first forward at a new size), on every rank alike.
        self.worker.reset_counters()
        if self.control is not None:
            self.control.submit(("reset_counters",))
        from mleagle.engine.spec.policy import size_bucket

        v = self.arch.vocab_size
        params = SamplingParams(max_new_tokens=n_new, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        last: tuple[int, float] | None = None
        timed: list[int] = []
        self._priming(True)
        try:
            for b in sorted({size_bucket(n) for n in range(1, cap + 1)}):
                n = min(b, cap)
                spent = time.perf_counter() - t0
                if last is not None and spent + last[1] * n / last[0] > budget_s:
                    break
                t1 = time.perf_counter()
                rids = [f"prime-{b}-{i}" for i in range(n)]
                for i, rid in enumerate(rids):
                    self.add_request(rid, [(11 * i + 5 * k + 1) % v for k in range(24)], params)
                while self.has_work() and not policy.timed(b):
                    self.step()
                for rid in rids:
                    self.abort(rid)
                while self.has_work():
                    self.step()
                if policy.timed(b):
                    timed.append(b)
                last = (n, time.perf_counter() - t1)
        finally:
            self._priming(False)
        log.info("speculation policy: depths %s timed at batch sizes up to %s in %.2fs (buckets %s)",
                 policy.choices, max(timed, default=0), time.perf_counter() - t0, timed)
        return bool(timed)

    def _priming(self, on: bool) -> None:
        """The policy times each depth `window` times while on (on every rank alike)."""
        self.worker.policy.priming = on  # type: ignore[attr-defined]
        if self.control is not None:
            self.control.submit(("spec_priming", on))

    def _warming(self, on: bool) -> None:
        policy = getattr(self.worker, "policy", None)
        if policy is not None:
            policy.warming = on
            if self.control is not None:
                self.control.submit(("spec_warming", on))

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (a no-op without them)."""
        if self.control is not None:
            self.control.close()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def _stop_cut(self, req: Req, n: int) -> tuple[int, str] | None:
        st: StopChecker = req.stop_state
        cut = st.update(req.output_ids[st.n : n])
        return (cut.keep, cut.matched) if cut is not None else None

    def stats(self) -> dict[str, Any]:
        """Host-side counters for the daemon's gauges and /debug: queue sizes, steps, spec totals, the
        speculation policy's snapshot (None for a target-only engine)."""
        sch = self.scheduler
        spec = getattr(self.worker, "stats", None)
        policy = getattr(self.worker, "policy", None)
        return {"num_running": len(sch.running), "num_waiting": len(sch.waiting), "num_steps": sch.num_steps,
                "num_preemptions": sch.num_preemptions, "load_time_s": round(self.load_time_s, 3),
                "spec": spec.summary() if spec is not None else None,
                "boundary_kv_stale_positions": getattr(self.worker, "boundary_kv_stale_positions", None),
                "tp_size": self.tp.size, "tp_layout": self.cfg.engine.tp_layout if self.tp.size > 1 else None,
                "prefix_cache": self.prefix_cache_stats(),
                "spec_policy": policy.snapshot() if policy is not None else None,
                "mixed_steps": sch.num_mixed, "fused_mixed_steps": sch.num_fused, "held_prefill_steps": sch.num_held,
                "iterations": self.mem.launches, "iteration_rows": sch.iteration_rows,
                "prefill_wait_steps": sch.prefill_wait, "graphs": self.graph_counts(),
                # first tokens sampled and committed inside a prefill graph (plain greedy prompts on one)
                "graph_first_tokens": self.worker.graph_first_tokens,
                # fused mixed steps staged whole into a prefill graph (plain greedy rows only)
                "graph_fused_steps": self.worker.graph_fused_steps,
                # prefills run on the prefill stream, beside the iteration in flight
                "side_stream_prefills": self.worker.side_prefills,
                "cpu_packed_linear": self.packed_linear,
                # host seconds blocked on the device since start (on a CPU engine, 0)
                "device_wait_s": round(device_wait.seconds, 6),
                # device seconds of the decode iterations since start, and how many were timed (CUDA
                # only: on a CPU engine, 0): against a run's wall, the device's busy share
                "device_busy_s": round(device_busy.seconds, 6), "device_busy_iterations": device_busy.iterations}

    def graph_counts(self) -> dict[str, Any]:
        """Per runner: graph replays (decode/verify/draft-extend shapes, and prefill by token bucket) and
        eager forwards by reason, since start (or the warm-up's reset)."""
        out: dict[str, Any] = {}
        for r in self.runners:
            shapes = [g for g in [r.graphs, *r.more_graphs] if g is not None]
            x = r.extend_graphs
            out[r.name] = {"replays": sum(sum(g.stats.replays.values()) for g in shapes),
                           "prefill_replays": dict(sorted(x.stats.replays.items())) if x is not None else {},
                           "eager": dict(r.eager)}
        if self.worker.iter_graphs:
            out["iteration"] = {"replays": sum(sum(g.stats.replays.values()) for g in self.worker.iter_graphs.values())}
        if self.worker.masked_graphs:  # grammar-masked iterations by depth (one replay of each half apiece)
            by = {d: m.replays for d, m in sorted(self.worker.masked_graphs.items())}
            out["masked"] = {"replays": sum(by.values()), "by_depth": by}
        fill = getattr(self.worker, "fill_graph", None)
        if fill is not None:  # the draft layers' fills, all layers in one replay, by token bucket
            out["draft_fill"] = {"replays": dict(sorted(fill.stats.replays.items()))}
        return out

    def prefix_cache_stats(self) -> dict[str, Any] | None:
        """Prompt tokens looked up in and found in the prefix cache at admission (vLLM's queries and
        hits, in tokens), what it holds now, and what it has evicted. None when it is off."""
        c, s = self.mem.cache, self.scheduler
        if c is None:
            return None
        return {"queries": s.prefix_queries, "hits": s.prefix_hits,
                "hit_rate": round(s.prefix_hits / s.prefix_queries, 4) if s.prefix_queries else 0.0,
                "cached_tokens": c.cached_tokens, "evictable_tokens": c.evictable_tokens,
                "evicted_tokens": c.evicted_tokens}

    def reset_prefix_cache(self) -> int:
        """Evict every cached prefix no running request uses; returns the tokens freed. Under tensor
        parallelism the other ranks do the same before the next step (their caches must match rank 0's,
        or their admissions, and so their forwards, would differ)."""
        if self.control is not None:
            self.control.submit(("reset_cache",))
        return self.mem.reset_cache()

    def pool_usage(self) -> list[dict[str, Any]]:
        """Per runner: KV slots held by requests (`kv_used`), cached prefixes (`kv_cached`, of which
        `kv_evictable` no request uses: free for the taking), request slots. Every runner holds a
        token's KV at the same slot, so the cache's figures are the same for each."""
        used_tok = self.mem.num_used_tokens
        c = self.mem.cache
        cached, evictable = (c.cached_tokens, c.evictable_tokens) if c is not None else (0, 0)
        return [{"runner": r.name, "kv_used": used_tok, "kv_total": self.allocator.capacity_tokens,
                 "kv_cached": cached, "kv_evictable": evictable,
                 "req_used": self.mem.num_used_reqs, "req_total": self.mem.max_reqs} for r in self.runners]

    # --- offline API ---------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int] | list[dict[str, str]], chat: bool = False) -> list[int]:
        # Refuse what is none of the three forms here, by name: past this point a None or a number
        # would fail deep in the tokenizer or the chat template (jinja), with nothing saying why.
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and (
                all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
                or all(isinstance(m, dict) for m in prompt))):
            what = "a list of " + "/".join(sorted({type(x).__name__ for x in prompt})) \
                if isinstance(prompt, list) else type(prompt).__name__
            raise EngineInputError(f"a prompt is text, a list of token ids or a list of chat messages, not {what}")
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            return list(prompt)  # type: ignore[arg-type]
        if self.tokenizer is None:
            raise EngineInputError("this model has no tokenizer: pass token ids")
        # Chat content is encoded as plain text (a user typing <|im_start|> cannot forge a turn).
        if isinstance(prompt, list):
            return self.tokenizer.encode_chat(prompt)  # type: ignore[arg-type]
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def stream(self, prompts: Sequence[Any], params: SamplingParams | Sequence[SamplingParams] | None = None,
               chat: bool = False) -> Iterator[tuple[int, StepOutput]]:
        """Yield (prompt index, delta) as the engine steps, until every prompt is finished."""
        plist = [params or SamplingParams()] * len(prompts) if not isinstance(params, Sequence) else list(params)
        rids: list[str] = []
        left: set[str] = set()
        try:
            for p, sp in zip(prompts, plist):
                rid = uuid.uuid4().hex
                self.add_request(rid, self.encode_prompt(p, chat), sp)
                rids.append(rid)
                left.add(rid)  # a later bad prompt aborts the ones already added (finally below)
            index = {r: i for i, r in enumerate(rids)}
            while left:
                for out in self.step():
                    if out.rid in index:
                        if out.finished:
                            left.discard(out.rid)
                        yield index[out.rid], out
        finally:
            for r in left:
                self.abort(r)
            while any(r in self.scheduler.reqs for r in left):
                self.step()
            if not self.scheduler.running and self.scheduler.inflight is not None:
                self.step()  # the step launched past the last finish: its results are dropped

    def generate(self, prompts: Sequence[Any], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat: bool = False) -> list[Completion]:
        encoded = [self.encode_prompt(p, chat) for p in prompts]
        res: dict[int, Completion] = {}
        t0 = time.perf_counter()
        for i, out in self.stream(encoded, params):
            c = res.setdefault(i, Completion("", encoded[i], [], "", None, None, None, None))
            c.rid = out.rid
            c.token_ids += out.token_ids
            if out.logprobs is not None:
                c.logprobs = (c.logprobs or []) + out.logprobs
            if out.prompt_logprobs is not None:
                c.prompt_logprobs = (c.prompt_logprobs or []) + out.prompt_logprobs
            if out.finished:
                c.finish_reason, c.matched_stop, c.spec = out.finish_reason, out.matched_stop, out.spec
                c.timings["e2e_s"] = time.perf_counter() - t0
        plist = [params or SamplingParams()] * len(prompts) if not isinstance(params, Sequence) else list(params)
        for i, c in res.items():
            c.text = self.detokenize(c.token_ids, plist[i], c.prompt_ids)
        return [res[i] for i in range(len(prompts))]

    def detokenize(self, ids: list[int], sp: SamplingParams, prompt_ids: Sequence[int] = ()) -> str:
        """Output text as the scheduler saw it: the same prompt context, cut before a stop string."""
        if self.tokenizer is None:
            return ""
        if sp.stop:
            cut = StopChecker(self.tokenizer, sp.stop, prompt_ids, sp.skip_special_tokens).update(ids)
            if cut is not None:
                return cut.text
        return self.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)

