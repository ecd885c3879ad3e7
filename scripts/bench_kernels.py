"""Kernel micro-benchmark: each Triton kernel (and FlashInfer's attention) against its torch reference.

Shapes: SmolLM2-135M (hidden 576, 9/3 heads of 64, 30 layers) and Llama-3-8B (4096, 32/8 heads of
128, 32 layers), decode batches of 1, 32 and 64 requests at contexts of ~512 and ~2048 tokens.
Rows, per shape and batch (and context for attention):

- `add_rmsnorm` (fused residual add + RMSNorm) vs the reference (add, then the float32 norm);
- `silu_and_mul` vs F.silu(g) * u;
- `rope_store` (rotary for q and k + K/V store at the batch's slots) vs rope.rotate + index writes;
- `attn decode` (W = 1) and `attn verify` (W = 4, causal window): one layer's attention work through
  each backend's real plan/forward path: rotary, the K/V store and attention (timed per layer; the
  plan is per forward, shared by all layers, and not timed): torch (rotate, index writes, gather +
  SDPA with a boolean mask), triton (one fused launch, + a merge when split), triton without KV splits
  (what the split-KV choice buys at small batch), flashinfer when importable (rope_store + its paged
  kernel); `floor` is the K/V bytes read over 4.2 TB/s (the H200's measured copy bandwidth).

Times are medians of triton.testing.do_bench (eager launches, L2 flushed between calls) over inputs
rotated through several copies (distinct KV layers, distinct activations), in microseconds; the
`graph` column is the Triton path replayed from a CUDA graph (do_bench_cudagraph), the way the engine
runs it. Last, the CUDA kernels one decoder layer launches, counted with the profiler on a 1- and a
2-layer model of each shape (the difference): reference layers + torch backend vs fused + Triton.

    python scripts/bench_kernels.py [--out results/bench_kernels.json] [--no-flashinfer] [--quick]
    TRITON_INTERPRET=1 python scripts/bench_kernels.py --check   # CPU: plumbing and correctness only

Prints a table; writes JSON to --out, else $OUT/bench_kernels.json, else ./bench_kernels.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from mleagle.engine.attention import create_backend
from mleagle.engine.contract.config import ModelArch
from mleagle.engine.executor.forward_batch import ForwardMode, build_batch
from mleagle.engine.executor.runner import StepBinding
from mleagle.engine.layers.activation import silu_and_mul_ref
from mleagle.engine.layers.norm import rms_norm_ref
from mleagle.engine.layers.rope import RotaryEmbedding
from mleagle.engine.memory.kv_pool import KVPool
from mleagle.engine.memory.req_to_token import ReqToTokenPool

SHAPES = {
    "smollm2-135m": dict(hidden=576, hq=9, hk=3, d=64, inter=1536, layers=30, vocab=49152, theta=1e5),
    "llama3-8b": dict(hidden=4096, hq=32, hk=8, d=128, inter=14336, layers=32, vocab=128256, theta=5e5),
}
HBM_BPS = 4.2e12
ROTATE_BYTES = 256 * 2**20  # rotate inputs until the copies exceed this (H200 L2: 50 MB)


def bench(fn: Callable[[], Any], device: torch.device, graph: bool = False) -> float:
    """Median microseconds of fn (CUDA); on the CPU (--check) just run it once."""
    if device.type != "cuda":
        fn()
        return float("nan")
    import triton.testing as tt

    if graph:
        return tt.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
    return tt.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


class Rot:
    """Cycle through prepared input sets, one per call."""

    def __init__(self, sets: list[Any]):
        self.sets, self.i = sets, 0

    def next(self) -> Any:
        self.i = (self.i + 1) % len(self.sets)
        return self.sets[self.i]


def copies(nbytes: int, cap: int = 16) -> int:
    return max(2, min(cap, ROTATE_BYTES // max(nbytes, 1)))


# --- layers ------------------------------------------------------------------------------------------
def bench_layers(s: dict[str, int], bs: int, dtype: torch.dtype, dev: torch.device, check: bool) -> list[dict]:
    from mleagle.engine.kernels.activation import silu_and_mul
    from mleagle.engine.kernels.norm import add_rmsnorm

    rows = []
    h, inter = s["hidden"], s["inter"]
    w = torch.rand(h, device=dev).to(dtype) + 0.5
    n = copies(2 * bs * h * 2)
    xs = [(torch.randn(bs, h, device=dev).to(dtype), torch.randn(bs, h, device=dev).to(dtype)) for _ in range(n)]
    xr, xt = Rot(xs), Rot(xs)  # one rotation per function: their first calls read the same set

    def ref_norm() -> Any:
        x, r = xr.next()
        t = x + r
        return rms_norm_ref(t, w, 1e-5), t

    def tri_norm() -> Any:
        x, r = xt.next()
        return add_rmsnorm(x, r, w, 1e-5)

    rows.append(_row("add_rmsnorm", bs, None, ref_norm, tri_norm, dev, check, floor_bytes=5 * bs * h * 2))
    n = copies(bs * 2 * inter * 2)
    gs = [torch.randn(bs, 2 * inter, device=dev).to(dtype) for _ in range(n)]
    gr, gt = Rot(gs), Rot(gs)
    rows.append(_row("silu_and_mul", bs, None, lambda: silu_and_mul_ref(gr.next()), lambda: silu_and_mul(gt.next()),
                     dev, check, floor_bytes=3 * bs * inter * 2))
    return rows


def _row(kernel: str, bs: int, ctx: int | None, ref: Callable[[], Any], tri: Callable[[], Any], dev: torch.device,
         check: bool, floor_bytes: int = 0, extra: dict[str, Callable[[], Any]] | None = None,
         graph_fn: Callable[[], Any] | None = None) -> dict:
    r: dict[str, Any] = {"kernel": kernel, "bs": bs, "ctx": ctx}
    if check:  # every function's first call reads the same (second) input set

        def first(f: Callable[[], Any]) -> torch.Tensor:
            y = f()
            return y[0] if isinstance(y, tuple) else y

        base = first(ref)
        r["max_err"] = (base.float() - first(tri).float()).abs().max().item()
        for k, f in (extra or {}).items():
            r[f"{k}_max_err"] = (base.float() - first(f).float()).abs().max().item()
    r["torch_us"] = bench(ref, dev)
    r["triton_us"] = bench(tri, dev)
    r["triton_graph_us"] = bench(graph_fn or tri, dev, graph=True) if not check else float("nan")
    for k, f in (extra or {}).items():
        r[f"{k}_us"] = bench(f, dev)
    r["floor_us"] = floor_bytes / HBM_BPS * 1e6
    return r


# --- attention ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class AttnSet:
    pool: KVPool
    r2t: ReqToTokenPool
    backend: Any
    batch: Any


def attn_setup(name: str, s: dict[str, int], bs: int, ctx: int, width: int, nlayers: int, dtype: torch.dtype,
               dev: torch.device, splits: int | None = None) -> AttnSet:
    hq, hk, d = s["hq"], s["hk"], s["d"]
    per = ctx + width
    slots = bs * per + 1
    pool = KVPool(f"{name}-pool", nlayers, slots, hk, d, dtype, dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    for i in range(nlayers):  # random but finite K/V
        pool.k[i].copy_(torch.randn(slots, hk, d, generator=g).to(dtype))
        pool.v[i].copy_(torch.randn(slots, hk, d, generator=g).to(dtype))
    m = ReqToTokenPool(f"{name}-map", bs + 1, per, dev)
    order = torch.randperm(bs, generator=g)  # requests' slot ranges shuffled, contiguous within one
    for b in range(bs):
        o = int(order[b])
        m.req_to_token[b + 1] = torch.arange(1 + o * per, 1 + (o + 1) * per, device=dev)
    be = create_backend(name.split("-")[0], pool, m, hq)
    if splits is not None:
        be.max_kv_splits = splits
    mode = ForwardMode.DECODE if width == 1 else ForwardMode.TARGET_VERIFY
    b = build_batch(mode, input_ids=torch.zeros(bs * width, dtype=torch.int64), req_pool_indices=list(range(1, bs + 1)),
                    prefix_lens=[ctx] * bs, extend_lens=[width] * bs, req_to_token=m.req_to_token.cpu(), width=width,
                    device=dev)
    b = dataclasses.replace(b, binding=StepBinding(pool.name, pool, m, be))
    if be.supports_graphs and dev.type == "cuda":
        be.init_graph(bs, width)
    be.plan(b)
    return AttnSet(pool, m, be, b)


def bench_attention(s: dict[str, int], bs: int, ctx: int, width: int, dtype: torch.dtype, dev: torch.device,
                    check: bool, flashinfer: bool, with_store: bool) -> list[dict]:
    hq, hk, d = s["hq"], s["hk"], s["d"]
    kv_bytes = 2 * bs * (ctx + width) * hk * d * dtype.itemsize
    nl = copies(kv_bytes, cap=8)
    names = ["torch", "triton", "triton-nosplit"] + (["flashinfer"] if flashinfer else [])
    sets = {n: attn_setup(n, s, bs, ctx, width, nl, dtype, dev, splits=1 if n == "triton-nosplit" else None)
            for n in names}
    t = bs * width
    gen = torch.Generator(device="cpu").manual_seed(1)
    rope = RotaryEmbedding(d, ctx + width + 8, float(s["theta"]), None, dtype).to(dev)
    qkv = [torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype).to(dev) for _ in range(nl)]
    kernel = "attn decode" if width == 1 else f"attn verify W={width}"
    rows = []

    def layer(n: str) -> Callable[[], Any]:  # one layer's attention work: rotary + K/V store + attention
        a = sets[n]
        rot = Rot(list(range(nl)))
        return lambda: a.backend._forward(i := rot.next(), qkv[i], a.batch.positions, rope, a.batch)

    def store(n: str) -> Callable[[], Any]:
        a = sets[n]
        rot = Rot(list(range(nl)))
        return lambda: a.backend._rope_store(i := rot.next(), qkv[i], a.batch.positions, rope, a.batch)

    extra = {"triton_nosplit": layer("triton-nosplit")}
    if flashinfer:
        extra["flashinfer"] = layer("flashinfer")
    r = _row(kernel, bs, ctx, layer("torch"), layer("triton"), dev, check, floor_bytes=kv_bytes, extra=extra)
    r["kv_splits"] = sets["triton"].backend.num_splits
    rows.append(r)
    if with_store:  # once per batch size: the store does not depend on the context
        rows.append(_row("rope_store", bs, None, store("torch"), store("triton"), dev, check,
                         floor_bytes=t * (2 * hq + 4 * hk) * d * dtype.itemsize))
    return rows


# --- launches per layer ----------------------------------------------------------------------------------
def launches_per_layer(s: dict[str, int], dtype: torch.dtype, dev: torch.device) -> dict[str, float]:
    """CUDA kernels of one decode forward, 2 layers minus 1 layer (bs 8, ctx 512): per-layer launches."""
    from torch.profiler import ProfilerActivity, profile

    from mleagle.engine.kernels import set_fused_layers
    from mleagle.engine.model_loader.dummy import load_dummy
    from mleagle.engine.models.llama import LlamaForCausalLM

    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {}
    for label, backend, fused in (("reference", "torch", False), ("fused", "triton", True)):
        counts = []
        for nl in (1, 2):
            arch = ModelArch(vocab_size=1024, hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=nl,
                             num_attention_heads=s["hq"], num_key_value_heads=s["hk"], head_dim=s["d"],
                             max_position_embeddings=1024, rope_theta=float(s["theta"]))
            model = LlamaForCausalLM(arch, dtype, max_positions=1024)
            model.load_weights(load_dummy(arch, 0, dtype))
            model = model.to(dev).eval()
            a = attn_setup(backend, s, 8, 500, 1, nl, dtype, dev)
            b = dataclasses.replace(a.batch, input_ids=torch.zeros(8, dtype=torch.int64, device=dev))
            b = dataclasses.replace(b, binding=StepBinding(a.pool.name, a.pool, a.r2t, a.backend))
            set_fused_layers(fused)
            with torch.inference_mode():
                for _ in range(2):  # compile and warm up
                    a.backend.plan(b)
                    model(b)
                sync()
                with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                    a.backend.plan(b)
                    model(b)
                    sync()
            # On the CPU (--check) this counts CPU ops: only the plumbing is checked there.
            kind = "CUDA" if cuda else "CPU"
            counts.append(sum(e.count for e in prof.key_averages() if e.device_type.name == kind))
        set_fused_layers(True)
        out[label] = counts[1] - counts[0]
    return out


# --- main --------------------------------------------------------------------------------------------
def fmt(x: Any) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return (f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}") if isinstance(x, float) else str(x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--quick", action="store_true", help="SmolLM2 only, batch 1 and 64, context 512")
    ap.add_argument("--check", action="store_true", help="run each function once and compare outputs (CPU ok)")
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and not a.check:
        ap.error("timing needs CUDA; on the CPU use --check with TRITON_INTERPRET=1")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    fi = dev.type == "cuda" and not a.no_flashinfer and importlib.util.find_spec("flashinfer") is not None
    shapes = ["smollm2-135m"] if a.quick or a.check else list(SHAPES)
    batches = [1, 64] if a.quick else [1, 32, 64] if not a.check else [1, 4]
    ctxs = [512] if a.quick else [512, 2048] if not a.check else [40]
    t0 = time.perf_counter()
    rows: list[dict] = []
    for sn in shapes:
        s = SHAPES[sn]
        for bs in batches:
            for r in bench_layers(s, bs, dtype, dev, a.check):
                rows.append({"shape": sn, **r})
            for ctx in ctxs:
                for w in (1, 4):
                    for r in bench_attention(s, bs, ctx, w, dtype, dev, a.check, fi, w == 1 and ctx == ctxs[0]):
                        rows.append({"shape": sn, **r})
            print(f"{sn} bs {bs} done ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    launches = {sn: launches_per_layer(SHAPES[sn], dtype, dev) for sn in shapes}
    cols = ["shape", "kernel", "bs", "ctx", "torch_us", "triton_us", "triton_graph_us", "triton_nosplit_us",
            "flashinfer_us", "floor_us", "kv_splits"] + (["max_err"] if a.check else [])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")
    unit = "CUDA kernels" if dev.type == "cuda" else "CPU ops (--check: plumbing only)"
    for sn, c in launches.items():
        print(f"{sn}: {unit} per decoder layer (decode, bs 8): reference layers + torch backend {c['reference']}, "
              f"fused layers + Triton {c['fused']}")
    res = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "triton": importlib.import_module("triton").__version__, "dtype": str(dtype), "flashinfer": fi,
           "rows": rows, "launches_per_layer": launches, "elapsed_s": time.perf_counter() - t0,
           "command": "python scripts/bench_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    path = a.out or os.path.join(os.environ.get("OUT", "."), "bench_kernels.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path} ({res['elapsed_s']:.0f}s)", file=sys.stderr)
    if a.check:
        bad = [r for r in rows if any(k.endswith("max_err") and v > 1e-3 for k, v in r.items())]
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
