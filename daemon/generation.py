"""One HTTP request's generation: its choices submitted to the engine, their deltas turned into text.

A `Generation` owns the n (× prompts) engine requests behind one API call. It submits them, reads
their outputs from one shared queue, runs each choice's `TextAssembler`, observes the latency
metrics as tokens arrive, and yields `Delta`s for the route to format (OpenAI chunks, native JSON).
Engine refusals and engine death surface as `APIError`s (400 for an input the engine rejects, 503 if
the engine died). `close()` aborts whatever has not finished: the route calls it in a `finally`, so a
client that disconnects (aiohttp cancels the handler) frees its slots in the engine.

The queue is bounded in what matters, tokens: when more than `buffer_tokens` generated tokens wait in
it while the route is blocked writing to its client (the client stopped reading), the engine requests
are aborted at once and the route gets a `client_too_slow` error after what it already has.
`fail(err)` ends a generation from outside (the server's drain deadline) the same way. Engine request
ids are internal (`<uuid>-<choice>`): a client-chosen `rid` names the response only, so nothing a
client typed reaches the engine's state events.

A streaming route may take the common step out of the queue: while its task waits on an empty queue,
`OutputQueue.direct` (the route's) is offered each item as the engine client delivers it, from the
reader's callback, and returns what is left for the task (nothing, the item, or the `Delta` it made of
it). A step of 32 streams then costs no task wake-up and no queue round trip per stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from mleagle.daemon.detok import TextAssembler
from mleagle.daemon.engine_client import (
    EngineClient,
    EngineDead,
    EngineRequestFailed,
    EngineUnavailable,
)
from mleagle.daemon.errors import APIError
from mleagle.daemon.metrics import Metrics
from mleagle.engine.contract.outputs import RequestOutput, SpecStats, TokenLogprob, TokenOutput
from mleagle.engine.contract.sampling_params import SamplingParams

log = logging.getLogger("mleagle.daemon")
Item = tuple[int, Any]  # (choice index, RequestOutput | TokenOutput | Delta | an error)


@dataclass
class Choice:
    index: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    asm: TextAssembler | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    spec: SpecStats | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the engine's prefix cache served
    counts_prompt: bool = True  # this choice's prompt counts in the usage block (once per prompt with n > 1)
    t_last: float | None = None
    submitted: bool = False
    # Where the engine's field names live in this route's body: the API field a constraint came from
    # (a schema the engine cannot compile is refused naming it) and the prefix of other fields.
    constraint_field: str | None = None
    param_prefix: str = ""
    param_names: dict[str, str] = field(default_factory=dict)

    def api_param(self, engine_param: str | None) -> str | None:
        """The request field behind an engine refusal's `param` (a SamplingParams path)."""
        if engine_param is None:
            return None
        if engine_param.startswith("structured_outputs") and self.constraint_field is not None:
            return self.constraint_field
        return self.param_prefix + self.param_names.get(engine_param, engine_param)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.asm.text if self.asm is not None else ""


class OutputQueue(asyncio.Queue[Item]):
    """The generation's sink: counts the tokens waiting in it, and calls `on_overflow` once more than
    `limit` wait while the route is stuck writing to its client (`writing`): a daemon that is merely
    busy (a shared CPU) also lags, but it is not blocked by the client, and is never cut for that.
    While the route waits on it empty (`idle`), an item goes to `direct` first, if the route set one."""

    def __init__(self, limit: int, on_overflow: Any) -> None:
        super().__init__()
        self.limit = limit
        self.on_overflow = on_overflow
        self.pending = 0
        self.writing = False  # the route awaits a write its client has not taken yet
        self.overflowed = False
        self.idle = False  # the route's task awaits this queue: nothing of its own is under way
        self.direct: Callable[[Item], Item | None] | None = None

    def put_nowait(self, item: Item) -> None:
        # Only into an empty queue whose route waits: anything queued must reach the route first, and
        # the route must not be writing itself.
        if self.direct is not None and self.idle and not self.qsize():
            try:
                left = self.direct(item)
            except Exception:  # a bug of one stream must not reach the engine client's loop over a step
                log.exception("a stream failed to take an output")
                left = (item[0], APIError(500, "internal error while streaming", type="server_error"))
            if left is None:
                return
            item = left
        super().put_nowait(item)

    def _put(self, item: Item) -> None:
        super()._put(item)
        if isinstance(item[1], (RequestOutput, TokenOutput, Delta)):
            self.pending += len(item[1].token_ids)
            self.check()

    def check(self) -> None:
        """Called as outputs arrive, and by the route once a write has suspended (its client is not
        taking it): more than `limit` tokens waiting then means the client is the one holding them."""
        if self.writing and self.pending > self.limit and not self.overflowed:
            self.overflowed = True
            self.on_overflow()

    def _get(self) -> Item:
        item = super()._get()
        if isinstance(item[1], (RequestOutput, TokenOutput, Delta)):
            self.pending -= len(item[1].token_ids)
        return item


@dataclass
class Delta:
    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def merge(self, later: Delta) -> Delta:
        """This delta followed by a later one of the same choice, as one."""
        pl = None if self.prompt_logprobs is None and later.prompt_logprobs is None else \
            [*(self.prompt_logprobs or []), *(later.prompt_logprobs or [])]
        return Delta(self.choice, self.text + later.text, self.token_ids + later.token_ids,
                     self.logprobs + later.logprobs, later.finished, pl)


class Generation:
    def __init__(self, client: EngineClient, metrics: Metrics, tokenizer: Any, buffer_tokens: int = 1 << 30,
                 t_in: float = 0.0) -> None:
        self.client = client
        self.metrics = metrics
        self.tok = tokenizer
        # The engine's request ids derive from `rid`, never chosen by a client; the response's `id`
        # starts as the same value (so a response can be found in the state events), and a route may
        # prefix it ("chatcmpl-") or replace it with a client's rid.
        self.rid = uuid.uuid4().hex
        self.id = self.rid
        self.t0 = time.perf_counter()
        # time.monotonic() as the request arrived (before its body was read) and as it was submitted:
        # the daemon's marks of the TTFT split (`metrics.TtftPhases`); 0 where unknown.
        self.t_in = t_in
        self.t_submit = 0.0
        # A stream observes a choice's split once its first frame is written (`written`); other
        # responses as the delta is taken.
        self.streaming = False
        self._split: dict[int, tuple[list[float], float]] = {}  # choice -> (engine timing, taken at)
        self.choices: list[Choice] = []
        # The sink calls back through a weak reference: a bound method would make generation and queue a
        # cycle, and every request's objects would then wait for the collector (a pause on the loop
        # every stream shares) instead of going as the route returns.
        overflow = weakref.WeakMethod(self._overflow)
        self.sink = OutputQueue(buffer_tokens, lambda: (f := overflow()) is not None and f())
        self.prompt_tokens = 0

    def add(self, prompt_ids: list[int], params: SamplingParams, count_prompt: bool = True) -> Choice:
        i = len(self.choices)
        asm = TextAssembler(self.tok, prompt_ids, params.stop, params.skip_special_tokens) if self.tok is not None else None
        c = Choice(i, f"{self.rid}-{i}", prompt_ids, params, asm, counts_prompt=count_prompt)
        self.choices.append(c)
        if count_prompt:
            self.prompt_tokens += len(prompt_ids)
        return c

    def written(self, c: Choice) -> None:
        """A stream wrote a delta of choice `c`: the first one completes its TTFT split."""
        got = self._split.pop(c.index, None)
        if got is not None:
            self.metrics.phases.observe(self.t_in, self.t_submit, got[0], got[1], time.monotonic(), self.id)

    def submit(self) -> None:
        self.t_submit = time.monotonic()
        try:
            for c in self.choices:
                self.client.add(c.rid, c.prompt_ids, c.params, self.sink, c.index)
                c.submitted = True
                self.metrics.prompt_tokens_m.inc(len(c.prompt_ids))
        except EngineUnavailable as e:
            self.close()
            raise APIError(503, f"the engine is not available: {e}", headers={"Retry-After": "2"}) from None

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, counted like `prompt_tokens` (once per prompt)."""
        return sum(c.num_cached_tokens for c in self.choices if c.counts_prompt)

    def close(self) -> None:
        for c in self.choices:
            if c.submitted and not c.finished:
                self.client.abort(c.rid)

    def fail(self, err: APIError) -> None:
        """End every unfinished choice with `err`: the engine requests are aborted now, and the route
        raises `err` once it has taken what came before it from the queue."""
        self.close()
        for c in self.choices:
            if not c.finished:
                self.sink.put_nowait((c.index, err))

    def _overflow(self) -> None:
        n = self.sink.pending
        self.fail(APIError(503, f"the client is not reading its stream: {n} generated tokens could not be sent; "
                                "the request was stopped", code="client_too_slow"))

    def _apply(self, c: Choice, o: RequestOutput | TokenOutput) -> Delta:
        now = time.perf_counter()
        m = self.metrics
        n = len(o.token_ids)
        if n:
            if c.t_last is None:
                m.ttft_m.observe(now - self.t0)
                if o.timing is not None:
                    took = time.monotonic()
                    if self.streaming:
                        self._split[c.index] = (o.timing, took)
                    else:
                        m.phases.observe(self.t_in, self.t_submit, o.timing, took, took, self.id)
            # A speculative step emits several tokens at once: each gets its share of the wait.
            m.tokens.observe(n, None if c.t_last is None else (now - c.t_last) / n)
            c.t_last = now
        c.token_ids.extend(o.token_ids)
        lps = o.logprobs or []
        c.logprobs.extend(lps)
        if o.prompt_logprobs is not None:
            c.prompt_logprobs = (c.prompt_logprobs or []) + list(o.prompt_logprobs)
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
        return Delta(c, text, list(o.token_ids), lps, c.finished, o.prompt_logprobs)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas until every choice has finished. A stream that fell behind (its route was still
        writing while the engine stepped on) finds several outputs waiting: they are taken at once and
        each choice's merged into one delta, so a slow stream costs one chunk per catch-up, not one
        per engine step; errors still come after everything that arrived before them."""
        while not all(c.finished for c in self.choices):
            self.sink.idle = True
            try:
                waiting = [await self.sink.get()]
            finally:
                self.sink.idle = False
            while not self.sink.empty():
                waiting.append(self.sink.get_nowait())
            merged: dict[int, Delta] = {}
            err: APIError | None = None
            for tag, item in waiting:
                try:
                    d = self.take(tag, item)
                except APIError as e:
                    err = e
                    break
                if d is not None:
                    prev = merged.get(tag)
                    merged[tag] = d if prev is None else prev.merge(d)
            for d in merged.values():  # what came before an error goes out before it
                yield d
            if err is not None:
                raise err

    def take(self, tag: int, item: Any) -> Delta | None:
        """One queue item: a delta for its choice (a `Delta` made by `direct` is one already), None when
        that choice has already finished; an error item raises (the choice ends with it)."""
        if isinstance(item, Delta):
            return item
        c = self.choices[tag]
        if c.finished:
            return None
        if isinstance(item, EngineRequestFailed):
            c.finish_reason = "error"
            if item.kind == "input":  # the engine refused it; its message says why
                msg, param = str(item), c.api_param(item.param)
                if item.param and param and msg.startswith(item.param + ": "):
                    msg = f"{param}: {msg[len(item.param) + 2:]}"  # the field as this route calls it
                raise APIError(400, msg, code="engine_refused", param=param)
            raise APIError(500, str(item), type="server_error")
        if isinstance(item, EngineDead):
            c.finish_reason = "error"
            raise APIError(503, str(item), code="engine_dead", headers={"Retry-After": "5"})
        if isinstance(item, APIError):
            c.finish_reason = "error"
            raise item
        return self._apply(c, item)

    async def run(self) -> None:
        """Non-streaming: run to completion."""
        async for _ in self.deltas():
            pass
