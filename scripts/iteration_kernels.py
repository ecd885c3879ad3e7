"""The GPU kernels of one batch-1 decode iteration, in order, with their durations and the gaps
between them. Run on a CUDA machine, from the repository root:
`python scripts/iteration_kernels.py DRAFT` (DRAFT: `none` for target-only, or a draft folder).

Profiles one `Engine.generate` of 64 tokens (the first MT-Bench first turn, greedy, `ignore_eos`)
with torch.profiler, cuts the kernel stream at each iteration's result copy (Memcpy DtoH), and prints
the median kernels, span and busy time per iteration over the second half, then one iteration's
kernels: `duration_us gap_us family`.
"""

from __future__ import annotations

import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from mleagle.engine.contract.config import data_dir
from mleagle.engine.entrypoints.bench import read_first_turns
from mleagle.engine.entrypoints.bench_gpu import encode_texts, engine_for, gen_once, kernel_name


def main(draft: str) -> None:
    text = read_first_turns("mt_bench", data_dir(None))[0]
    e = engine_for("smollm2-135m", 1, 64, 512, draft=draft, spec_policy="always")
    p = encode_texts(e, [text])[0]
    gen_once(e, [p], 32)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gen_once(e, [p], 64)
    k = sorted((x for x in prof.events() if x.device_type == torch.autograd.DeviceType.CUDA),
               key=lambda x: x.time_range.start)
    cuts = [i for i, x in enumerate(k) if x.name.startswith("Memcpy DtoH")]
    its = [(cuts[i] + 1, cuts[i + 1] + 1) for i in range(len(cuts) - 1)]
    its = its[len(its) // 2 :]  # steady state
    spans = [k[b - 1].time_range.end - k[a].time_range.start for a, b in its]
    busy = [sum(x.time_range.end - x.time_range.start for x in k[a:b]) for a, b in its]
    print(f"{draft}: {len(its)} iterations; kernels/iter {statistics.median(b - a for a, b in its)}; "
          f"span med {statistics.median(spans):.1f} us; busy med {statistics.median(busy):.1f} us")
    a, b = its[len(its) // 2]
    prev = None
    for x in k[a:b]:
        gap = x.time_range.start - prev if prev is not None else 0.0
        prev = x.time_range.end
        print(f"{x.time_range.end - x.time_range.start:7.2f} {gap:6.2f}  {kernel_name(x.name)[:70]}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "none")
