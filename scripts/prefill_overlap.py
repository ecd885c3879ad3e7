"""Could an arrival's prefill run beside the decode iteration instead of after it? Device time of raw
CUDA-graph replays, alone, one after the other on one stream, and on two streams at once.

`python scripts/prefill_overlap.py [--config smollm2-135m] [--batch 32] [--prompt 60] [--rounds 3]
[--iters 200] [--output F.json]` (CUDA only): `batch` requests decode through `Engine.step` until the
whole-iteration graph of that bucket runs, then the script replays that graph and a target prefill
graph of the prompt's token bucket holding one `prompt`-token request, with no host work between
replays but the launches: `decode` alone, `prefill` alone, `one stream` (decode then prefill, as a
mixed step queues them today) and `two streams` (each pair on two streams at once, the pairs in turn).
The prefill graph is captured here in a memory pool of its own: graphs of one pool may share their
intermediate buffers, so the engine's own prefill and iteration graphs cannot run at once (tried: an
illegal memory access). Before every replay the decoding rows' KV lengths are put back, so each
timing sees the same batch (each replay otherwise advances them). Rounds alternate the four; it prints
a table (median over the rounds, min-max) and writes JSON. The saving `one stream` - `two streams` is
what a side-stream prefill could take off an arrival's device cost; it would also need its own pool,
the KV pages and request slots a finished request frees kept from reuse until the iterations in
flight that may still touch them have ended, and the next iteration ordered after the prefill. Stop
53's H100 run (`results/gpu/stop53/prefill_overlap.log`, three rounds): decode 911 µs, prefill 1,057,
one stream 1,963, two streams 1,213.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--output", default="prefill_overlap.json")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("prefill_overlap: needs CUDA (it times CUDA-graph replays)")
    from mleagle.engine.contract.sampling_params import SamplingParams
    from mleagle.engine.core.engine import Engine
    from mleagle.engine.executor.extend_graph import ExtendGraphRunner

    e = Engine(a.config, device="cuda", draft="none")
    sp = SamplingParams(temperature=0, max_new_tokens=1000, ignore_eos=True)
    for i in range(a.batch):
        e.add_request(f"r{i}", [(7 * i + j) % 5000 + 10 for j in range(40)], sp)
    for _ in range(20):
        e.step()
    torch.cuda.synchronize()
    w = e.worker
    it = w.iter_graph
    if it is None or it.bucket(a.batch) not in it.caps:
        sys.exit(f"prefill_overlap: no whole-iteration graph for batch {a.batch} ({e.graph_report})")
    dec = it.caps[it.bucket(a.batch)].graph
    g0 = e.target.extend_graphs
    assert isinstance(g0, ExtendGraphRunner), e.graph_report
    t = g0.bucket(a.prompt, 1)
    assert t is not None, f"no prefill bucket holds {a.prompt} tokens"
    g = ExtendGraphRunner(e.target, buckets=[t], max_reqs=g0.max_reqs, hidden_size=0, dtype=e.dtype,
                          pool=torch.cuda.graph_pool_handle())
    g.capture()
    req = e.scheduler.running[0]
    assert e.mem.ensure(req, req.kv_len + 64 + a.prompt)
    # One request's prompt beyond its decoding positions (its KV there is the prefill's own to write).
    assert g.stage(list(range(100, 100 + a.prompt)), [req.req_pool_idx], [req.kv_len + 64], [a.prompt]) is not None
    pre = g.caps[t].graph
    assert dec is not None and pre is not None
    kv = w.state.kv_len.clone()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def reset() -> None:
        w.state.kv_len.copy_(kv)

    def decode() -> None:
        reset()
        dec.replay()

    def prefill() -> None:
        reset()
        pre.replay()

    def one_stream() -> None:
        reset()
        dec.replay()
        pre.replay()

    def two_streams() -> None:
        reset()
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            dec.replay()
        with torch.cuda.stream(s2):
            pre.replay()
        cur.wait_stream(s1)
        cur.wait_stream(s2)

    def timeit(f: Any) -> float:
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            f()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / a.iters * 1e6

    cases = {"decode": decode, "prefill": prefill, "one stream": one_stream, "two streams": two_streams}
    got: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.rounds):
        for k, f in cases.items():
            got[k].append(timeit(f))
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"{torch.cuda.get_device_name()}, {a.config} {e.dtype}, batch {a.batch}, prompt {a.prompt} (bucket {t}); "
          f"us a replay (pair), median of {a.rounds} rounds of {a.iters} (min-max)")
    for k, v in got.items():
        print(f"  {k:12s} {med[k]:8.1f} ({min(v):.1f}-{max(v):.1f})")
    print(f"  two streams save {med['one stream'] - med['two streams']:.1f} us a pair "
          f"({(med['one stream'] - med['two streams']) / med['prefill']:.0%} of the prefill alone)")
    res = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "config": a.config,
           "batch": a.batch, "prompt": a.prompt, "bucket": t, "iters": a.iters, "us": got, "median_us": med}
    Path(a.output).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
