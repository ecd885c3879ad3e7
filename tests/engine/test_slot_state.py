"""The per-slot decode state (`SlotState`): admission fills a request's row (and its host mirrors, which
give the batch flags without a device read); a commit advances exactly the live rows and never the pad
row; the greedy accept and draft step (the torch references the CUDA kernels are tested against) count
accepted drafts, emit, pick logit rows and rotate id windows as the speculative iteration needs; the
draft distributions appear only once a sampled request speculates; penalties under speculation see the
output plus each row's preceding drafts."""

from __future__ import annotations

import torch

from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.request import Req
from mleagle.engine.executor.slot_state import PLAIN, SlotState, accepted, rotate

V, S = 32, 3


def _req(row: int, **kw: object) -> Req:
    r = Req(f"r{row}", [1, 2, 3], SamplingParams(**kw), seed=7 + row)  # type: ignore[arg-type]
    r.req_pool_idx = row
    return r


def _state(max_reqs: int = 4) -> SlotState:
    return SlotState(max_reqs, V, S, torch.device("cpu"), eos_ids=[0])


def test_admission_fills_rows_and_host_flags() -> None:
    st = _state()
    a, b = _req(0, temperature=0.0), _req(2, temperature=0.8, top_p=0.5, logprobs=3, repetition_penalty=1.2)
    st.admit([a, b])
    assert st.greedy[[0, 2]].tolist() == [True, False] and abs(float(st.temperature[2]) - 0.8) < 1e-6
    assert st.seed[[0, 2]].tolist() == [7, 9]
    f = st.flags([0])
    assert f.plain and f.logprobs == -1
    f = st.flags([0, 2])
    assert not f.all_greedy and f.filters and f.penalties and f.logprobs == 3
    assert st.counts is not None and bool(st.prompt_seen[2, 1]) and not bool(st.prompt_seen[0].any())  # type: ignore[index]
    assert st.draft_q is not None  # a sampled request under speculation needs draft distributions


def test_admission_writes_every_field_exactly() -> None:
    """Admission's one copy of every field's bytes (split on the device by dtype) lands each value in its
    field and row: float32 parameters, 64-bit seeds beyond 2^53, counts, bools, a resumed request's last
    token; the rows not admitted keep theirs."""
    st = _state(6)
    a = _req(1, temperature=0.7, top_p=0.9, min_p=0.05, top_k=5, repetition_penalty=1.3, presence_penalty=0.4,
             frequency_penalty=-0.2, min_new_tokens=3, seed=11)
    b = _req(3, temperature=0.0, top_k=V + 9)
    b.seed = 2**62 + 3
    b.output_ids = [8, 21]  # resumed after a preemption: its last output is its next input
    before = {f: getattr(st, f)[[0, 2]].clone() for f in ("temperature", "top_k", "seed", "greedy", "n_out")}
    st.admit([a, b])
    assert st.temperature[[1, 3]].tolist() == [torch.tensor(0.7).item(), 1.0]
    assert st.top_p[[1, 3]].tolist() == [torch.tensor(0.9).item(), 1.0]
    assert st.min_p[1].item() == torch.tensor(0.05).item() and st.rep[1].item() == torch.tensor(1.3).item()
    assert st.pres[1].item() == torch.tensor(0.4).item() and st.freq[1].item() == torch.tensor(-0.2).item()
    assert st.top_k[[1, 3]].tolist() == [5, V] and st.seed[[1, 3]].tolist() == [a.seed, 2**62 + 3]
    assert st.min_new[[1, 3]].tolist() == [3, 0] and st.n_out[[1, 3]].tolist() == [0, 2]
    assert st.iters[[1, 3]].tolist() == [0, 0] and st.last_tok[[1, 3]].tolist() == [0, 21]
    assert st.greedy[[1, 3]].tolist() == [False, True] and st.coupled[[1, 3]].tolist() == [True, False]
    for f, v in before.items():
        assert torch.equal(getattr(st, f)[[0, 2]], v), f


def test_first_token_commit_equals_the_general_commit() -> None:
    """`commit_first` (a prefill's first tokens in two writes) leaves the state exactly as `commit` of one
    token per row without KV does, penalty counts included."""
    import dataclasses

    reqs = [_req(0, temperature=0.0), _req(2, temperature=0.9, repetition_penalty=1.2), _req(3, temperature=0.0)]
    a, b = _state(), _state()
    for st in (a, b):
        st.admit(reqs)
        st.kv_len[[0, 2, 3]] = torch.tensor([3, 3, 3])
    rpi, tok = torch.tensor([0, 2, 3]), torch.tensor([7, 30, 7])
    flags = dataclasses.replace(a.flags([0, 2, 3]), penalties=True)
    a.commit_first(rpi, tok, flags)
    b.commit(rpi, tok.view(-1, 1), torch.ones_like(tok), flags, kv=False)
    for f in ("last_tok", "n_out", "kv_len", "iters", "counts"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert a.n_out[[0, 2, 3]].tolist() == [1, 1, 1] and int(a.counts[2, 30]) == 1  # type: ignore[index]


def test_the_state_mirrors_every_request_after_each_step() -> None:
    """In a real engine (a tiny random model, target-only and with two draft layers), after every step the
    slot row of each request that has emitted tokens holds its count, its last token (the next input) and
    its KV length, and a penalized request's output counts are its tokens': what the prefill's first
    token and every iteration's commit must keep. (Without overlap scheduling, which on a GPU leaves an
    iteration in flight whose commit the host has not read yet; `test_overlap.py` checks that path's
    output.)"""
    from tests.spec_helpers import tiny_engine

    for draft in ("none", "random:2"):
        e = tiny_engine(draft, overlap_schedule=False)
        st = e.worker.state
        params = [SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True),
                  SamplingParams(temperature=0.8, seed=3, max_new_tokens=12, ignore_eos=True, repetition_penalty=1.3),
                  SamplingParams(temperature=0.0, max_new_tokens=7, ignore_eos=True, presence_penalty=0.5),
                  SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True, min_new_tokens=4)]
        for i, p in enumerate(params):
            e.add_request(f"{draft}-{i}", [(i * 7 + j) % 200 + 1 for j in range(5 + 6 * i)], p)
        steps = 0
        while e.has_work():
            e.step()
            steps += 1
            for r in e.scheduler.running:
                if not r.output_ids:
                    continue
                row = r.req_pool_idx
                assert int(st.n_out[row]) == len(r.output_ids), (draft, steps, r.rid)
                assert int(st.last_tok[row]) == r.output_ids[-1], (draft, steps, r.rid)
                assert int(st.kv_len[row]) == r.kv_len, (draft, steps, r.rid)
                if r.params.has_penalties:
                    assert st.counts is not None
                    want = torch.bincount(torch.tensor(r.output_ids), minlength=st.vocab).to(torch.int32)
                    assert torch.equal(st.counts[row], want), (draft, steps, r.rid)
        assert steps > 4


def test_batch_flags_follow_a_row_readmitted_with_other_params() -> None:
    """The flags of a batch are reused while its rows stay (most decode steps); a row given to another
    request with other parameters must change them, and a minimum reached turns the bans off."""
    st = _state()
    st.admit([_req(0, temperature=0.0), _req(1, temperature=0.0)])
    assert st.flags([0, 1]).plain and st.flags([0, 1]) is st.flags([0, 1])
    st.admit([_req(1, temperature=0.7, logprobs=2)])  # row 1 freed and taken by a sampled request
    f = st.flags([0, 1])
    assert not f.all_greedy and f.logprobs == 2
    m = _req(2, temperature=0.0, min_new_tokens=2)
    st.admit([m])
    assert st.flags([0, 2], [m]).bans
    m.output_ids = [5] * (2 + S + 1)  # past its minimum, counting the drafts a verify adds
    assert not st.flags([0, 2], [m]).bans and st.flags([0, 2]).bans


def test_commit_advances_live_rows_only() -> None:
    st = _state()
    st.admit([_req(0), _req(1)])
    st.kv_len[[0, 1]] = torch.tensor([5, 9])
    pad = st.pad_row
    rpi = torch.tensor([0, 1, pad, pad])
    live = torch.tensor([True, True, False, False])
    tokens = torch.tensor([[4, 5, 6, 7], [8, 9, 10, 11], [1, 1, 1, 1], [2, 2, 2, 2]])
    n_emit = torch.tensor([2, 4, 4, 4])
    before = (int(st.last_tok[pad]), int(st.kv_len[pad]), int(st.n_out[pad]), int(st.iters[pad]))
    st.commit(rpi, tokens, n_emit, PLAIN, live=live, iteration=True)
    assert st.last_tok[[0, 1]].tolist() == [5, 11] and st.kv_len[[0, 1]].tolist() == [7, 13]
    assert st.n_out[[0, 1]].tolist() == [2, 4] and st.iters[[0, 1]].tolist() == [1, 1]
    assert (int(st.last_tok[pad]), int(st.kv_len[pad]), int(st.n_out[pad]), int(st.iters[pad])) == before
    st.commit(torch.tensor([0]), torch.tensor([[3]]), torch.tensor([1]), PLAIN, kv=False)  # a prefill's first token
    assert int(st.last_tok[0]) == 3 and int(st.kv_len[0]) == 7 and int(st.n_out[0]) == 3


def test_greedy_verify_counts_emits_and_selects() -> None:
    st = _state()
    st.admit([_req(0), _req(1), _req(2)])
    w = S + 1
    rpi = torch.tensor([0, 1, 2])
    # The target's argmax per verify row: request b's drafts match its first b rows.
    pred = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    for b in range(3):
        st.drafts[b] = torch.where(torch.arange(S) < b, pred[b, :S], pred[b, :S] + 1)
    logits = torch.full((3 * w, V), -1.0)
    logits[torch.arange(3 * w), pred.view(-1)] = 1.0
    emitted, n, packed, sel = st.verify_greedy(logits, w, rpi, None)
    assert n.tolist() == [0, 1, 2] and sel.tolist() == [0, w + 1, 2 * w + 2]
    assert emitted[1, :2].tolist() == [9, 10] and emitted[2, :3].tolist() == [13, 14, 15]
    assert packed[:, w].tolist() == [1.0, 2.0, 3.0]  # emitted counts n + 1
    assert st.last_tok[:3].tolist() == [5, 10, 15] and st.kv_len[:3].tolist() == [1, 2, 3]
    assert accepted(st.drafts[rpi], pred).tolist() == [0, 1, 2]
    n2 = st.verify_greedy(logits, w, rpi, None, forced=torch.tensor(3))[1]  # measurement: forced count
    assert n2.tolist() == [3, 3, 3]


def test_greedy_draft_step_writes_live_rows_and_rotates() -> None:
    st = _state()
    rpi = torch.tensor([1, st.pad_row])
    live = torch.tensor([True, False])
    logits = torch.zeros(2, 8)
    logits[0, 3] = logits[1, 6] = 1.0
    vocab_ids = torch.arange(100, 108)  # a reduced draft vocabulary mapped to target ids
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    d, nxt = st.draft_greedy(logits, vocab_ids, rpi, 1, live, ids, torch.tensor([2, 0]))
    assert d.tolist() == [103, 106] and int(st.drafts[1, 1]) == 103 and int(st.drafts[st.pad_row, 1]) == 0
    assert nxt.tolist() == [[2, 3, 103, 4], [106, 7, 8, 8]]
    assert torch.equal(nxt, rotate(ids, torch.tensor([2, 0]), d))


def test_draft_distributions_are_allocated_on_first_use() -> None:
    st = _state()
    st.admit([_req(0, temperature=0.0)])
    assert st.draft_q is None
    q = torch.softmax(torch.randn(1, V), -1)
    st.set_draft_q(torch.tensor([0]), 2, q)
    assert st.draft_q is not None and torch.equal(st.draft_q[0, 2], q[0])


def test_penalty_context_sees_each_rows_preceding_drafts() -> None:
    st = _state()
    st.admit([_req(0, temperature=0.7, repetition_penalty=1.3)])
    rpi = torch.tensor([0])
    f = st.flags([0])
    counts, seen, _ = st.context(rpi, f, drafts=torch.tensor([[4, 4, 9]]))
    assert counts is not None and seen is not None
    # Row j sees the drafts d1..dj: token 4 once at row 1, twice from row 2, token 9 at row 3.
    assert counts[:, 4].tolist() == [0, 1, 2, 2] and counts[:, 9].tolist() == [0, 0, 0, 1]
    assert seen[:, 1].all()  # a prompt token is seen by every row
