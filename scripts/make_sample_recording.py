"""Write a synthetic but schema-faithful event recording (tests/data/events_sample.jsonl by default).

It simulates a CPU engine with S=2 draft layers (runners target, draft0, draft1) serving six requests
that arrive over time: per request a queued→running→finished lifecycle with token deltas and logprobs;
per step a prefill (EXTEND) or a speculative iteration (TARGET_VERIFY then DRAFT_EXTEND per layer) with
its batch, logprob-metadata, acceptance and pool events; a status event about once a second. One
logprob-metadata event is a deliberate mismatch (agree=False, noted in the header) so the TUI's
highlight has something to show. Deterministic (fixed seed and clock), so the TUI snapshots are stable.
A recording from a real engine run can replace this file: the loader only needs the schema.

    python scripts/make_sample_recording.py [OUT] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from mleagle.engine.contract.events import (
    AcceptanceEvent,
    BatchEvent,
    EngineEvent,
    GraphEvent,
    LogprobMetaEvent,
    PoolEvent,
    RequestEvent,
    SnapshotEvent,
    TokenEvent,
    TopToken,
    write_recording,
)

S = 2
W = S + 1
RUNNERS = ["target"] + [f"draft{k}" for k in range(S)]
KV_TOTAL, REQ_TOTAL = 256, 8
T0 = 1_700_000_000.0
WORDS = [" the", " a", " model", " token", " is", " fast", " draft", " layer", " pool", " KV", " cache", ",",
         ".", " and", " of", " to", " verify", " accepted", " speculative", " decoding", " runs", " each", "\n"]
MISMATCH_STEP = 23


def build(seed: int = 0) -> tuple[list, dict[str, object]]:
    rng = random.Random(seed)
    t = T0
    evs: list = []

    def add(e) -> None:
        e.ts = round(t, 6)
        if isinstance(e, SnapshotEvent):  # nested events too, so the file is byte-for-byte reproducible
            for x in [e.engine, *e.pools, *e.graphs]:
                x.ts = e.ts
        evs.append(e)

    add(SnapshotEvent(engine=EngineEvent(model="smollm2-135m", draft="mtp-s2", spec_steps=S, uptime_s=0.0),
                      pools=[PoolEvent(runner=r, kv_used=0, kv_total=KV_TOTAL, req_used=0, req_total=REQ_TOTAL)
                             for r in RUNNERS],
                      graphs=[GraphEvent(runner=r) for r in RUNNERS]))
    arrivals = {0: ("r0", 14, 24), 2: ("r1", 31, 18), 5: ("r2", 9, 30), 9: ("r3", 52, 12), 14: ("r4", 20, 26),
                26: ("r5", 11, 16)}
    waiting: list[tuple[str, int, int]] = []
    running: dict[str, dict] = {}
    eager = {r: 0 for r in RUNNERS}
    gen_total = prompt_total = finished_total = 0
    last_status, last_gen, acc_sum, acc_n = T0, 0, 0, 0
    step = 0
    while step < 200 and (step <= max(arrivals) or waiting or running):
        if step in arrivals:
            rid, plen, olen = arrivals[step]
            waiting.append((rid, plen, olen))
            add(RequestEvent(rid=rid, state="queued", prompt_tokens=plen))
        if waiting:  # prefill everything waiting in one EXTEND step
            batch = waiting[:]
            waiting.clear()
            rids = [b[0] for b in batch]
            lens = [b[1] for b in batch]
            for rid, plen, olen in batch:
                running[rid] = {"plen": plen, "olen": olen, "out": 0, "acc": [], "seq": plen}
                add(RequestEvent(rid=rid, state="running", prompt_tokens=plen))
            dur = 0.004 * sum(lens) / 10 + 0.01
            for r in RUNNERS:
                add(BatchEvent(step=step, mode="EXTEND" if r == "target" else "DRAFT_EXTEND", runner=r, rids=rids,
                               num_tokens_per_req=lens, num_tokens=sum(lens), bs=len(rids), padded_bs=len(rids),
                               graph="eager", eager_reason="cpu", duration_s=round(dur if r == "target" else dur / 8, 6),
                               num_running=len(running), num_waiting=0))
                # prefill keeps only each request's last row for sampling
                add(LogprobMetaEvent.build(runner=r, mode="EXTEND" if r == "target" else "DRAFT_EXTEND", step=step,
                                           bs=len(rids), width=1, logit_rows=len(rids), expected_rows=len(rids),
                                           global_num_tokens=[sum(lens)], global_num_tokens_for_logprob=[len(rids)]))
                eager[r] += 1
            prompt_total += sum(lens)
            t += dur * 1.3
        elif running:  # one speculative iteration over all running requests
            rids = list(running)
            bs = len(rids)
            verify = round(0.012 + 0.0015 * bs * W + rng.uniform(0, 0.002), 6)
            per_layer = [round(0.0025 + 0.0004 * bs * W + rng.uniform(0, 0.0005), 6) for _ in range(S)]
            add(BatchEvent(step=step, mode="TARGET_VERIFY", rids=rids, num_tokens_per_req=[W] * bs,
                           num_tokens=bs * W, bs=bs, padded_bs=bs, graph="eager", eager_reason="cpu",
                           duration_s=verify, num_running=bs, num_waiting=len(waiting)))
            rows = bs * W
            bad = step == MISMATCH_STEP
            add(LogprobMetaEvent(runner="target", mode="TARGET_VERIFY", step=step, bs=bs, width=W, logit_rows=rows,
                                 expected_rows=rows, global_num_tokens=[rows],
                                 global_num_tokens_for_logprob=[bs if bad else rows], agree=not bad))
            eager["target"] += 1
            accept_lens = []
            for rid in rids:
                st = running[rid]
                n_acc = 0
                for j in range(S):  # chain: depth j only if all shallower drafts were accepted
                    if rng.random() < (0.8 if j == 0 else 0.6):
                        n_acc += 1
                    else:
                        break
                al = min(n_acc + 1, st["olen"] - st["out"])
                accept_lens.append(al)
                st["acc"].append(al)
            per_depth = [sum(1 for a in accept_lens if a - 1 > j) for j in range(S)]
            add(AcceptanceEvent(step=step, S=S, bs=bs, accepted_per_depth=per_depth, accept_lens=accept_lens,
                                rids=rids, draft_time_s=round(sum(per_layer), 6), verify_time_s=verify,
                                draft_time_per_layer_s=per_layer))
            acc_sum += sum(accept_lens)
            acc_n += bs
            for k in range(S):
                r = f"draft{k}"
                add(BatchEvent(step=step, mode="DRAFT_EXTEND", runner=r, rids=rids, num_tokens_per_req=[W] * bs,
                               num_tokens=bs * W, bs=bs, padded_bs=bs, graph="eager", eager_reason="cpu",
                               duration_s=per_layer[k], num_running=bs, num_waiting=len(waiting)))
                add(LogprobMetaEvent.build(runner=r, mode="DRAFT_EXTEND", step=step, bs=bs, width=W, logit_rows=rows,
                                           expected_rows=rows, global_num_tokens=[rows],
                                           global_num_tokens_for_logprob=[rows]))
                eager[r] += 1
            t += verify + sum(per_layer) + 0.002
            for rid, al in zip(rids, accept_lens):
                st = running[rid]
                toks = []
                for d in range(al):
                    tid = rng.randrange(len(WORDS))
                    lp = round(-rng.expovariate(3.0), 4)
                    alts = sorted({rng.randrange(len(WORDS)) for _ in range(3)} - {tid})[:2]
                    top = [TopToken(token_id=tid, text=WORDS[tid], logprob=lp)] + [
                        TopToken(token_id=a, text=WORDS[a], logprob=round(lp - 0.5 - i - rng.random(), 4))
                        for i, a in enumerate(alts)]
                    toks.append(TokenEvent(token_id=tid, text=WORDS[tid], logprob=lp, top=top,
                                           depth=d + 1 if d < al - 1 else 0))
                st["out"] += al
                st["seq"] += al
                gen_total += al
                mean = round(sum(st["acc"]) / len(st["acc"]), 4)
                done = st["out"] >= st["olen"]
                add(RequestEvent(rid=rid, state="finished" if done else "running", finish_reason="length" if done else None,
                                 prompt_tokens=st["plen"], output_tokens=st["out"], tokens=toks, accept_len=mean))
                if done:
                    finished_total += 1
                    del running[rid]
        used = sum(st["seq"] for st in running.values())
        for r in RUNNERS:
            add(PoolEvent(runner=r, kv_used=used, kv_total=KV_TOTAL, req_used=len(running), req_total=REQ_TOTAL,
                          step=step))
        if step % 6 == 5 or not (waiting or running or step < max(arrivals)):
            for r in RUNNERS:
                add(GraphEvent(runner=r, enabled=False, eager={"cpu": eager[r]}))
        if t - last_status >= 0.25 or not (waiting or running or step < max(arrivals)):
            dt = t - last_status
            add(EngineEvent(model="smollm2-135m", draft="mtp-s2", spec_steps=S, uptime_s=round(t - T0, 3),
                            num_running=len(running), num_waiting=len(waiting), prompt_tokens_total=prompt_total,
                            gen_tokens_total=gen_total, requests_finished_total=finished_total,
                            gen_tokens_per_s=round((gen_total - last_gen) / dt, 2),
                            mean_accept_len=round(acc_sum / acc_n, 4) if acc_n else None, steps_total=step + 1))
            last_status, last_gen, acc_sum, acc_n = t, gen_total, 0, 0
        step += 1
        t += 0.001
    meta = {"synthetic": True, "seed": seed, "spec_steps": S, "injected_mismatch_step": MISMATCH_STEP,
            "note": "generated by scripts/make_sample_recording.py; replace with a real engine recording"}
    return evs, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=str(Path(__file__).resolve().parent.parent / "tests" / "data" /
                                                  "events_sample.jsonl"))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    evs, meta = build(a.seed)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    n = write_recording(a.out, evs, source="synthetic", meta=meta, created=T0)
    print(f"wrote {n} events to {a.out}")


if __name__ == "__main__":
    main()
