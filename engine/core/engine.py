"""The engine: model, pools, runners, worker and scheduler put together, and the offline Python API.

`Engine(config)` loads the model and tokenizer, sizes the KV pools (one per runner, all of the same
slot count), builds the target runner (and, with a draft, the speculative worker) and the scheduler,
and on CUDA captures each runner's graphs (reporting what, how much memory and how long).
`add_request` / `abort` / `step` are the loop the engine process drives; `generate` and `stream` are
the offline API on top of them. Bad input raises `EngineInputError` before anything is allocated,
so it never harms other requests.

With `tp_size > 1` this process is rank 0 of a tensor-parallel engine (`engine/service/ranks.py` starts
the other ranks and keeps them alive): the model, its pools and the draft layers are sharded, and every
`add_request` / `abort` is also queued for the other ranks, which receive the queue before each `step`
and run the same schedule (`apply_control`). `close()` stops them.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mleagle.engine.attention import create_backend, resolve_backend
from mleagle.engine.contract.config import (
    MAX_SPEC_STEPS,
    EngineConfig,
    MleagleConfig,
    load_config,
    resolve_draft,
)
from mleagle.engine.contract.detokenizer import StopChecker
from mleagle.engine.contract.outputs import RequestOutput, SpecStats, TokenLogprob
from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.contract.tokenizer import Tokenizer
from mleagle.engine.core.request import Req
from mleagle.engine.core.scheduler import Scheduler
from mleagle.engine.distributed import LOCAL, TPGroup
from mleagle.engine.executor.forward_batch import ForwardMode
from mleagle.engine.executor.graph_runner import GraphRunner, default_buckets
from mleagle.engine.executor.iteration_graph import IterationGraph
from mleagle.engine.executor.runner import ModelRunner
from mleagle.engine.executor.worker import TargetWorker
from mleagle.engine.kernels import set_fused_layers
from mleagle.engine.layers.linear import kv_heads_per_rank
from mleagle.engine.memory.allocator import SlotAllocator
from mleagle.engine.memory.kv_pool import KVPool
from mleagle.engine.memory.manager import MemoryManager
from mleagle.engine.memory.req_to_token import ReqToTokenPool
from mleagle.engine.model_loader import load_model
from mleagle.engine.models.llama import LlamaForCausalLM
from mleagle.engine.sampling.rng import mix
from mleagle.engine.service.telemetry import Telemetry

# A verify window reaches S positions past a request's last token, so the slot maps and the RoPE table
# extend past the context limit by the largest S an engine runs plus the bonus row.
LOOKAHEAD_MARGIN = MAX_SPEC_STEPS + 1

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger("mleagle.engine")


class EngineInputError(ValueError):
    """A request the engine refuses; the message is meant for the user. `param` names the request
    field at fault where one is (a dotted path into `SamplingParams`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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


def rank_heads(model: torch.nn.Module, arch: Any) -> tuple[int, int]:
    """(query heads, KV heads) of this rank's attention in `model` (a target or one draft layer)."""
    block = getattr(model, "block", None)
    attn = block.self_attn if block is not None else model.layers[0].self_attn  # type: ignore[index]
    return int(attn.hq), int(attn.hk)


def tp_shape_errors(arch: Any, n: int, what: str) -> list[str]:
    """Why `arch` cannot be sharded over n ranks (empty: it can). KV heads may be fewer than the ranks
    (then replicated), as long as one divides the other; the vocabulary is padded, never checked."""
    errs = []
    if arch.num_attention_heads % n:
        errs.append(f"{what}num_attention_heads={arch.num_attention_heads} is not divisible by tp_size={n}")
    try:
        kv_heads_per_rank(arch.num_key_value_heads, n)
    except ValueError:
        errs.append(f"{what}num_key_value_heads={arch.num_key_value_heads} neither divides nor is divisible by "
                    f"tp_size={n}")
    if arch.intermediate_size % n:
        errs.append(f"{what}intermediate_size={arch.intermediate_size} is not divisible by tp_size={n}")
    return errs


def _draft_arch(draft: str) -> Any:
    """A draft folder's architecture, read before any rank starts (the draft loads later, per rank);
    None for random drafts (the target's shape) and for imported checkpoints (checked when built)."""
    import json
    from pathlib import Path

    from mleagle.engine.contract.config import ModelArch

    f = Path(draft) / "draft_config.json"
    if draft in ("", "none") or draft.startswith("random:") or not f.is_file():
        return None
    try:
        return ModelArch.model_validate(json.loads(f.read_text())["arch"])
    except (ValueError, KeyError):
        return None  # reported properly when the draft is read


def build_runner(name: str, model: torch.nn.Module, num_slots: int, arch: Any,
                 ecfg: EngineConfig, max_reqs: int, max_context: int, dtype: torch.dtype) -> ModelRunner:
    """A runner with its own KV pool, request-to-token map and attention backend, the pool holding this
    rank's KV heads (all of them at TP size 1) for each of the model's attention layers (`num_kv_layers`:
    the target's decoder layers, or a draft step's blocks)."""
    hq, hk = rank_heads(model, arch)
    pool = KVPool(name, int(model.num_kv_layers), num_slots, hk, arch.head_dim, dtype, ecfg.device, ecfg.page_size)
    r2t = ReqToTokenPool(name, max_reqs, max_context, ecfg.device)
    backend = create_backend(ecfg.attention_backend, pool, r2t, hq)
    return ModelRunner(name, model, pool, r2t, backend)


class Engine:
    def __init__(self, config: MleagleConfig | str | None = None, **engine_overrides: Any):
        cfg = config if isinstance(config, MleagleConfig) else load_config(config)
        if engine_overrides:  # validated like a config file's [engine] table
            engine = EngineConfig.model_validate({**cfg.engine.model_dump(), **engine_overrides})
            cfg = cfg.model_copy(update={"engine": engine})
        dev = cfg.engine.resolved_device()
        draft, self.draft_is_default = resolve_draft(cfg, dev)
        if self.draft_is_default and draft == "none" and cfg.model.default_draft not in ("", "none"):
            log.info("default draft %s not loaded on %s (it pays on: %s); --draft %s loads it here",
                     cfg.model.default_draft, dev, ", ".join(cfg.model.default_draft_devices), cfg.model.default_draft)
        if self.draft_is_default and draft not in ("", "none") and not draft.startswith("random:") \
                and not Path(draft).is_dir():
            raise EngineInputError(f"the default draft of {cfg.model.name} ({cfg.model.default_draft}) is not at {draft}: "
                                   "train it (`mleagle train-draft`, see the README), or pass --draft none")
        cfg = cfg.model_copy(update={"engine": EngineConfig.model_validate({**cfg.engine.model_dump(), "draft": draft})})
        e = cfg.engine
        if e.device == "cuda" and not torch.cuda.is_available():
            raise EngineInputError("device 'cuda' requested but CUDA is not available")
        e = e.model_copy(update={"device": dev, "dtype": e.resolved_dtype(dev)})
        cfg = cfg.model_copy(update={"engine": e})
        self.cfg = cfg
        if e.threads:
            torch.set_num_threads(e.threads)
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
        self.ranks: Any = None  # the tensor-parallel runtime (engine/service/ranks.py), tp_size > 1
        self.tp: TPGroup = LOCAL
        self._outbox: list[tuple[Any, ...]] = []  # control messages for the other ranks, sent before a step
        self._digest = 0
        if e.tp_size > 1:
            errs = tp_shape_errors(self.arch, e.tp_size, "")
            darch = _draft_arch(e.draft)
            if darch is not None and e.draft_tp == "shard":
                errs += [f"{x} (or set draft_tp = \"replicate\")" for x in tp_shape_errors(darch, e.tp_size, "draft ")]
            if errs:
                raise EngineInputError(f"model {cfg.model.name} cannot run with tensor parallelism: " + "; ".join(errs))
            from mleagle.engine.service import ranks

            try:
                self.ranks = ranks.attach(cfg)
            except (ValueError, ranks.RankError) as err:
                raise EngineInputError(str(err)) from err
            self.tp = self.ranks.tp
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
        slot_bytes = KVPool.slot_bytes(self.arch.num_hidden_layers, rank_heads(self.model, self.arch)[1],
                                       self.arch.head_dim or 0, self.dtype)
        num_slots = e.max_total_tokens or int(e.kv_memory_mb * 2**20 // slot_bytes)
        num_slots = max(num_slots // e.page_size, 2) * e.page_size
        self.max_reqs = e.max_running_requests
        self.target = build_runner("target", self.model, num_slots, self.arch, e,
                                   self.max_reqs, self.max_context_len + LOOKAHEAD_MARGIN, self.dtype)
        self.allocator = SlotAllocator(num_slots, e.page_size)
        self.mem = MemoryManager(self.allocator, [self.target.binding.req_to_token], prefix_cache=e.enable_prefix_cache)
        self.eos_ids = set(self.arch.eos_ids) | (set(self.tokenizer.eos_ids) if self.tokenizer else set())
        self.worker = self._build_worker()
        self.worker.constrain.bind(self.tokenizer, sorted(self.eos_ids))  # structured output (engine/constrain)
        self.graph_report = self._capture_graphs()
        self.scheduler = Scheduler(self.worker, self.mem, max_running=self.max_reqs,
                                   max_context=self.max_context_len, chunk_size=e.chunked_prefill_size,
                                   max_prefill_tokens=e.max_prefill_tokens, eos_ids=self.eos_ids,
                                   stop_cut=self._stop_cut, overlap=self._overlap())
        self._seeds = itertools.count()
        self.model_name = cfg.model.name
        self.events: Any = None  # an EventBus, installed by the engine process
        self.telemetry = Telemetry(self)
        for r in self.runners:
            r.observer = self.telemetry.on_forward

    def _build_worker(self) -> TargetWorker:
        if self.cfg.engine.draft not in ("none", ""):
            from mleagle.engine.spec.worker import build_spec_worker  # the speculative path, when asked

            return build_spec_worker(self)
        return TargetWorker(self.target, self.device, frozenset(self.eos_ids), self.arch.vocab_size, self.max_reqs)

    def _capture_iteration(self, buckets: list[int], pool: object, cuda: bool) -> str:
        """Whole-iteration graphs for plain greedy batches, when every runner's forward can be captured
        and no backend plans from host lengths (a single replay leaves no room to plan each forward).

        Under tensor parallelism every rank captures the same body with its collectives inside, and
        every rank takes the same path for a step (the choice depends only on the batch, which is the
        same everywhere), so the ranks replay the same bucket's graph together; the metadata recorded
        and checked is each forward's per-rank counts for its runner's layout."""
        from mleagle.engine.sampling.processor import RowFlags

        w = self.worker
        if not self.cfg.engine.iteration_graph:
            return "iteration: off (iteration_graph = false)"
        if any(r.graphs is None or r.binding.backend.needs_host_lens for r in self.runners):
            return "iteration: per-forward graphs only"
        if getattr(w, "boundary_kv", "stale") != "stale":
            return "iteration: per-forward graphs only (boundary_kv recompute)"
        steps = getattr(w, "steps", 0)
        plain = RowFlags()
        w._arange(buckets[-1] * (steps + 1))  # grown before any capture, never inside one
        if steps:
            def body(rpi: torch.Tensor, live: torch.Tensor) -> Any:
                return w._iteration(rpi, live, plain, w.capture_view(int(rpi.shape[0])), eager=True)[:2]

            def meta(pbs: int) -> Any:
                return ([self.target.rule_meta(ForwardMode.TARGET_VERIFY, pbs, steps + 1)]
                        + [r.rule_meta(ForwardMode.DRAFT_EXTEND, pbs, steps + 1, pruned=True) for r in self.runners[1:]])
        else:
            def body(rpi: torch.Tensor, live: torch.Tensor) -> Any:
                return w._decode_body(rpi, live, plain, w.capture_view(int(rpi.shape[0])), eager=True)

            def meta(pbs: int) -> Any:
                return [self.target.rule_meta(ForwardMode.DECODE, pbs, 1)]
        g = IterationGraph("spec" if steps else "decode", body, meta, buckets, self.target.binding.req_to_token.pad_row,
                           self.device, emulate=not cuda, pool=pool)
        try:
            g.capture()
        except Exception as err:  # per-forward graphs still serve every batch
            if self.tp.size > 1:  # but not on one rank alone (see `_capture_graphs`)
                raise RuntimeError(f"rank {self.tp.rank}: whole-iteration graph capture failed under tensor "
                                   f"parallelism: {type(err).__name__}: {err}") from err
            log.exception("whole-iteration graph capture failed; per-forward graphs serve instead")
            return f"iteration: per-forward graphs only (capture failed: {type(err).__name__}: {err})"
        w.iter_graph = g
        return (f"iteration ({'verify + accept + ' + str(steps) + ' draft steps' if steps else 'decode + sample'}): "
                f"buckets {g.buckets[0]}..{g.buckets[-1]} ({len(g.buckets)}), {g.stats.capture_mb:.0f} MiB, "
                f"{g.stats.capture_s:.2f} s")

    def _overlap(self) -> bool:
        """Overlap scheduling on CUDA, unless a backend plans from exact host lengths (FlashInfer)."""
        e = self.cfg.engine
        return (e.overlap_schedule and self.device.type == "cuda"
                and not any(r.binding.backend.needs_host_lens for r in self.runners))

    def _capture_graphs(self) -> str:
        """CUDA graphs for every runner's uniform forward (target decode or verify, each draft step),
        captured against that runner's own binding; on the CPU only when emulated (tests)."""
        e = self.cfg.engine
        cuda = self.device.type == "cuda"
        if not e.cuda_graph or not (cuda or e.graph_emulate):
            for r in self.runners:
                r.no_graph_reason = "disabled" if cuda or not e.cuda_graph else "cpu"
            return "cuda graphs: off" + ("" if cuda else " (cpu)")
        spec = self.runners[1:]
        w = getattr(self.worker, "steps", 0) + 1
        buckets = default_buckets(min(e.cuda_graph_max_bs or self.max_reqs, self.max_reqs))
        pool = torch.cuda.graph_pool_handle() if cuda else None
        lines = []
        for r in self.runners:
            if cuda and not getattr(r.binding.backend, "supports_graphs", False):
                r.no_graph_reason = f"backend {r.binding.backend.name}"
                lines.append(f"{r.name}: eager (backend {r.binding.backend.name} cannot be captured)")
                continue
            mode = ForwardMode.DRAFT_EXTEND if r in spec else ForwardMode.TARGET_VERIFY if spec else ForwardMode.DECODE
            # A draft-extend graph's input hidden is as wide as its layer reads (fused target features).
            hidden = getattr(r.model, "hidden_in_size", self.arch.hidden_size)
            g = GraphRunner(r, mode=mode, width=1 if mode is ForwardMode.DECODE else w, buckets=buckets,
                            hidden_size=hidden, dtype=self.dtype, pruned=mode is ForwardMode.DRAFT_EXTEND,
                            emulate=not cuda, pool=pool, tp_size=r.tp_size, layout=r.layout)
            try:
                g.capture()
            except Exception as err:  # a kernel that cannot be captured: serve eagerly, say why
                if self.tp.size > 1:
                    # A rank cannot fall back alone: an eager forward's collectives are sized by the live
                    # batch, a replay's by its bucket, so the ranks would no longer meet. Fail the engine.
                    raise RuntimeError(f"rank {self.tp.rank}: graph capture of {r.name} failed under tensor "
                                       f"parallelism: {type(err).__name__}: {err}") from err
                log.exception("graph capture of %s failed; it runs eagerly", r.name)
                r.no_graph_reason = f"capture failed: {type(err).__name__}"
                lines.append(f"{r.name}: eager (capture failed: {type(err).__name__}: {err})")
                continue
            r.graphs = g
            lines.append(f"{r.name}: {mode.value} W={g.width} buckets {g.buckets[0]}..{g.buckets[-1]} "
                         f"({len(g.buckets)}), {g.stats.capture_mb:.0f} MiB, {g.stats.capture_s:.2f} s")
        lines.append(self._capture_iteration(buckets, pool, cuda))
        report = "cuda graphs" + (" (emulated)" if not cuda else "") + ":\n  " + "\n  ".join(lines)
        log.info(report)
        return report

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

    def _add(self, rid: str, ids: list[int], params: SamplingParams, seed: int) -> None:
        req = Req(rid, ids, params, seed)
        req.constraint = self.worker.constrain.new_state(params)  # None for an unconstrained request
        if params.stop and self.tokenizer is not None:
            req.stop_state = StopChecker(self.tokenizer, params.stop, ids, params.skip_special_tokens)
        self.scheduler.add(req)
        self.telemetry.prompt_total += len(ids)
        self.telemetry.on_add(rid, len(ids))
        if self.ranks is not None and self.ranks.rank == 0:
            self._outbox.append(("add", rid, ids, params, seed))

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)
        if self.ranks is not None and self.ranks.rank == 0:
            self._outbox.append(("abort", rid))

    def apply_control(self, msg: tuple[Any, ...]) -> None:
        """A follower rank: apply one of rank 0's control messages (validated there, seed resolved)."""
        if msg[0] == "add":
            _, rid, ids, params, seed = msg
            self._add(rid, ids, params, seed)
        elif msg[0] == "abort":
            self.scheduler.abort(msg[1])
        elif msg[0] == "reset_cache":
            self.mem.reset_cache()
        else:
            raise ValueError(f"unknown control message {msg[0]!r}")

    def step(self) -> list[RequestOutput]:
        if self.ranks is None:
            return self._step()
        try:
            if self.ranks.rank == 0:
                # Every rank applies the same messages, then runs the same step (engine/service/ranks.py).
                from mleagle.engine.service.ranks import Control

                self.ranks.send(Control(self._outbox, step=True, digest=self._digest))
                self._outbox = []
            return self._step()
        except Exception as err:
            if self.ranks.closed or not getattr(self.ranks, "owned", False):
                raise
            failed = self.ranks.failed(err)  # name the rank that is gone, not the collective
            # Said now: the cleanup on the way out (the broken group's teardown) may not return.
            log.error("%s", failed)
            raise failed from err

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outs = self.scheduler.step()
        self.telemetry.on_step(outs, time.perf_counter() - t0)
        if self.ranks is not None:
            from mleagle.engine.service.ranks import outputs_digest

            self._digest = outputs_digest(outs)
        return outs

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0; a no-op at TP size 1 and on followers)."""
        if self.ranks is not None and self.ranks.rank == 0:
            self.ranks.stop_engine()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def _stop_cut(self, req: Req, n: int) -> tuple[int, str] | None:
        st: StopChecker = req.stop_state
        cut = st.update(req.output_ids[st.n : n])
        return (cut.keep, cut.matched) if cut is not None else None

    def stats(self) -> dict[str, Any]:
        """Host-side counters for the daemon's gauges and /debug: queue sizes, steps, spec totals."""
        sch = self.scheduler
        spec = getattr(self.worker, "stats", None)
        return {"num_running": len(sch.running), "num_waiting": len(sch.waiting), "num_steps": sch.num_steps,
                "num_preemptions": sch.num_preemptions, "load_time_s": round(self.load_time_s, 3),
                "spec": spec.summary() if spec is not None else None,
                "boundary_kv_stale_positions": getattr(self.worker, "boundary_kv_stale_positions", None),
                "tp_size": self.tp.size, "tp_layout": self.cfg.engine.tp_layout if self.tp.size > 1 else None,
                "prefix_cache": self.prefix_cache_stats()}

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
        if self.ranks is not None and self.ranks.rank == 0:
            self._outbox.append(("reset_cache",))
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
               chat: bool = False) -> Iterator[tuple[int, RequestOutput]]:
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

