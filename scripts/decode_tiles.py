"""What a decode batch's spread of lengths costs attention, and which launch shape of the decode kernel
pays least: `python scripts/decode_tiles.py [--config smollm2-135m] [--batch-sizes 32,64] [--width 1]
[--tiles 64x4x2x1,128x8x2x1,...] [--output F.json]`.

A decode kernel program attends one request's keys (per KV head, per KV split), so with few splits a
batch's attention takes as long as its longest request, and a served batch, whose requests are at
every point of their lives, holds longer ones than a static batch that started together. The lengths
are real: MT-Bench first turns' prompt and greedy output lengths for SmolLM2
(`results/mt_bench_lengths.json`). Two mixes per batch size bs:

- `static`: the first bs prompts, each running 256 tokens (what `bench gpu`'s static batch attends),
  at 16 points of their run;
- `served`: 16 snapshots of a closed loop at concurrency bs (the prompts in `bench serve`'s order, each
  request leaving after its natural length and the next taking its slot), from its steady part.

Per tile (`BLOCK_N x WARPS x STAGES x SPLITS`) and mix, one CUDA graph holds the model's layers'
`decode_attention` calls (each layer its own K/V; every request's slots scattered over the pool as a
served pool's are), and is replayed per snapshot after the snapshot's lengths are copied into its
buffers: µs a layer, mean over the snapshots; beside it the floor (the K/V bytes read over the copy
bandwidth measured in the same run) and, per snapshot, the largest difference from the first listed
tile's output (the tiles must agree; the default list starts with the earlier shape, 64x4x2x1). Prints a table per batch size and writes JSON. `--check` runs the same
on the CPU under `TRITON_INTERPRET=1` with two layers and no graphs: the plumbing and the agreement,
no figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"smollm2-135m": dict(hq=9, hk=3, d=64, layers=30), "llama3-8b": dict(hq=32, hk=8, d=128, layers=32)}
DEFAULT_TILES = ("64x4x2x1,32x4x2x1,128x4x2x1,128x8x2x1,128x4x3x1,256x4x1x1,256x8x2x1,"
                 "64x4x2x2,128x4x2x2,128x8x2x2,256x8x2x2,128x4x2x4")
STEPS = 16


def snapshots(bs: int, lengths: dict[str, Any], max_new: int = 256, seed: int = 0) -> dict[str, list[list[int]]]:
    """Per mix, STEPS batches of bs context lengths (keys already cached, the new token's excluded)."""
    p, out_len = lengths["prompt_tokens"], lengths["output_tokens"]
    first = [p[i % len(p)] for i in range(bs)]
    static = [[x + t for x in first] for t in range(max_new // (2 * STEPS), max_new, max_new // STEPS)]
    order = list(range(len(p)))
    random.Random(seed).shuffle(order)  # `bench serve`'s order (load_prompts, seed 0)
    queue = [order[i % len(order)] for i in range(16 * bs)]
    active: list[list[int]] = []
    trace = []
    while queue or active:
        while len(active) < bs and queue:
            j = queue.pop(0)
            active.append([p[j], out_len[j]])
        if len(active) == bs:
            trace.append([a[0] for a in active])
        for a in active:
            a[0] += 1
            a[1] -= 1
        active = [a for a in active if a[1] > 0]
    lo, hi = len(trace) // 4, 3 * len(trace) // 4  # the steady part: after the first waves, before the drain
    served = [trace[lo + i * (hi - lo) // STEPS] for i in range(STEPS)]
    return {"static": static, "served": served}


def parse_tiles(spec: str) -> list[tuple[int, int, int, int]]:
    out = []
    for t in spec.split(","):
        parts = [int(x) for x in t.strip().split("x")]
        if len(parts) != 4:
            raise SystemExit(f"tile {t!r}: want BLOCK_NxWARPSxSTAGESxSPLITS")
        out.append((parts[0], parts[1], parts[2], parts[3]))
    return out


@dataclass
class Bufs:
    """One batch size's fixed buffers: every graph reads them, every snapshot is copied into them."""

    bs: int
    w: int
    hq: int
    kv: Any  # [layers, 2, slots, hk, d]
    r2t: Any
    rpi: Any
    seq: Any
    pos: Any
    loc: Any
    qkv: Any
    rope: Any
    outs: dict[tuple[int, int, int, int], Any]

    def set_batch(self, ctx: list[int]) -> None:
        """The snapshot's lengths, and each window's positions and slots."""
        import torch

        c = torch.tensor(ctx, dtype=torch.int64)
        p = (c[:, None] + torch.arange(self.w)[None, :]).reshape(-1)
        self.seq.copy_(c + self.w)
        self.pos.copy_(p)
        self.loc.copy_(self.r2t.cpu()[torch.arange(1, self.bs + 1).repeat_interleave(self.w), p])

    def layers_call(self, t: tuple[int, int, int, int]) -> None:
        """Every layer's decode attention with tile `t`, into its own output buffer."""
        from mleagle.engine.kernels.attention import DecodeTile, decode_attention

        tile = DecodeTile(t[0], t[1], t[2])
        d = self.kv.shape[-1]
        for i in range(self.kv.shape[0]):
            decode_attention(self.qkv, self.pos, self.rope.cos, self.rope.sin, self.loc, self.kv[i, 0], self.kv[i, 1],
                             self.r2t, self.rpi, self.seq, self.hq, self.w, t[3], d**-0.5, out=self.outs[t], tile=tile)


def make_bufs(bs: int, w: int, s: dict[str, int], layers: int, cap: int, tiles: list[tuple[int, int, int, int]],
              dtype: Any, dev: Any, gen: Any) -> Bufs:
    import torch

    from mleagle.engine.layers.rope import RotaryEmbedding

    hq, hk, d = s["hq"], s["hk"], s["d"]
    slots = bs * cap + 1
    r2t = torch.zeros(bs + 1, cap, dtype=torch.int64)
    perm = torch.randperm(slots - 1, generator=gen) + 1  # slot 0 is the pad slot
    for r in range(bs):
        r2t[r + 1] = perm[r * cap : (r + 1) * cap]
    return Bufs(bs, w, hq, torch.randn(layers, 2, slots, hk, d, generator=gen).to(dtype).to(dev), r2t.to(dev),
                torch.arange(1, bs + 1, device=dev), torch.zeros(bs, dtype=torch.int64, device=dev),
                torch.zeros(bs * w, dtype=torch.int64, device=dev), torch.zeros(bs * w, dtype=torch.int64, device=dev),
                torch.randn(bs * w, (hq + 2 * hk) * d, generator=gen).to(dtype).to(dev),
                RotaryEmbedding(d, cap + 8, 1e5, None, dtype).to(dev),
                {t: torch.empty(bs * w, hq, d, dtype=dtype, device=dev) for t in tiles})


def time_mix(b: Bufs, tiles: list[tuple[int, int, int, int]], batches: list[list[int]], replays: int,
             check: bool) -> tuple[dict[Any, list[float]], dict[Any, float]]:
    """µs a layer per tile per batch (one graph per tile, replayed per batch), and each tile's largest
    difference from the first tile's output."""
    import torch

    graphs = {}
    b.set_batch(batches[0])
    for t in tiles:
        b.layers_call(t)  # compile and warm
        if not check:
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                b.layers_call(t)
            graphs[t] = g
    layers = b.kv.shape[0]
    us: dict[Any, list[float]] = {t: [] for t in tiles}
    diff = {t: 0.0 for t in tiles}
    for ctx in batches:
        b.set_batch(ctx)
        for t in tiles:
            if check:
                t0 = time.perf_counter()
                b.layers_call(t)
                us[t].append((time.perf_counter() - t0) * 1e6 / layers)
                continue
            graphs[t].replay()
            s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s0.record()
            for _ in range(replays):
                graphs[t].replay()
            s1.record()
            s1.synchronize()
            us[t].append(s0.elapsed_time(s1) * 1e3 / (replays * layers))
        ref = b.outs[tiles[0]].float()
        for t in tiles:
            diff[t] = max(diff[t], (b.outs[t].float() - ref).abs().max().item())
    return us, diff


def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from mleagle.engine.entrypoints.bench_gpu import copy_bandwidth, machine

    dev = torch.device("cpu" if a.check else "cuda")
    dtype = torch.float32 if a.check else torch.bfloat16
    s = SHAPES[a.config]
    layers = 2 if a.check else s["layers"]
    w = a.width
    lengths = json.loads((ROOT / "results" / "mt_bench_lengths.json").read_text())
    tiles = parse_tiles(a.tiles)
    bw = None if a.check else copy_bandwidth()
    res: dict[str, Any] = {"machine": machine(), "config": a.config, "width": w, "layers": layers,
                           "dtype": str(dtype).removeprefix("torch."), "copy_bandwidth_gbs": bw and round(bw / 1e9, 1),
                           "tiles": [list(t) for t in tiles], "rows": []}
    gen = torch.Generator().manual_seed(0)
    for bs in [int(x) for x in a.batch_sizes.split(",")]:
        mixes = snapshots(bs, lengths)
        if a.check:
            mixes = {k: [[min(x, 90) for x in b] for b in v[:2]] for k, v in mixes.items()}
        cap = max(max(b) for v in mixes.values() for b in v) + w + 1
        b = make_bufs(bs, w, s, layers, cap, tiles, dtype, dev, gen)
        for mix, batches in mixes.items():
            us, diff = time_mix(b, tiles, batches, a.replays, a.check)
            kv_bytes = [2 * (sum(ctx) + bs * w) * s["hk"] * s["d"] * dtype.itemsize for ctx in batches]
            for t in tiles:
                res["rows"].append({"bs": bs, "mix": mix, "tile": "x".join(map(str, t)),
                                    "us_per_layer": round(statistics.mean(us[t]), 3),
                                    "us_per_layer_min_max": [round(min(us[t]), 3), round(max(us[t]), 3)],
                                    "floor_us_per_layer": round(statistics.mean(kv_bytes) / bw * 1e6, 3) if bw else None,
                                    "mean_ctx": round(statistics.mean(statistics.mean(c) for c in batches), 1),
                                    "mean_max_ctx": round(statistics.mean(max(c) for c in batches), 1),
                                    "max_diff_from_first": diff[t]})
        del b
    return res


def table(res: dict[str, Any]) -> str:
    lines = []
    for bs in sorted({r["bs"] for r in res["rows"]}):
        rows = [r for r in res["rows"] if r["bs"] == bs]
        mixes = sorted({r["mix"] for r in rows})
        first = {m: next(r for r in rows if r["mix"] == m) for m in mixes}
        ctx = "; ".join(f"{m}: mean context {r['mean_ctx']:.0f}, longest {r['mean_max_ctx']:.0f}" for m, r in first.items())
        lines += ["", f"bs {bs}, width {res['width']} ({ctx}); µs a layer, mean over the mix's batches",
                  "| tile (BLOCK_N x warps x stages x splits) | " + " | ".join(mixes) + " | served / static | max diff |",
                  "|---|" + "---:|" * (len(mixes) + 2)]
        by = {(r["tile"], r["mix"]): r for r in rows}
        for t in dict.fromkeys(r["tile"] for r in rows):
            v = [by[(t, m)]["us_per_layer"] for m in mixes]
            ratio = (by[(t, "served")]["us_per_layer"] / by[(t, "static")]["us_per_layer"]
                     if (t, "served") in by and (t, "static") in by else float("nan"))
            dmax = max(by[(t, m)]["max_diff_from_first"] for m in mixes)
            lines.append(f"| {t} | " + " | ".join(f"{x:.2f}" for x in v) + f" | {ratio:.2f} | {dmax:.2g} |")
        fl = [first[m]["floor_us_per_layer"] for m in mixes]
        lines.append("| floor (K/V bytes / copy bandwidth) | " + " | ".join("-" if x is None else f"{x:.2f}" for x in fl)
                     + " | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--batch-sizes", default="32,64")
    ap.add_argument("--width", type=int, default=1, help="rows a request (1: decode; the verify width otherwise)")
    ap.add_argument("--tiles", default=DEFAULT_TILES, help="comma-separated BLOCK_NxWARPSxSTAGESxSPLITS; the first "
                    "is the reference the others' outputs are compared with")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--check", action="store_true", help="CPU under TRITON_INTERPRET=1: plumbing and agreement only")
    ap.add_argument("--output", default=None)
    a = ap.parse_args(argv)
    if a.check and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--check runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    res = run(a)
    bw = f"; copy bandwidth {res['copy_bandwidth_gbs']} GB/s" if res["copy_bandwidth_gbs"] else ""
    print(f"{a.config} on {res['machine'].get('gpu', 'the CPU (interpreter)')}{bw}" + table(res))
    if a.output:
        Path(a.output).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {a.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
