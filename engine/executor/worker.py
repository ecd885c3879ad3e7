"""The target-only worker: prefill chunks and decode steps over the target runner.

A worker turns scheduled requests into forward batches, runs them on its runners and samples. The
scheduler owns memory and request life; the worker owns forwards. The speculative worker
(`mleagle.engine.spec.worker`) implements the same interface with draft runners beside the target.
`lookahead` says how many KV positions one decode step writes per request beyond `kv_len`. A request
that hit the prefix cache starts with `kv_len` at its cached length, so prefill computes only the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mleagle.engine.contract.outputs import TokenLogprob
from mleagle.engine.core.request import Req
from mleagle.engine.executor.forward_batch import ForwardBatch, ForwardMode, build_batch
from mleagle.engine.executor.runner import ForwardOutput, ModelRunner
from mleagle.engine.sampling.sampler import RowInfo, logprobs_of, sample


@dataclass
class StepResult:
    """New tokens (and their logprobs, when asked) for one request from one step."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def row_info(req: Req, extra: list[int] | None = None, eos_ids: frozenset[int] = frozenset()) -> RowInfo:
    out = req.output_ids + (extra or [])
    sp = req.params
    # Before min_new_tokens, EOS and stop ids are banned (as HF's and vLLM's min-tokens processors do).
    suppress = sorted(set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos_ids)) if len(out) < sp.min_new_tokens else []
    return RowInfo(sp, req.seed, len(out), req.prompt_ids, out, suppress)


class TargetWorker:
    lookahead = 1
    prefix_margin = 0  # cached positions a hit leaves to recompute (see SpecWorker.prefix_margin)

    def __init__(self, target: ModelRunner, device: torch.device | str = "cpu", eos_ids: frozenset[int] = frozenset()):
        self.target = target
        self.device = device
        self.eos_ids = eos_ids
        self.last_batch: ForwardBatch | None = None

    @property
    def runners(self) -> list[ModelRunner]:
        return [self.target]

    def prefill_batch(self, reqs: list[Req], chunks: list[int]) -> ForwardBatch:
        ids: list[int] = []
        for r, c in zip(reqs, chunks):
            ids += r.fill_ids[r.kv_len : r.kv_len + c]
        want_prompt_lp = any(r.params.prompt_logprobs is not None and r.prompt_logprobs is None for r in reqs)
        b = build_batch(ForwardMode.EXTEND, input_ids=ids, req_pool_indices=[r.req_pool_idx for r in reqs],  # type: ignore[misc]
                        prefix_lens=[r.kv_len for r in reqs], extend_lens=chunks,
                        req_to_token=self.target.binding.req_to_token.req_to_token, all_logit_rows=want_prompt_lp,
                        device=self.device, rids=tuple(r.rid for r in reqs))
        return self.target.bind(b)

    def prefill(self, reqs: list[Req], chunks: list[int]) -> list[StepResult]:
        batch = self.prefill_batch(reqs, chunks)
        out = self.target.forward(batch)
        self.last_batch = batch
        return self.finish_prefill(reqs, chunks, batch, out)

    def finish_prefill(self, reqs: list[Req], chunks: list[int], batch: ForwardBatch, out: ForwardOutput) -> list[StepResult]:
        """Sample the first token of requests whose prefill completes; prompt logprobs; advance kv_len."""
        logits = out.logits
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + c)
        if batch.all_logit_rows:
            last_rows = [s - 1 for s in starts[1:]]
        else:
            last_rows = list(range(len(reqs)))
        results = [StepResult() for _ in reqs]
        for i, (r, c) in enumerate(zip(reqs, chunks)):
            if batch.all_logit_rows and r.params.prompt_logprobs is not None and r.prompt_logprobs is None:
                results[i].prompt_logprobs = self._prompt_logprobs(r, logits[starts[i] : starts[i + 1]], c)
            r.kv_len += c
        # A resumed request (preempted after generating) already has its next input token: no sample.
        done = [i for i, r in enumerate(reqs) if not r.prefilling and not r.output_ids]
        if done:
            rows = logits[[last_rows[i] for i in done]]
            infos = [row_info(reqs[i], eos_ids=self.eos_ids) for i in done]
            toks = sample(rows, infos)
            lps = logprobs_of(rows, toks, [reqs[i].params.logprobs for i in done])
            for j, i in enumerate(done):
                results[i].tokens = [toks[j]]
                if lps[j] is not None:
                    results[i].logprobs = [lps[j]]  # type: ignore[list-item]
        return results

    def _prompt_logprobs(self, r: Req, logits: torch.Tensor, c: int) -> list[TokenLogprob | None]:
        """Row p predicts token p+1; the chunk covers positions kv_len..kv_len+c-1 of the prompt."""
        start = r.kv_len
        res: list[TokenLogprob | None] = [None] if start == 0 else []
        targets = [t for t in r.prompt_ids[start + 1 : start + c + 1]]
        k = len(targets)  # the chunk's last row predicts beyond the prompt when the prompt ends here
        if k:
            res += logprobs_of(logits[:k], targets, [r.params.prompt_logprobs] * k)
        return res

    def decode_batch(self, reqs: list[Req]) -> ForwardBatch:
        b = build_batch(ForwardMode.DECODE, input_ids=[r.output_ids[-1] for r in reqs],
                        req_pool_indices=[r.req_pool_idx for r in reqs],  # type: ignore[misc]
                        prefix_lens=[r.kv_len for r in reqs], extend_lens=[1] * len(reqs),
                        req_to_token=self.target.binding.req_to_token.req_to_token, device=self.device,
                        rids=tuple(r.rid for r in reqs))
        return self.target.bind(b)

    def decode(self, reqs: list[Req]) -> list[StepResult]:
        batch = self.decode_batch(reqs)
        out = self.target.forward(batch)
        self.last_batch = batch
        toks = sample(out.logits, [row_info(r, eos_ids=self.eos_ids) for r in reqs])
        lps = logprobs_of(out.logits, toks, [r.params.logprobs for r in reqs])
        res = []
        for r, t, lp in zip(reqs, toks, lps):
            r.kv_len += 1
            res.append(StepResult([t], [lp] if lp is not None else None))
        return res

    def kv_valid_len(self, req: Req) -> int:
        """Leading positions of `req` whose KV is computed in every runner's pool: what the prefix
        cache may keep when the request ends or is preempted. The target's pool is all there is here."""
        return req.kv_len

    def release(self, req: Req) -> None:
        """Drop per-request worker state (the speculative worker keeps drafts here)."""
        req.draft_state = None
