"""The HTTP app: `create_app(cfg)` builds the aiohttp application and its routes.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (OpenAI; JSON or SSE streaming),
`GET /v1/models`, `GET /health` (no API key), `GET /metrics` (Prometheus), `POST /generate` (native),
`GET /v1/events` (state events over WebSocket), `GET /debug/engine` (fresh pool usage and counters).
One middleware checks the API key (as bytes: a header that is not UTF-8 is just a wrong key; a request
carrying `Authorization` twice is refused with 400, since a proxy may have checked the other), turns
every failure into an OpenAI error body, counts HTTP statuses, and writes every plain response under
`write_timeout_s`. Bodies are read by `body.read_json` (size, time, strict JSON). Admission control
happens before the engine sees a request: the server answers 503 while the engine is down or the
server drains, and 429 with `Retry-After` once running + queued requests reach
`max_running_requests + max_queued_requests`. A streamed response sends its headers only with its
first delta, so a request the engine refuses still gets its proper status code; after that, an error
is sent as an `{"error": ...}` event before `[DONE]`, also when the stream is cut (a client that stops
reading, the drain deadline of a shutdown). Chat prompts are tokenized by `Tokenizer.encode_chat`:
special-token text inside messages is plain text, only the template's own markers are special.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable
from json.encoder import encode_basestring
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # aiohttp's own dependency before 3.11
    from async_timeout import timeout

from mleagle.daemon.body import read_json
from mleagle.daemon.engine_client import EngineClient, EngineUnavailable
from mleagle.daemon.errors import APIError, from_validation
from mleagle.daemon.events_relay import EventsRelay
from mleagle.daemon.generation import Choice, Delta, Generation
from mleagle.daemon.metrics import Metrics, ReadCounter
from mleagle.daemon.openai_api import ChatRequest, CompletionRequest, GenerateRequest, to_sampling_params
from mleagle.daemon.structured import Constraint, tool_calls, tool_prompt
from mleagle.engine.contract.config import MleagleConfig
from mleagle.engine.contract.gc_watch import GcWatch, freeze
from mleagle.engine.contract.outputs import RequestOutput, TokenLogprob, TokenOutput
from mleagle.engine.contract.protocol import AddRequest, encode, peak_rss_mb
from mleagle.engine.contract.sampling_params import SamplingParams

log = logging.getLogger("mleagle.daemon")
SRV: web.AppKey[Server] = web.AppKey("srv")
PUBLIC = {"/health"}
SPIN_IDLE_S = 20e-6  # a spin pass shorter than this ran nothing but the poll (`Server.spin_idle_s`)
REHEARSE_EVERY_S = 0.002  # while spinning, the intake path runs on a throwaway request this often (`Server.rehearse`)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# The throwaway chat request `Server.rehearse` validates (a body as a client sends one).
REHEARSAL = {"model": "rehearsal", "messages": [{"role": "user", "content": "A rehearsal."}], "max_tokens": 16,
             "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
SPIN_ACTIVE = 4  # the daemon's loop spins (`Server.spin`) while at most this many requests are in flight
# request key: time.monotonic() as a generation route began (the TTFT split's first mark); a typed
# key where aiohttp has them (3.12+), which it asks for
T_IN: Any = web.RequestKey("mleagle.t_in", float) if hasattr(web, "RequestKey") else "mleagle.t_in"


class Server:
    """State shared by the routes: config, engine client, metrics, admission and drain."""

    def __init__(self, cfg: MleagleConfig, on_fatal: Callable[[int], None] | None = None) -> None:
        self.cfg = cfg
        self.model = cfg.server.served_model_name or cfg.model.name
        self.metrics = Metrics(self.model)
        self.on_fatal = on_fatal
        self.client = EngineClient(
            cfg,
            restart=cfg.server.restart_engine,
            on_fatal=self._fatal,
            on_state=lambda s: self.metrics.engine_up.set(1 if s == "ready" else 0),
            on_pong=self._on_pong,
        )
        self.events = EventsRelay(self.client, cfg.server.write_timeout_s)
        # A daemon that falls behind its engine reads several steps at once and merges their deltas: a
        # rising rate here says its loop is what limits the streams (`EngineClient._on_msgs`).
        self.metrics.registry.register(ReadCounter(
            "mleagle:daemon_coalesced_deltas", "Token deltas the daemon merged into an earlier step's because it "
            "read several engine steps at once (its event loop had fallen behind)", lambda: self.client.coalesced))
        self.draining = False
        self.active = 0  # HTTP requests with a generation in flight (what a drain waits for)
        self.idle = asyncio.Event()
        self.idle.set()
        self.gens: set[Generation] = set()  # generations in flight (what a drain deadline fails)
        self.direct_outputs = 0  # engine outputs a stream took in the engine client's callback (`stream`)
        self.max_inflight = cfg.engine.max_running_requests + cfg.server.max_queued_requests
        k = cfg.server.key()
        self.api_key = k.encode() if k else None
        self._tok_cache: dict[int, str] = {}
        self._start_task: asyncio.Task[None] | None = None
        # The loop's spin (`server.spin_ms`, beside a GPU engine only): a task that yields at once,
        # over and over, so the loop polls its sockets instead of sleeping in them.
        self.spin_s = cfg.server.spin_ms / 1e3
        self.spin_until = 0.0
        self.spinner: asyncio.Task[None] | None = None
        self.spins = 0
        # Time the spin found nothing to do (a pass of the loop back to the spinner within SPIN_IDLE_S):
        # CPU burnt polling, which `bench serve` takes out of the daemon's CPU to show its work.
        self.spin_idle_s = 0.0
        self.rehearsals = 0
        self.gc = GcWatch().install()  # the loop's collections and their pauses (`/debug/engine`)

    def _fatal(self, code: int) -> None:
        if self.on_fatal is not None:
            self.on_fatal(code)

    def _on_pong(self, p: Any) -> None:
        self.metrics.set_pools(p.pool_usage)
        self._set_queue_gauges(p.stats)
        # A restarted engine counts from zero: the restarts tell the policy's counters where a new one begins.
        self.metrics.set_policy((p.stats or {}).get("spec_policy"), epoch=self.client.restarts)

    def _set_queue_gauges(self, stats: dict[str, Any] | None = None) -> None:
        n = self.client.num_inflight
        stats = stats or {}
        run = stats.get("num_running")
        wait = stats.get("num_waiting")
        if not isinstance(run, int) or not isinstance(wait, int):
            run = min(n, self.cfg.engine.max_running_requests)
            wait = n - run
        self.metrics.running.labels(self.model).set(run)
        self.metrics.waiting.labels(self.model).set(wait)

    # ---- admission ------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.client.tokenizer

    @property
    def max_context(self) -> int:
        assert self.client.info is not None
        return self.client.info.max_context_len

    def check_ready(self) -> None:
        if self.draining:
            self.metrics.rejected.labels("draining").inc()
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.client.state != "ready":
            self.metrics.rejected.labels("engine_unavailable").inc()
            why = f" ({self.client.error})" if self.client.error else ""
            raise APIError(503, f"the engine is {self.client.state}{why}", code="engine_unavailable",
                           headers={"Retry-After": "5"})

    def admit(self, k: int) -> None:
        self.check_ready()
        if k > self.max_inflight:
            raise APIError(400, f"{k} sequences in one request; at most {self.max_inflight}", param="n")
        if self.client.num_inflight + k > self.max_inflight:
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(429, f"too many requests in flight ({self.client.num_inflight}); retry later",
                           code="queue_full", headers={"Retry-After": "1"})

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model, self.cfg.model.name):
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model!r}",
                           param="model", code="model_not_found")

    def budget(self, prompt_len: int, max_tokens: int | None) -> int:
        """max_new_tokens for a prompt: what the client asked for (or all the room there is), checked
        against the context and against what one request may hold in the engine's KV pool."""
        ctx = self.max_context
        info = self.client.info
        pool = info.max_request_tokens if info is not None else None
        limit, what = ctx, f"this model's context is {ctx} tokens"
        if pool is not None and pool < ctx:
            limit, what = pool, f"one request may hold {pool} tokens in this server's KV pool"
        if prompt_len >= limit:
            raise APIError(400, f"the prompt is {prompt_len} tokens; {what}", param="prompt",
                           code="context_length_exceeded")
        if max_tokens is None:
            return limit - prompt_len
        if prompt_len + max_tokens > limit:
            asked = str(max_tokens) if max_tokens < 10**12 else f"a {len(str(max_tokens))}-digit number"
            raise APIError(
                400,
                f"{what}; the prompt is {prompt_len} tokens and max_tokens is {asked}: lower max_tokens or "
                "shorten the prompt",
                param="max_tokens", code="context_length_exceeded",
            )
        return max_tokens

    def check_stops(self, params: SamplingParams, param: str) -> None:
        if params.stop and self.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer and this model has none: use stop_token_ids",
                           param=param)

    def need_tokenizer(self, what: str, param: str = "prompt") -> Any:
        if self.tokenizer is None:
            raise APIError(400, f"{what} needs a tokenizer and this model has none: send token ids", param=param)
        return self.tokenizer

    def encode(self, text: str, special: bool) -> list[int]:
        tok = self.need_tokenizer("a text prompt")
        try:
            return tok.encode(text, add_special_tokens=special)
        except (UnicodeError, ValueError, TypeError) as e:
            raise APIError(400, f"the prompt cannot be tokenized: {e}", param="prompt") from None

    async def aencode(self, text: str, special: bool) -> list[int]:
        """Tokenize; long texts off the event loop (a 1 MB prompt takes ~0.4 s), short ones inline."""
        if len(text) > 8192:
            return await asyncio.to_thread(self.encode, text, special)
        return self.encode(text, special)

    def check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.client.info.vocab_size if self.client.info else None
        if vocab is None and self.tokenizer is not None:
            vocab = self.tokenizer.vocab_size
        if any(t < 0 or (vocab is not None and t >= vocab) for t in ids):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
        return ids

    def tok_str(self, i: int) -> str:
        s = self._tok_cache.get(i)
        if s is None:
            s = self.tokenizer.decode([i], skip_special_tokens=False) if self.tokenizer is not None else f"<{i}>"
            if len(self._tok_cache) < 200_000:
                self._tok_cache[i] = s
        return s

    def generation(self, request: web.Request) -> Generation:
        return Generation(self.client, self.metrics, self.tokenizer, self.cfg.server.stream_buffer_tokens,
                          t_in=request.get(T_IN, 0.0))

    def fail_inflight(self, err: APIError) -> int:
        """End every generation in flight with `err` (its stream gets the error event); returns how many."""
        gens = list(self.gens)
        for g in gens:
            g.fail(err)
        return len(gens)

    def enter(self) -> None:
        self.active += 1
        self.idle.clear()
        self.spin()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.idle.set()
        self.spin_until = time.monotonic() + self.spin_s
        self.spin()

    def spin(self) -> None:
        """Keep the event loop polling while at most SPIN_ACTIVE requests are in flight and for
        `spin_s` after one ends: between a client's requests, and while a request waits for its first
        token, the loop would otherwise sleep in epoll and take the next arrival with a wake-up on a
        cold core (at c1 on an H200 the daemon's own part of TTFT was 1.0 ms idle against 0.6 ms busy).
        Beside a CPU engine it never spins: that engine's forwards need the cores."""
        info = self.client.info
        if self.spinner is not None or self.spin_s <= 0 or info is None or info.device in (None, "cpu"):
            return
        self.spinner = asyncio.get_running_loop().create_task(self._spin())

    async def _spin(self) -> None:
        now = time.monotonic
        last = now()
        due = last + REHEARSE_EVERY_S
        try:
            while 0 < self.active <= SPIN_ACTIVE or now() < self.spin_until:
                t = now()
                if t - last < SPIN_IDLE_S:  # back at once: the pass between found nothing else to run
                    self.spin_idle_s += t - last
                    if t >= due:
                        self.rehearse()
                        t = now()  # the rehearsal is work, not polling: the next pass is timed after it
                        due = t + REHEARSE_EVERY_S
                last = t
                self.spins += 1
                await asyncio.sleep(0)
        finally:
            self.spinner = None

    def rehearse(self) -> None:
        """Run a chat request's intake on a throwaway one and drop it, from the spin while the loop has
        nothing else to do: its body validated, its messages rendered and tokenized as new text, its
        sampling parameters, generation and engine message built (not sent), a first frame's bytes and
        a stream's response (not prepared). The next real request then finds that code warm: at c1 on
        the dev VM its `daemon_in` went from 0.8 to 0.56 ms (mean, `scripts/daemon_alone.py
        --concurrency 1 --spin`), with no change to the requests' wait before their route. A rehearsal
        costs the loop 0.18 ms there (median; 0.09 back to back), every `REHEARSE_EVERY_S`, and only
        while it would otherwise only poll. It leaves nothing behind: no metric, no cached piece, no
        garbage for the collector."""
        tok = self.client.tokenizer
        if tok is None:
            return
        self.rehearsals += 1
        req = ChatRequest.model_validate(REHEARSAL)
        ids = tok.rehearse(f"{req.messages_dicts()[0]['content']} Number {self.rehearsals}, in words and figures.")
        con = req.constraint()
        params = to_sampling_params(req, 16, 0, con)
        gen = Generation(self.client, self.metrics, tok, self.cfg.server.stream_buffer_tokens)
        gen.add(ids, params)
        encode(AddRequest(rid="rehearsal", prompt_ids=ids, params=params))
        _chat_format(self, gen, req, con).content_frame(0, "content", "A rehearsal.")  # a first frame's bytes
        web.StreamResponse(headers=SSE_HEADERS)


# ---- body parsing -------------------------------------------------------------------------------


def parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation(e) from None


async def admit(request: web.Request, model: type[BaseModel]) -> tuple[Server, Any]:
    """The checks every generation route starts with: body, schema, values, served model, engine up."""
    request[T_IN] = time.monotonic()  # the first mark of the TTFT split (`metrics.TtftPhases`)
    srv = request.app[SRV]
    req = parse(model, await read_json(request, srv.cfg.server.max_body_bytes, srv.cfg.server.body_timeout_s))
    req.check()
    if hasattr(req, "model"):
        srv.check_model(req.model)
    srv.check_ready()
    return srv, req


def sampling(srv: Server, req: CompletionRequest | ChatRequest, budget: int, index: int,
             con: Constraint | None = None) -> SamplingParams:
    try:
        params = to_sampling_params(req, budget, index, con)
    except ValidationError as e:  # constraints only SamplingParams knows (e.g. empty or too many stops)
        raise from_validation(e) from None
    srv.check_stops(params, "stop")
    return params


def add_choice(gen: Generation, ids: list[int], params: SamplingParams, con: Constraint, first: bool) -> Choice:
    c = gen.add(ids, params, count_prompt=first)
    c.constraint_field = con.field
    c.param_names = {"min_new_tokens": "min_tokens"}
    return c


def _usage(gen: Generation) -> dict[str, Any]:
    c = gen.completion_tokens
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": c, "total_tokens": gen.prompt_tokens + c,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}}


# ---- logprob formatting -------------------------------------------------------------------------


def completion_logprobs(srv: Server, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    toks = [srv.tok_str(lp.token_id) for lp in lps]
    offsets = []
    for t in toks:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": toks,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{srv.tok_str(i): v for i, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(srv: Server, lps: list[TokenLogprob]) -> dict[str, Any]:
    def one(i: int, v: float) -> dict[str, Any]:
        s = srv.tok_str(i)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8", "replace"))}

    return {"content": [{**one(lp.token_id, lp.logprob), "top_logprobs": [one(i, v) for i, v in lp.top]} for lp in lps]}


def spec_stats(c: Choice) -> dict[str, Any] | None:
    return c.spec.summary() if c.spec is not None else None


# ---- SSE ------------------------------------------------------------------------------------------


# An SSE frame at most this long is written without a timer when its transport holds nothing unsent
# (`SSE.write_now`): far below asyncio's 64 KiB high-water mark, so the write cannot pause.
FAST_WRITE_MAX = 16384


class ClientTooSlow(Exception):
    """A write to the client did not complete within `write_timeout_s`."""


async def _queue_write(write: Any) -> None:
    """Start a write and stop waiting for it once it has queued its bytes. aiohttp frames and hands the
    bytes to the transport synchronously, before it waits for the client to drain them; so the bytes
    go out if the client ever reads again, and nothing here waits on a client that does not."""
    t = asyncio.ensure_future(write)
    done, _ = await asyncio.wait({t}, timeout=0.05)
    if not done:
        t.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await t


class SSE:
    """A server-sent-events response prepared lazily, on the first chunk. Each write must complete
    within `timeout` seconds, or the client is too slow (`ClientTooSlow`)."""

    def __init__(self, request: web.Request, timeout: float) -> None:
        self.request = request
        self.timeout = timeout
        self.resp: web.StreamResponse | None = None

    @staticmethod
    def frame(obj: Any) -> bytes:
        if isinstance(obj, bytes):  # framed already (`_Format.content_frame`)
            return obj
        data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
        return f"data: {data}\n\n".encode()

    def write_now(self, data: bytes) -> bool:
        """Write `data` (framed) at once if that cannot wait for the client: the response is under way
        and its transport holds nothing unsent, so the bytes go to the socket and stay far below the
        transport's high-water mark. False, and nothing written, otherwise: then `send` it.

        aiohttp's `write` is a coroutine, but (aiohttp/http_writer.py, `StreamWriter.write`) it frames
        the chunk and hands it to the transport synchronously; it suspends only to drain, and its drain
        waits only while the protocol is paused, which the transport asks for above the high-water mark
        alone (a server response has no chunk callback and no compression here). So it is run here
        to its end in one step, with no task and no await: this is what lets the engine client's
        callback write a frame (`stream`'s direct path)."""
        t = self.request.transport
        if self.resp is None or t is None or t.is_closing() or len(data) >= FAST_WRITE_MAX or t.get_write_buffer_size():
            return False
        w = self.resp.write(data)
        try:
            w.send(None)
        except StopIteration:
            return True
        w.close()  # not reached while aiohttp's write is as read above; fail loudly if it changes
        raise RuntimeError("aiohttp's write suspended below the transport's high-water mark")

    async def send(self, obj: Any) -> None:
        # `timeout` (not wait_for, which runs the write in a task of its own): a write the client takes
        # completes without suspending this task.
        data = self.frame(obj)
        try:
            async with timeout(self.timeout):
                if self.resp is None:
                    self.resp = web.StreamResponse(headers=SSE_HEADERS)
                    await self.resp.prepare(self.request)
                await self.resp.write(data)
        except asyncio.TimeoutError:
            raise ClientTooSlow from None

    async def close(self, err: Any = None) -> web.StreamResponse:
        """`[DONE]` and the end of the response; with `err`, its error event first, in the same write:
        a client that reads slowly (a shutdown's drain deadline, 2 s of grace) then gets both or
        neither, never the error without the `[DONE]` after it."""
        try:
            await self.send((self.frame(err) if err is not None else b"") + self.frame("[DONE]"))
            assert self.resp is not None
            async with timeout(self.timeout):  # not `wait_for`: no task (and loop pass) per stream's end
                await self.resp.write_eof()
        except (ClientTooSlow, asyncio.TimeoutError):
            self._drop()
        assert self.resp is not None
        return self.resp

    async def cut(self, err: APIError) -> web.StreamResponse:
        """End the stream now with `err`: the error event and `[DONE]` are queued without waiting, and a
        client that has not taken them within the write timeout is disconnected."""
        assert self.resp is not None
        self.resp.force_close()
        await _queue_write(self.resp.write(self.frame(err.body()) + self.frame("[DONE]")))
        transport = self.request.transport
        if transport is not None:
            asyncio.get_running_loop().call_later(self.timeout, transport.abort)
        return self.resp

    def _drop(self) -> None:
        if self.resp is not None:
            self.resp.force_close()
        if self.request.transport is not None:
            self.request.transport.abort()


async def stream(request: web.Request, gen: Generation, fmt: Any) -> web.StreamResponse:
    """Run `gen`, sending `fmt.chunks(delta)` per delta and `fmt.tail()` at the end; an error after the
    headers went out is sent as an `{"error": ...}` event (OpenAI's convention) before `[DONE]`. A
    client that does not take a write within `write_timeout_s` has its request stopped and its stream
    cut the same way, with a `client_too_slow` error event.

    Once the headers went out, a format whose running deltas are content frames alone (`fmt.direct`:
    one choice, no logprobs, no usage in chunks) lets the engine client's callback run the common step
    itself (`OutputQueue.direct`): apply the output and write its frame when `write_now` can. Whatever
    could wait or end the stream stays with this task: a write the transport cannot take at once, the
    last output, a stop string the daemon saw, errors, the tail."""
    srv = request.app[SRV]
    sse = SSE(request, srv.cfg.server.write_timeout_s)
    gen.streaming = True  # the TTFT split ends at the first frame written

    def direct(item: tuple[int, Any]) -> tuple[int, Any] | None:
        tag, o = item
        if not isinstance(o, (RequestOutput, TokenOutput)) or o.finished:
            return item
        d = gen.take(tag, o)
        if d is None:
            return None
        if d.finished:  # a stop string the daemon saw: this task sends the end
            return tag, d
        data = fmt.text_frame(d)
        if data and not sse.write_now(data):
            return tag, d
        srv.direct_outputs += 1
        return None

    try:
        try:
            loop = asyncio.get_running_loop()
            async for d in gen.deltas():
                for ch in fmt.chunks(d):
                    data = sse.frame(ch)
                    if sse.write_now(data):  # the common case, once per token: no timer, no check
                        continue
                    # A write that the client takes completes without suspending; one that suspends
                    # waits for the client, and the check scheduled here runs only then.
                    gen.sink.writing = True
                    check = loop.call_soon(gen.sink.check)
                    try:
                        await sse.send(data)
                    finally:
                        gen.sink.writing = False
                        check.cancel()
                gen.written(d.choice)
                if fmt.direct and sse.resp is not None:
                    gen.sink.direct = direct
        except APIError as e:
            if sse.resp is None:
                raise
            log.warning("stream %s ended with an error: %s", gen.id, e.message)
            if e.code == "client_too_slow":
                return await sse.cut(e)
            return await sse.close(e.body())
        for ch in fmt.tail():
            await sse.send(ch)
        return await sse.close()
    except ClientTooSlow:
        err = APIError(503, f"the client did not read its stream for {sse.timeout:g}s; the request was stopped",
                       code="client_too_slow")
        log.warning("stream %s: %s", gen.id, err.message)
        gen.close()
        if sse.resp is None:
            sse._drop()
            raise err from None
        return await sse.cut(err)
    finally:
        # `direct` holds the generation that holds the queue that holds `direct`: without this the
        # request's objects would wait for the collector instead of going as the route returns.
        gen.sink.direct = None


# ---- routes ---------------------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    srv, req = await admit(request, CompletionRequest)
    con = req.constraint()
    if con.tools is not None:
        raise APIError(400, "tools are for chat completions", param="tools", code="unsupported")
    p = req.prompt
    if isinstance(p, str):
        prompts = [await srv.aencode(p, True)]
    elif all(isinstance(x, str) for x in p):
        prompts = [await srv.aencode(x, True) for x in p]  # type: ignore[arg-type]
    elif all(isinstance(x, int) for x in p):
        prompts = [srv.check_ids(p)]  # type: ignore[arg-type]
    else:
        prompts = [srv.check_ids(x) for x in p]  # type: ignore[arg-type]
    gen = srv.generation(request)
    gen.id = "cmpl-" + gen.id
    for ids in prompts:
        budget = srv.budget(len(ids), req.max_tokens)
        for j in range(req.n):
            add_choice(gen, ids, sampling(srv, req, budget, j, con), con, j == 0)
    return await run_generation(request, srv, gen, req, _completion_format(srv, gen, req))


async def chat(request: web.Request) -> web.StreamResponse:
    srv, req = await admit(request, ChatRequest)
    tok = srv.need_tokenizer("chat", "messages")
    con = req.constraint()
    msgs = req.messages_dicts()
    extra: dict[str, Any] = {}
    if con.tools is not None:
        # A template that renders `tools` gets them; otherwise they are described in a system message.
        if "tools" in (tok.chat_template or ""):
            extra["tools"] = req.tools
        elif msgs and msgs[0]["role"] == "system":
            msgs[0] = {"role": "system", "content": msgs[0]["content"] + "\n\n" + tool_prompt(con.tool_defs)}
        else:
            msgs.insert(0, {"role": "system", "content": tool_prompt(con.tool_defs)})

    def encode() -> list[int]:
        try:
            return tok.encode_chat(msgs, add_generation_prompt=req.add_generation_prompt, **extra)
        except APIError:
            raise
        except Exception as e:
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None

    # Long conversations are tokenized off the event loop (a 1 MB prompt takes ~0.4 s).
    ids = await asyncio.to_thread(encode) if sum(len(m["content"]) for m in msgs) > 8192 else encode()
    budget = srv.budget(len(ids), req.max_completion_tokens or req.max_tokens)
    gen = srv.generation(request)
    gen.id = "chatcmpl-" + gen.id
    for j in range(req.n):
        add_choice(gen, ids, sampling(srv, req, budget, j, con), con, j == 0)
    return await run_generation(request, srv, gen, req, _chat_format(srv, gen, req, con))


async def run_generation(request: web.Request, srv: Server, gen: Generation, req: Any, fmt: Any) -> web.StreamResponse:
    srv.admit(len(gen.choices))
    srv.enter()
    srv.gens.add(gen)
    try:
        gen.submit()
        if req.stream:
            return await stream(request, gen, fmt)
        await gen.run()
        return web.json_response(fmt.full(), dumps=lambda o: json.dumps(o, ensure_ascii=False))
    finally:
        gen.close()  # aborts unfinished choices: the client left, or an error cut the request short
        srv.gens.discard(gen)
        srv.leave()


_PROBE = "\x00mleagle-text\x00"  # stands for the text while `content_frame` builds its fixed bytes


def _text_choice(index: int, key: str, text: str) -> dict[str, Any]:
    """A text chunk's choice: the chat delta (`key` "content") or a completion's text ("text")."""
    body: dict[str, Any] = {"delta": {"content": text}} if key == "content" else {"text": text}
    return {"index": index, **body, "logprobs": None, "finish_reason": None}


class _Format:
    """Per-endpoint response shapes: chunks per delta, the stream's tail, the full response. `direct`:
    a running delta's chunks are its content frame alone (`text_frame`), so the engine client's
    callback may write it (`stream`)."""

    direct: bool
    key: str  # the text's field in a chunk's choice: "content" (in the chat delta) or "text"

    def __init__(self, srv: Server, gen: Generation, req: Any, obj: str) -> None:
        self.srv, self.gen, self.req, self.obj = srv, gen, req, obj
        self.created = int(time.time())
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        self._fixed: dict[tuple[int, str], tuple[bytes, bytes]] = {}  # `content_frame`'s bytes around the text

    def head(self) -> dict[str, Any]:
        return {"id": self.gen.id, "object": self.obj, "created": self.created, "model": self.srv.model}

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        out = {**self.head(), "choices": [choice]}
        if self.include_usage:
            out["usage"] = _usage(self.gen) if self.continuous else None
        return out

    def content_frame(self, index: int, key: str, text: str) -> bytes:
        """The SSE frame of `chunk({"index": index, <delta>: text, "logprobs": None, "finish_reason":
        None})` for the chat delta (`key` "content") or a completion's text ("text"), where nothing else
        varies (no usage in chunks): the bytes around the text are built once per stream, so a token
        costs one string encode instead of a dict and its JSON (the daemon's loop pays this per token
        of every stream; tests/daemon/test_sse_frames.py checks it against `chunk`)."""
        fix = self._fixed.get((index, key))
        if fix is None:
            probe = self.chunk(_text_choice(index, key, _PROBE))
            pre, _, post = json.dumps(probe, ensure_ascii=False).partition(json.dumps(_PROBE))
            fix = self._fixed[(index, key)] = (f"data: {pre}".encode(), f"{post}\n\n".encode())
        # `encode_basestring` is what `json.dumps(text, ensure_ascii=False)` runs for a str, without
        # building a JSONEncoder per call (0.8 -> 0.1 us).
        return fix[0] + encode_basestring(text).encode() + fix[1]

    def text_frame(self, d: Delta) -> bytes:
        """A running delta's SSE bytes where `direct` holds (what `chunks` would give, without the list)."""
        return self.content_frame(d.choice.index, self.key, d.text) if d.text else b""

    def tail(self) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [{**self.head(), "choices": [], "usage": _usage(self.gen)}]


class _completion_format(_Format):
    key = "text"

    def __init__(self, srv: Server, gen: Generation, req: CompletionRequest) -> None:
        super().__init__(srv, gen, req, "text_completion")
        self.offsets = [0] * len(gen.choices)
        self.direct = len(gen.choices) == 1 and req.logprobs is None and not self.continuous

    def _lp(self, c: Choice, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        out = completion_logprobs(self.srv, lps, self.offsets[c.index])
        if lps:
            self.offsets[c.index] = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    def _choice(self, c: Choice, text: str, lps: list[TokenLogprob], finish: str | None) -> dict[str, Any]:
        ch: dict[str, Any] = {"index": c.index, "text": text, "logprobs": self._lp(c, lps), "finish_reason": finish}
        if finish is not None:
            ch["stop_reason"] = c.matched_stop
            if self.req.spec_stats:
                ch["spec_stats"] = spec_stats(c)
        return ch

    def chunks(self, d: Delta) -> list[dict[str, Any] | bytes]:
        if not d.text and not d.finished and not (d.logprobs and self.req.logprobs is not None):
            return []
        if not d.finished and self.req.logprobs is None and not self.continuous:
            return [self.content_frame(d.choice.index, self.key, d.text)]
        return [self.chunk(self._choice(d.choice, d.text, d.logprobs, d.choice.finish_reason if d.finished else None))]

    def full(self) -> dict[str, Any]:
        out = {**self.head(), "choices": [self._choice(c, c.text, c.logprobs, c.finish_reason) for c in self.gen.choices],
               "usage": _usage(self.gen)}
        return out


class _chat_format(_Format):
    key = "content"

    def __init__(self, srv: Server, gen: Generation, req: ChatRequest, con: Constraint | None = None) -> None:
        super().__init__(srv, gen, req, "chat.completion.chunk")
        self.started: set[int] = set()
        self.tools = con.tools if con is not None else None
        self.direct = len(gen.choices) == 1 and not req.logprobs and not self.continuous and self.tools is None

    def _lp(self, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        return chat_logprobs(self.srv, lps) if self.req.logprobs else None

    def _finish_reason(self, c: Choice) -> str | None:
        # A forced tool call that completed is a call (OpenAI's "tool_calls"); a cut one stays "length".
        return "tool_calls" if self.tools is not None and c.finish_reason == "stop" else c.finish_reason

    def chunks(self, d: Delta) -> list[dict[str, Any] | bytes]:
        c = d.choice
        out: list[dict[str, Any] | bytes] = []
        if c.index not in self.started:
            self.started.add(c.index)
            out.append(self.chunk({"index": c.index, "delta": {"role": "assistant", "content": "" if self.tools is None else None},
                                   "logprobs": None, "finish_reason": None}))
        if self.tools is not None:
            # A tool call streams as one delta once its arguments are complete (they are parsed first).
            if d.finished:
                calls = [{"index": k, **tc} for k, tc in enumerate(tool_calls(self.tools, c.text))]
                out.append(self.chunk({"index": c.index, "delta": {"tool_calls": calls}, "logprobs": None,
                                       "finish_reason": None}))
        elif d.text and not self.req.logprobs and not self.continuous:
            out.append(self.content_frame(c.index, self.key, d.text))
        elif d.text or (d.logprobs and self.req.logprobs):
            out.append(self.chunk({"index": c.index, "delta": {"content": d.text}, "logprobs": self._lp(d.logprobs),
                                   "finish_reason": None}))
        if d.finished:
            fin: dict[str, Any] = {"index": c.index, "delta": {}, "logprobs": None,
                                   "finish_reason": self._finish_reason(c), "stop_reason": c.matched_stop}
            if self.req.spec_stats:
                fin["spec_stats"] = spec_stats(c)
            out.append(self.chunk(fin))
        return out

    def full(self) -> dict[str, Any]:
        choices = []
        for c in self.gen.choices:
            msg: dict[str, Any] = {"role": "assistant", "content": c.text}
            if self.tools is not None:
                msg = {"role": "assistant", "content": None, "tool_calls": tool_calls(self.tools, c.text)}
            ch: dict[str, Any] = {"index": c.index, "message": msg,
                                  "logprobs": self._lp(c.logprobs), "finish_reason": self._finish_reason(c),
                                  "stop_reason": c.matched_stop}
            if self.req.spec_stats:
                ch["spec_stats"] = spec_stats(c)
            choices.append(ch)
        return {**self.head(), "object": "chat.completion", "choices": choices, "usage": _usage(self.gen)}


async def generate(request: web.Request) -> web.StreamResponse:
    """Native endpoint: `{"text" | "input_ids", "sampling_params": {...}, "stream"}`."""
    srv, req = await admit(request, GenerateRequest)
    ids = await srv.aencode(req.text, True) if req.text is not None else srv.check_ids(req.input_ids or [])
    sp = dict(req.sampling_params)
    try:
        params = SamplingParams.model_validate(sp)
    except ValidationError as e:
        err = from_validation(e)
        err.param = f"sampling_params.{err.param}" if err.param else "sampling_params"
        raise err from None
    params.max_new_tokens = srv.budget(len(ids), params.max_new_tokens if "max_new_tokens" in sp else None)
    params.min_new_tokens = min(params.min_new_tokens, params.max_new_tokens)
    srv.check_stops(params, "sampling_params.stop")
    gen = srv.generation(request)
    if req.rid:
        gen.id = req.rid  # names the response only; the engine gets an id of the daemon's own
    c0 = gen.add(ids, params)
    c0.param_prefix = "sampling_params."
    if params.structured_outputs is not None:
        c0.constraint_field = f"sampling_params.structured_outputs.{params.structured_outputs.kind}"

    def meta(c: Choice) -> dict[str, Any]:
        m: dict[str, Any] = {"id": gen.id, "prompt_tokens": len(ids), "completion_tokens": c.num_output_tokens,
                             "cached_tokens": c.num_cached_tokens, "finish_reason": c.finish_reason,
                             "matched_stop": c.matched_stop}
        if req.spec_stats:
            m["spec"] = spec_stats(c)
        return m

    def one(x: TokenLogprob | None) -> list[Any] | None:
        return None if x is None else [x.token_id, x.logprob, [list(t) for t in x.top]]

    def lp(lps: list[TokenLogprob]) -> list[Any] | None:
        return [one(x) for x in lps] if params.logprobs is not None else None

    def plp(lps: list[TokenLogprob | None] | None) -> dict[str, Any]:
        # prompt_logprobs: one entry per prompt token, [id, logprob, top] (None for the first token)
        return {"prompt_logprobs": [one(x) for x in lps or []]} if params.prompt_logprobs is not None else {}

    class fmt:
        direct = False  # a chunk per delta as a dict: the route's task writes them all

        @staticmethod
        def chunks(d: Delta) -> list[dict[str, Any] | bytes]:
            return [{"text": d.text, "token_ids": d.token_ids, "logprobs": lp(d.logprobs), "finished": d.finished,
                     "meta_info": meta(d.choice) if d.finished else None,
                     **(plp(d.prompt_logprobs) if d.prompt_logprobs is not None else {})}]

        @staticmethod
        def tail() -> list[dict[str, Any]]:
            return []

        @staticmethod
        def full() -> dict[str, Any]:
            return {"text": c0.text, "token_ids": c0.token_ids, "logprobs": lp(c0.logprobs), **plp(c0.prompt_logprobs),
                    "meta_info": meta(c0)}

    return await run_generation(request, srv, gen, req, fmt)


async def models(request: web.Request) -> web.Response:
    srv = request.app[SRV]
    info = srv.client.info
    return web.json_response({"object": "list", "data": [{
        "id": srv.model, "object": "model", "created": int(time.time()), "owned_by": "mleagle",
        "root": srv.cfg.model.name, "max_model_len": info.max_context_len if info else None,
    }]})


async def health(request: web.Request) -> web.Response:
    srv = request.app[SRV]
    c = srv.client
    status = "draining" if srv.draining else c.state
    body = {"status": "ok" if status == "ready" else status, "engine": c.state, "model": srv.model,
            "error": c.error, "restarts": c.restarts, "inflight": c.num_inflight}
    return web.json_response(body, status=200 if status == "ready" else 503)


async def metrics(request: web.Request) -> web.Response:
    srv = request.app[SRV]
    if srv.client.state == "ready":
        try:
            await srv.client.ping(timeout=2.0)  # fresh pool usage: the pong handler updates the gauges
        except (EngineUnavailable, asyncio.TimeoutError):
            pass
    srv._set_queue_gauges(srv.client.last_pong.stats if srv.client.last_pong else None)
    return web.Response(body=srv.metrics.render(), content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


async def debug_engine(request: web.Request) -> web.Response:
    srv = request.app[SRV]
    c = srv.client
    body: dict[str, Any] = {"state": c.state, "pid": c.engine_pid, "restarts": c.restarts, "error": c.error,
                            "inflight": c.num_inflight, "active_http": srv.active,
                            "daemon": {"pid": os.getpid(), "torch_loaded": "torch" in sys.modules,
                                       "max_rss_mb": peak_rss_mb(), "cpu_s": time.process_time(),
                                       "direct_outputs": srv.direct_outputs, "coalesced": c.coalesced,
                                       "spins": srv.spins, "spin_idle_s": srv.spin_idle_s,
                                       "rehearsals": srv.rehearsals,
                                       "gc": srv.gc.snapshot()}}
    since = request.query.get("phases_since")
    if since is not None:  # the TTFT splits of the requests after the one numbered `since`
        try:
            body["daemon"]["ttft_phases"] = srv.metrics.phases.since(int(since))
        except ValueError:
            raise APIError(400, "phases_since must be an integer", param="phases_since") from None
    if c.state == "ready":
        try:
            p = await c.ping(timeout=5.0)
            body.update(num_requests=p.num_requests, pool_usage=p.pool_usage, stats=p.stats,
                        engine_max_rss_mb=p.max_rss_mb)
        except (EngineUnavailable, asyncio.TimeoutError) as e:
            body["ping_error"] = str(e) or type(e).__name__
    return web.json_response(body)


# ---- middleware and app -------------------------------------------------------------------------


def _route_name(request: web.Request) -> str:
    info = request.match_info
    r = info.route.resource if info.route is not None else None
    return r.canonical if r is not None else "unmatched"


def _http_error(e: web.HTTPException) -> APIError:
    if e.status == 404:
        return APIError(404, "no such route", code="not_found")
    if e.status == 405:
        return APIError(405, "method not allowed for this path", code="method_not_allowed")
    if e.status == 413:
        return APIError(413, "request body too large", code="body_too_large")
    return APIError(e.status, (e.text or e.reason or "HTTP error").strip())


def _authorized(request: web.Request, key: bytes) -> bool:
    """Constant-time check of `Authorization: Bearer <key>`, on bytes: aiohttp keeps a header's raw
    bytes as surrogate escapes, so a header that is not UTF-8 is compared as what it is (and fails)."""
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    try:
        raw = token.strip().encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # not a byte a client could have sent
        return False
    return scheme.lower() == "bearer" and hmac.compare_digest(raw, key)


def _single_authorization(request: web.Request) -> None:
    """Refuse a request that carries `Authorization` more than once: this server would read one and a
    proxy in front of it may have checked another, so neither answer could be trusted. 400 (a
    malformed request, like a header line the parser refuses), not 401: the client sent a request no
    key could make right."""
    n = len(request.headers.getall("Authorization", []))
    if n > 1:
        raise APIError(400, f"the Authorization header appears {n} times; send it once",
                       code="duplicate_authorization", headers={"Connection": "close"})


async def _finish(request: web.Request, resp: web.StreamResponse, timeout: float) -> None:
    """Write a plain response under the write timeout; a client that does not read it is dropped."""
    try:
        await asyncio.wait_for(resp.prepare(request), timeout)
        await asyncio.wait_for(resp.write_eof(), timeout)
    except asyncio.TimeoutError:
        log.warning("%s %s: the client did not read its response for %gs; dropped", request.method, request.path,
                    timeout)
        resp.force_close()
        if request.transport is not None:
            request.transport.abort()


@web.middleware
async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    srv = request.app[SRV]
    key = srv.api_key
    try:
        if key is not None and request.path not in PUBLIC:
            _single_authorization(request)
        if key is not None and request.path not in PUBLIC and not _authorized(request, key):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        resp = await handler(request)
    except APIError as e:
        resp = e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = _http_error(e).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        rid = uuid.uuid4().hex[:8]
        log.exception("unhandled error [%s] on %s %s", rid, request.method, request.path)
        resp = APIError(500, f"internal server error (ref {rid})").response()
    srv.metrics.http.labels(_route_name(request), str(resp.status)).inc()
    if resp.status == 408 or resp.headers.get("Connection") == "close":
        # The rest of the body may still come (408), or the stream is broken (a body that cannot be
        # decoded): do not read what follows as a next request.
        resp.force_close()
    if isinstance(resp, web.Response) and not resp.prepared:
        await _finish(request, resp, srv.cfg.server.write_timeout_s)
    return resp


def create_app(cfg: MleagleConfig, *, on_fatal: Callable[[int], None] | None = None,
               start_engine: bool = True) -> web.Application:
    # client_max_size is the hard cap aiohttp enforces while reading; read_json turns it into a 413.
    app = web.Application(middlewares=[middleware], client_max_size=cfg.server.max_body_bytes)
    srv = Server(cfg, on_fatal)
    app[SRV] = srv
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/engine", debug_engine)
    app.router.add_get("/v1/events", srv.events.handle)

    async def on_startup(app: web.Application) -> None:
        if not start_engine:
            return

        async def boot() -> None:
            try:
                await srv.client.start()
            except Exception as e:
                log.error("the engine failed to start: %s", e)
                srv._fatal(1)
                return
            # What start-up built (aiohttp, pydantic's schemas, the tokenizer the engine handed over)
            # lives as long as the daemon: out of the collector's reach, a full collection walks only
            # what serving allocates (the engine process does the same; `gc_watch`).
            srv.gc.frozen = freeze()

        srv._start_task = asyncio.create_task(boot())
        srv.events.start()

    async def on_cleanup(app: web.Application) -> None:
        srv.events.stop()
        srv.gc.remove()
        if srv.spinner is not None:
            srv.spinner.cancel()
        if srv._start_task is not None and not srv._start_task.done():
            srv._start_task.cancel()
        await srv.client.stop(timeout=10.0)

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
