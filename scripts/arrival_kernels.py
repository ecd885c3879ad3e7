"""What an arrival costs the device: the kernels of engine steps over a decoding batch, without and with
one new request a step.

`python scripts/arrival_kernels.py [--config smollm2-135m] [--device cuda] [--batch 32] [--prompt 60]
[--steps 24] [--draft none] [--output F.json]`: `batch - 1` requests decode through `Engine.step`
(overlap scheduling, graphs, as a server runs them); after warming both kinds of step, `torch.profiler`
records `--steps` steps of decoding alone, then as many with one `--prompt`-token arrival (one output
token) added before each. It prints, per phase, the device time a step and the kernels by time (self
time a step, calls a step), and the difference a step: what one arrival's prefill adds to the device's
work, whatever the host does meanwhile. Beside the kernels' own time it prints the device's span a
step, its idle time between kernels (gaps under 10 µs: a graph's launches; longer: the device waiting
for the host) and the same steps' wall time unprofiled. On the CPU it records CPU operators instead
(the plumbing, not a figure). Stop 52's H100 run: 893 µs of kernels a decode step of 31 requests,
1,809 with an arrival a step (`results/gpu/stop52/kernels_per_arrival.txt`); stop 56's, with the
fused mixed step: 885 and 1,048 (`results/gpu/stop56/arrival_kernels.txt`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any


def phase(e: Any, steps: int, arrive: Any) -> dict[str, Any]:
    """`steps` engine steps under the profiler (`arrive` before each, or None): device time a step and
    the kernels by self time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = e.device.type == "cuda"
    act = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU

    def run() -> float:
        """`steps` steps from a synchronised device to one; their wall in µs a step."""
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            if arrive is not None:
                arrive()
            e.step()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e6 / steps

    with profile(activities=[act]) as p:
        run()
    evs = [ev for ev in p.key_averages() if (ev.self_device_time_total if cuda else ev.self_cpu_time_total) > 0]

    def own(ev: Any) -> float:
        return float(ev.self_device_time_total if cuda else ev.self_cpu_time_total)

    total = sum(own(ev) for ev in evs)
    rows = sorted(evs, key=lambda ev: -own(ev))
    # The device's span: first kernel's start to last kernel's end, a step (gaps between a graph's
    # kernels included), against the kernels' own time above.
    ks = [ev for ev in p.events() if ev.device_type == torch.autograd.DeviceType.CUDA] if cuda else []
    span = (max(ev.time_range.end for ev in ks) - min(ev.time_range.start for ev in ks)) / steps if ks else 0.0
    # The device idle between kernels, split at 10 µs: a graph's launch gaps are a few µs, longer
    # ones are the device waiting for the host (a step not launched before the one before it ended).
    short = long = 0.0
    end = None
    for ev in sorted(ks, key=lambda ev: ev.time_range.start):
        if end is not None and ev.time_range.start > end:
            gap = ev.time_range.start - end
            if gap > 10:
                long += gap
            else:
                short += gap
        end = ev.time_range.end if end is None else max(end, ev.time_range.end)
    wall = run()  # the same steps unprofiled: what a step costs the loop in all
    return {"us_per_step": total / steps, "span_us_per_step": span, "wall_us_per_step": wall,
            "short_gaps_us_per_step": short / steps, "long_gaps_us_per_step": long / steps,
            "kernels": [{"name": ev.key, "us_per_step": own(ev) / steps, "calls_per_step": ev.count / steps} for ev in rows]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--draft", default="none")
    ap.add_argument("--batch", type=int, default=32, help="requests in a step: batch - 1 decode, and the arrival")
    ap.add_argument("--prompt", type=int, default=60, help="an arrival's prompt tokens")
    ap.add_argument("--steps", type=int, default=24, help="steps profiled per phase")
    ap.add_argument("--top", type=int, default=14, help="kernels printed per phase")
    ap.add_argument("--output", type=Path, default=None)
    a = ap.parse_args()
    import torch

    from mleagle.engine.contract.sampling_params import SamplingParams
    from mleagle.engine.core.engine import Engine

    if a.device == "cuda" and not torch.cuda.is_available():
        print("arrival_kernels: no CUDA device (pass --device cpu for a plumbing run)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    e = Engine(a.config, device=a.device, draft=a.draft, max_running_requests=a.batch + 8,
               max_total_tokens=(a.batch + 8) * (a.prompt + 4 * a.steps + 600))
    rng = random.Random(5)
    vocab = e.arch.vocab_size
    # Long enough to decode through every phase; each arrival ends at its first token.
    long = SamplingParams(max_new_tokens=4 * a.steps + 500, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(a.batch - 1):
        e.add_request(f"d{i}", [rng.randrange(1, vocab) for _ in range(a.prompt)], long)
    n = [0]

    def arrive() -> None:
        n[0] += 1
        e.add_request(f"a{n[0]}", [rng.randrange(1, vocab) for _ in range(a.prompt)], one)

    for _ in range(10):  # the prefill, then steady decoding and the mixed step met before timing
        e.step()
    for _ in range(6):
        arrive()
        e.step()
        e.step()
    alone = phase(e, a.steps, None)
    mixed = phase(e, a.steps, arrive)
    gpu = torch.cuda.get_device_name() if e.device.type == "cuda" else "cpu"
    unit = "CUDA kernels" if e.device.type == "cuda" else "CPU operators"
    print(f"{a.config} ({a.draft} draft) on {gpu}: {a.batch - 1} requests decoding, {a.steps} steps a phase; {unit}")
    for name, ph in (("decoding alone", alone), (f"one {a.prompt}-token arrival a step", mixed)):
        print(f"== {name}: {ph['us_per_step']:.0f} us of kernels a step, device span {ph['span_us_per_step']:.0f} us, "
              f"wall {ph['wall_us_per_step']:.0f} us unprofiled; device idle between kernels: "
              f"{ph['short_gaps_us_per_step']:.0f} us in gaps under 10 us, {ph['long_gaps_us_per_step']:.0f} us in longer ones")
        for k in ph["kernels"][: a.top]:
            print(f"  {k['us_per_step']:8.1f} us  {k['calls_per_step']:6.1f}/step  {k['name'][:90]}")
    extra = mixed["us_per_step"] - alone["us_per_step"]
    print(f"an arrival adds {extra:.0f} us a step ({mixed['us_per_step'] / max(alone['us_per_step'], 1e-9):.2f}x)")
    if a.output:
        a.output.write_text(json.dumps({"config": a.config, "draft": a.draft, "device": gpu, "batch": a.batch,
                                        "prompt": a.prompt, "steps": a.steps, "unit": unit, "alone": alone,
                                        "with_arrivals": mixed, "arrival_us_per_step": extra}, indent=1))
        print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
