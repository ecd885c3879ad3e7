"""One HTTP request's generation: its choices submitted to the engine, their deltas turned into text.

A `Generation` owns the n (× prompts) engine requests behind one API call. It submits them, reads
their outputs from one shared queue, runs each choice's `TextAssembler`, observes the latency
metrics as tokens arrive, and yields `Delta`s for the route to format (OpenAI chunks, native JSON).
Engine refusals and engine death surface as `APIError`s (400 for an input the engine rejects, 503 if
the engine died). `close()` aborts whatever has not finished: the route calls it in a `finally`, so a
client that disconnects (aiohttp cancels the handler) frees its slots in the engine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from mleagle.daemon.detok import TextAssembler
from mleagle.daemon.engine_client import EngineClient, EngineDead, EngineRequestFailed, EngineUnavailable
from mleagle.daemon.errors import APIError
from mleagle.daemon.metrics import Metrics
from mleagle.engine.contract.outputs import RequestOutput, SpecStats, TokenLogprob
from mleagle.engine.contract.sampling_params import SamplingParams


@dataclass
class Choice:
    index: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    asm: TextAssembler | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    spec: SpecStats | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the engine's prefix cache served
    counts_prompt: bool = True  # this choice's prompt counts in the usage block (once per prompt with n > 1)
    t_last: float | None = None
    submitted: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.asm.text if self.asm is not None else ""


@dataclass
class Delta:
    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool


class Generation:
    def __init__(self, client: EngineClient, metrics: Metrics, tokenizer: Any, request_id: str | None = None) -> None:
        self.client = client
        self.metrics = metrics
        self.tok = tokenizer
        self.id = request_id or uuid.uuid4().hex
        self.t0 = time.perf_counter()
        self.choices: list[Choice] = []
        self.sink: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.prompt_tokens = 0

    def add(self, prompt_ids: list[int], params: SamplingParams, count_prompt: bool = True) -> Choice:
        i = len(self.choices)
        asm = TextAssembler(self.tok, prompt_ids, params.stop, params.skip_special_tokens) if self.tok is not None else None
        c = Choice(i, f"{self.id}-{i}", prompt_ids, params, asm, counts_prompt=count_prompt)
        self.choices.append(c)
        if count_prompt:
            self.prompt_tokens += len(prompt_ids)
        return c

    def submit(self) -> None:
        try:
            for c in self.choices:
                self.client.add(c.rid, c.prompt_ids, c.params, self.sink, c.index)
                c.submitted = True
                self.metrics.prompt_tokens.labels(self.metrics.model).inc(len(c.prompt_ids))
        except EngineUnavailable as e:
            self.close()
            raise APIError(503, f"the engine is not available: {e}", headers={"Retry-After": "2"}) from None
        except ValueError as e:  # a client-chosen request id already in flight
            self.close()
            raise APIError(400, str(e), param="rid") from None

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, counted like `prompt_tokens` (once per prompt)."""
        return sum(c.num_cached_tokens for c in self.choices if c.counts_prompt)

    def close(self) -> None:
        for c in self.choices:
            if c.submitted and not c.finished:  # never another request's rid (a duplicate was refused)
                self.client.abort(c.rid)

    def _apply(self, c: Choice, o: RequestOutput) -> Delta:
        now = time.perf_counter()
        m, lab = self.metrics, self.metrics.model
        n = len(o.token_ids)
        if n:
            if c.t_last is None:
                m.ttft.labels(lab).observe(now - self.t0)
            else:
                # A speculative step emits several tokens at once: each gets its share of the wait.
                for _ in range(n):
                    m.itl.labels(lab).observe((now - c.t_last) / n)
            c.t_last = now
            m.gen_tokens.labels(lab).inc(n)
        c.token_ids.extend(o.token_ids)
        lps = o.logprobs or []
        c.logprobs.extend(lps)
        c.num_output_tokens = max(o.num_output_tokens, len(c.token_ids))
        c.num_cached_tokens = o.num_cached_tokens
        text = c.asm.push(o.token_ids) if c.asm is not None else ""
        if o.finished:
            if o.finish_reason == "error":
                raise APIError(500, o.error or "the engine failed this request", type="server_error")
            if c.asm is not None:
                text += c.asm.finish()
            c.finish_reason = o.finish_reason or "stop"
            c.matched_stop = o.matched_stop
            c.spec = o.spec
            m.observe_finished(c.finish_reason, len(c.prompt_ids), c.num_output_tokens, now - self.t0, o.spec,
                               o.num_cached_tokens)
        elif c.asm is not None and c.asm.stopped:
            # The daemon saw a stop string the engine has not acted on yet: end the choice here.
            self.client.abort(c.rid)
            c.finish_reason = "stop"
            m.observe_finished("stop", len(c.prompt_ids), c.num_output_tokens, now - self.t0, o.spec,
                               o.num_cached_tokens)
        return Delta(c, text, list(o.token_ids), lps, c.finished)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas in arrival order until every choice has finished."""
        while not all(c.finished for c in self.choices):
            tag, item = await self.sink.get()
            c = self.choices[tag]
            if c.finished:
                continue
            if isinstance(item, EngineRequestFailed):
                c.finish_reason = "error"
                if item.kind == "input":
                    raise APIError(400, item.message, param="prompt")
                raise APIError(500, item.message, type="server_error")
            if isinstance(item, EngineDead):
                c.finish_reason = "error"
                raise APIError(503, str(item), code="engine_dead", headers={"Retry-After": "5"})
            yield self._apply(c, item)

    async def run(self) -> None:
        """Non-streaming: run to completion."""
        async for _ in self.deltas():
            pass
