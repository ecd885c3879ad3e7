"""Column- and row-parallel linear layers, with merged variants for fused QKV and gate/up.

A column-parallel layer holds a slice of the output features and needs no communication; a
row-parallel layer holds a slice of the input features and all-reduces its partial sums (or leaves
them to the caller, which reduce-scatters them in the token-scattered layout). The merged column layer
stores several logical projections (gate|up) in one weight so one GEMM serves them, and knows how to
load each logical part into its shard. `QKVParallelLinear` shards attention by heads: each rank holds
its query heads and the KV heads they read, so with fewer KV heads than ranks a KV head is replicated
on the ranks that share it (vLLM's `num_kv_head_replicas`). Every layer keeps the `TPGroup` it was
built with, so a replicated block (size-1 group) and a sharded one run side by side.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mleagle.engine.distributed import TPGroup, current

SKINNY_MIN_ROWS = {torch.float32: 1}  # other dtypes: 8
# float32 on CPU from this many rows: oneDNN's product with the weight kept a second time in its packed
# layout (`packed`); one and two rows stay with (W @ x^T)^T, the faster there.
PACKED_MIN_ROWS = 3
PACKED_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
# Whether the packed form is used (each engine sets it from `EngineConfig.cpu_packed_linear`).
PACKED = {"on": PACKED_AVAILABLE}


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except on CPU: float32 with 3 rows or more through oneDNN's packed weights (`packed`),
    and otherwise with few rows (1..64 in float32, 8..64 in other dtypes) as (W @ x^T)^T.

    Measured over SmolLM2's 30 layers and 49152×576 head, weights not in cache, two threads on the
    2-core development box (`scripts/bench_cpu_linear.py`; results/cpu_linear/packed_2threads.*,
    results/BENCH_CPU.md, "Packed weights"):

    - float32, the whole model's GEMMs in ms, (W @ x^T)^T against packed: 3 rows 34.7 / 19.5, 4 rows
      35.8 / 23.6, 6 rows 39.3 / 16.6, 8 rows 44.3 / 21.7, 16 rows 65.9 / 29.3, 32 rows 94.3 / 50.2,
      64 rows 138 / 97; F.linear against packed at 128 rows 285 / 171, at 512 rows 877 / 683. At 1-2
      rows the two are level (28-33 ms in that run; (W @ x^T)^T was the faster in others), so one and
      two rows keep it. A verify of S'+1 rows per request and every prefill gain the most.
    - One row through F.linear takes MKL's matrix-vector path, which streams the weight at about half
      the speed of the two-row product. So one row goes in twice.
    - bfloat16: F.linear is faster below 8 rows (two threads: 25 ms against 34 ms at 4 rows), and the
      two are level from 8 to 64.
    """
    if x.dim() == 2 and x.device.type == "cpu":
        m = x.shape[0]
        if x.dtype == torch.float32 and m >= PACKED_MIN_ROWS and PACKED["on"] and not (
                torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed(w), b, "none", [], "")
        if SKINNY_MIN_ROWS.get(x.dtype, 8) <= m <= 64:
            y = left_operand(x, w)
            return y + b if b is not None else y
    return F.linear(x, w, b)


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (`MemAvailable`), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def packed_fits(modules: list[nn.Module], available: int | None, share: float = 0.5) -> tuple[bool, int]:
    """Can the packed copies of `modules`' float32 matrices (made on first use, `packed`) take at most
    `share` of the `available` memory? Counts every 2-D float32 parameter once (an embedding a tied
    head reads included, an untied one counted though never packed: the estimate errs towards off).
    Unknown memory (`available` None) fits. Returns the answer and the bytes counted."""
    seen: set[int] = set()
    n = 0
    for m in modules:
        for p in m.parameters():
            if p.dim() == 2 and p.dtype == torch.float32 and p.device.type == "cpu" and id(p) not in seen:
                seen.add(id(p))
                n += p.numel() * p.element_size()
    return available is None or n <= share * available, n


def packed(w: torch.Tensor) -> torch.Tensor:
    """`w` in oneDNN's packed layout, made on first use and kept on the tensor (made again if `w` was
    written since: its version counter moved). The weight is then held twice; the plain copy serves
    one and two rows, the embedding a tied head shares, training and checkpoints."""
    hit = getattr(w, "_mleagle_packed", None)
    if hit is not None and hit[0] == w._version:
        return hit[1]
    # The batch-size hint picks oneDNN's blocking; 2 to 32 timed alike for 1 to 64 rows on the dev box.
    p = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8)
    w._mleagle_packed = (w._version, p)  # type: ignore[attr-defined]
    return p


def left_operand(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T as (w @ x^T)^T; a single row goes in twice (the two-row product is the faster one)."""
    if x.shape[0] == 1:
        return torch.mm(w, x.repeat(2, 1).t())[:, :1].t().contiguous()
    return torch.mm(w, x.t()).t().contiguous()


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None,
                 tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or current()
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = self.tp.shard(out_features, "out_features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def load(self, w: torch.Tensor, b: torch.Tensor | None = None) -> None:
        r = self.tp.rank
        self.weight.data.copy_(w[r * self.out_per_rank : (r + 1) * self.out_per_rank])
        if self.bias is not None and b is not None:
            self.bias.data.copy_(b[r * self.out_per_rank : (r + 1) * self.out_per_rank])


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one weight; each rank holds its slice of every part."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool = False, dtype: torch.dtype | None = None,
                 tp: TPGroup | None = None):
        super().__init__(in_features, sum(sizes), bias, dtype, tp)
        self.sizes = sizes
        self.sizes_per_rank = [self.tp.shard(s, "merged part") for s in sizes]

    def load_part(self, i: int, w: torch.Tensor, b: torch.Tensor | None = None) -> None:
        r, n = self.tp.rank, self.sizes_per_rank[i]
        off = sum(self.sizes_per_rank[:i])
        self.weight.data[off : off + n].copy_(w[r * n : (r + 1) * n])
        if self.bias is not None and b is not None:
            self.bias.data[off : off + n].copy_(b[r * n : (r + 1) * n])

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.sizes_per_rank, dim=-1)


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads one rank holds: its share, or one replicated head when there are fewer heads than ranks."""
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(f"num_key_value_heads={num_kv_heads} is not divisible by the tensor-parallel size {size}")
        return num_kv_heads // size
    if size % num_kv_heads:
        raise ValueError(f"num_key_value_heads={num_kv_heads} neither divides nor is divisible by the "
                         f"tensor-parallel size {size}")
    return 1


def tp_shape_errors(arch: Any, n: int, what: str = "", fix: bool = True) -> list[str]:
    """Why `arch` (a `ModelArch`) cannot be sharded over n ranks (empty: it can), the last entry ending
    with the fix: the tensor-parallel sizes it does divide into. KV heads may be fewer than the ranks
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
    if errs and fix:
        ok = [str(m) for m in range(1, min(64, arch.num_attention_heads) + 1) if not tp_shape_errors(arch, m, what, False)]
        errs[-1] += f"; use --tp {', '.join(ok[:-1])} or {ok[-1]} (tp_size under [engine])" if len(ok) > 1 else \
            "; run it without tensor parallelism (--tp 1)"
    return errs


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q|k|v, sharded by heads: rank r holds query heads [r·Hq/N, (r+1)·Hq/N) and the KV heads
    they attend with (replicated over N/Hk ranks when Hk < N)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False,
                 dtype: torch.dtype | None = None, tp: TPGroup | None = None):
        g = tp or current()
        self.hq = g.shard(num_heads, "num_attention_heads")
        self.hk = kv_heads_per_rank(num_kv_heads, g.size)
        self.d = head_dim
        # The first KV head this rank holds: its share, or the one its query heads read when replicated.
        self.kv_start = g.rank * self.hk if num_kv_heads >= g.size else g.rank * num_kv_heads // g.size
        nn.Module.__init__(self)
        self.tp = g
        self.in_features, self.out_features = hidden, (num_heads + 2 * num_kv_heads) * head_dim
        self.sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.sizes_per_rank = [self.hq * head_dim, self.hk * head_dim, self.hk * head_dim]
        self.out_per_rank = sum(self.sizes_per_rank)
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, hidden, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank, dtype=dtype), requires_grad=False) if bias else None

    def load_part(self, i: int, w: torch.Tensor, b: torch.Tensor | None = None) -> None:
        n = self.sizes_per_rank[i]
        start = self.tp.rank * n if i == 0 else self.kv_start * self.d
        off = sum(self.sizes_per_rank[:i])
        self.weight.data[off : off + n].copy_(w[start : start + n])
        if self.bias is not None and b is not None:
            self.bias.data[off : off + n].copy_(b[start : start + n])


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None,
                 tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or current()
        self.in_per_rank = self.tp.shard(in_features, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """`reduce=False` returns this rank's partial sums (the caller reduce-scatters them); a bias is
        then the caller's to add, once, after its reduction."""
        y = linear(x, self.weight)
        if not reduce:
            if self.bias is not None and self.tp.size > 1:
                raise NotImplementedError("a row-parallel bias with a caller-side reduction")
            return y if self.bias is None else y + self.bias
        y = self.tp.all_reduce(y)
        # The bias is added once, after the reduction, not once per rank.
        return y + self.bias if self.bias is not None else y

    def load(self, w: torch.Tensor, b: torch.Tensor | None = None) -> None:
        r = self.tp.rank
        self.weight.data.copy_(w[:, r * self.in_per_rank : (r + 1) * self.in_per_rank])
        if self.bias is not None and b is not None:
            self.bias.data.copy_(b)
