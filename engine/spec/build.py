"""Building the speculative worker: the draft stack a config names, one runner per draft step (each
with its own KV pool, request-to-token map and attention backend, registered with the memory manager),
and the worker over them. Every input is an explicit, typed argument; the function changes nothing it
is given but the memory manager (which learns the new maps) and returns the stack, whose fused-feature
layers the engine hands to its target model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mleagle.engine.contract.config import MAX_SPEC_STEPS, EngineConfig, ModelArch
from mleagle.engine.errors import EngineInputError
from mleagle.engine.executor.runner import ModelRunner, build_runner
from mleagle.engine.layers.linear import tp_shape_errors
from mleagle.engine.memory.manager import MemoryManager
from mleagle.engine.memory.req_to_token import ReqToTokenPool
from mleagle.engine.models.llama import LlamaForCausalLM
from mleagle.engine.spec.checkpoint import load_draft, load_layer, parse_spec, random_layer_weights
from mleagle.engine.spec.draft_model import DraftStack
from mleagle.engine.spec.worker import SpecWorker


@dataclass
class SpecParts:
    """What `build_spec_worker` made: the worker and the draft stack its runners run."""

    worker: SpecWorker
    stack: DraftStack


def build_spec_worker(ecfg: EngineConfig, arch: ModelArch, model: LlamaForCausalLM, target: ModelRunner,
                      mem: MemoryManager, *, max_reqs: int, dtype: torch.dtype, device: torch.device,
                      eos_ids: frozenset[int], cls: type[SpecWorker] = SpecWorker, **worker_kw: Any) -> SpecParts:
    """The draft named by `ecfg.draft` (a folder, an import, or `random:S`) over `target`; `cls` (and
    `worker_kw`) pick a measuring subclass (`mleagle.engine.spec.reference`) instead of the serving one."""
    assert ecfg.draft is not None
    try:
        kind, s, seed, chain = parse_spec(ecfg.draft)
    except ValueError as err:
        raise EngineInputError(str(err)) from err
    vocab_ids, blocks = None, 1
    aux_layers: tuple[int, ...] = ()
    auto_depths: tuple[int, ...] | None = None
    if kind == "random":
        layers = [random_layer_weights(arch, seed, k) for k in range(s or 0)]
        darch = arch
    else:
        try:
            ck = load_draft(ecfg.draft, arch)
            darch, chain, layers, vocab_ids = ck.arch, ck.chain, ck.layers, ck.vocab_ids
            blocks, aux_layers, auto_depths = ck.blocks, ck.aux_layers, ck.depths_for(device.type)
        except (FileNotFoundError, ValueError) as err:
            raise EngineInputError(str(err)) from err
        if darch.hidden_size != arch.hidden_size or darch.vocab_size != arch.vocab_size:
            raise EngineInputError(f"draft {ecfg.draft}: hidden/vocab ({darch.hidden_size}/{darch.vocab_size}) do not "
                                   f"match the target ({arch.hidden_size}/{arch.vocab_size})")
    steps = ecfg.spec_steps or min(len(layers), MAX_SPEC_STEPS)
    if steps > len(layers):
        raise EngineInputError(f"--spec-steps {steps} exceeds the draft's {len(layers)} layers")
    if ecfg.spec_depths is not None and not all(0 <= d <= steps for d in ecfg.spec_depths):
        raise EngineInputError(f"--spec-depths {ecfg.spec_depths}: each must be in 0..{steps} (the draft's steps)")
    if auto_depths is not None and ecfg.spec_policy == "auto" and "depths" in worker_kw and worker_kw["depths"] is None:
        # The engine named no depths (`spec_depths`): the draft's own choice for `auto` (its card says
        # why); those past a shortened --spec-steps drop out, as 0 and S are always in.
        worker_kw["depths"] = [d for d in auto_depths if d <= steps]
    tp_size = model.tp.size
    replicate = tp_size > 1 and ecfg.draft_tp == "replicate"
    if tp_size > 1 and not replicate:
        errs = tp_shape_errors(darch, tp_size, "draft ")
        if errs:
            raise EngineInputError(f"draft {ecfg.draft} cannot be sharded over tp_size={tp_size}: {'; '.join(errs)}; "
                                   'set draft_tp = "replicate" (--draft-tp replicate) to run it whole on every rank')
    try:
        stack = DraftStack(darch, len(layers), chain, dtype, model.embed_tokens, model.lm_head, model.rope,
                           layout=model.layout, replicate=replicate, vocab_ids=vocab_ids, blocks=blocks,
                           aux_layers=aux_layers)
    except ValueError as err:
        raise EngineInputError(f"draft {ecfg.draft}: {err}") from err
    for m, w in zip(stack.layers, layers):
        load_layer(m, {k: v.to(dtype) for k, v in w.items()})
    stack.to(device).eval()
    pool, r2t = target.binding.kv_pool, target.binding.req_to_token
    maps = ReqToTokenPool.stacked([f"draft{k}" for k in range(steps)], max_reqs, r2t.max_context, device)
    runners = []
    for k in range(steps):
        r = build_runner(f"draft{k}", stack.layers[k], num_slots=pool.num_slots, head_dim=darch.head_dim or 0,
                         backend=ecfg.attention_backend, max_reqs=max_reqs, max_context=r2t.max_context, dtype=dtype,
                         device=device, page_size=ecfg.page_size, r2t=maps[k])
        mem.add_map(r.binding.req_to_token)
        runners.append(r)
    worker = cls(target, runners, chain, steps, device, eos_ids, vocab=arch.vocab_size, max_reqs=max_reqs, **worker_kw)
    mem.on_alloc.append(worker.forget_pages)  # pages handed out again hold no valid draft KV
    return SpecParts(worker, stack)
