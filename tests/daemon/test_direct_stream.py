"""The streaming path that runs from the engine client's callback (`stream`'s direct path), on the
daemon's real app and a real loopback socket, with the engine process replaced by a script: what the
daemon sends the engine is recorded, and the script's messages enter through the engine client's
message handler, as its socket reader delivers them. So the text, the timing of each output and the
client's behaviour are exact: a stream taken over by the callback and ended by a stop string that only
the daemon saw, a client that reads fast and then stalls (cut with `client_too_slow` as before), n=2
choices interleaved, an engine error and a client that leaves mid-stream, a malformed engine message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from mleagle.daemon.server import REHEARSE_EVERY_S, SRV, Server, create_app
from mleagle.engine.contract.config import load_config
from mleagle.engine.contract.outputs import RequestOutput
from mleagle.engine.contract.protocol import AbortRequest, AddRequest, Outputs, Pong, Ready, encode
from mleagle.engine.contract.tokenizer import Tokenizer
from tests.daemon_helpers import sse_events


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer.from_source(load_config("smollm2-135m").model)
    assert t is not None
    return t


class Scripted:
    """The daemon's app served in this process, its engine a script (`emit`) and a record (`sent`)."""

    def __init__(self, srv: Server, url: str) -> None:
        self.srv, self.url = srv, url
        self.sent: list[Any] = []
        srv.client._send = self.sent.append  # type: ignore[method-assign]  # the engine's request socket

    async def added(self, k: int = 1) -> list[str]:
        """The engine request ids of the first `k` requests the daemon submitted, once it has."""
        while len(adds := [m.rid for m in self.sent if isinstance(m, AddRequest)]) < k:
            await asyncio.sleep(0.005)
        return adds

    def aborted(self) -> set[str]:
        return {m.rid for m in self.sent if isinstance(m, AbortRequest)}

    def emit_behind(self, *steps: list[RequestOutput] | bytes) -> None:
        """Several engine steps (each a list of outputs, or a message already encoded) read in one
        callback, as the socket reader delivers them when the daemon's loop fell behind."""
        msgs = [m if isinstance(m, bytes) else encode(Outputs.of(m)) for m in steps]
        asyncio.get_running_loop().call_soon(self.srv.client._on_msgs, self.srv.client.gen, msgs)

    def emit(self, *outs: RequestOutput | bytes) -> None:
        """One engine step per argument, all in one callback, each read on its own (a daemon keeping up)."""
        msgs = [o if isinstance(o, bytes) else encode(Outputs.of([o])) for o in outs]
        c = self.srv.client
        asyncio.get_running_loop().call_soon(lambda: [c._on_msgs(c.gen, [m]) for m in msgs])  # type: ignore[arg-type]


@pytest.fixture
async def eng(tok: Tokenizer) -> AsyncIterator[Scripted]:
    cfg = load_config("tiny-dummy")
    cfg.server.stream_buffer_tokens = 64
    app = create_app(cfg, start_engine=False)
    srv = app[SRV]
    c = srv.client
    c.info = Ready(model_name="tiny-dummy", max_context_len=4096, pid=os.getpid(), vocab_size=tok.vocab_size)
    c.tokenizer = tok
    c.state = "ready"
    runner = web.AppRunner(app, handler_cancellation=True)  # as the daemon runs it
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    yield Scripted(srv, f"http://127.0.0.1:{sock.getsockname()[1]}")
    await runner.cleanup()


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))  # a hang fails, not a timer


def out(rid: str, ids: list[int], finished: bool = False, reason: str | None = None, **kw: Any) -> RequestOutput:
    return RequestOutput(rid=rid, token_ids=ids, finished=finished, finish_reason=reason, **kw)


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": {"include_usage": True},
            **kw}


def text_of(e: dict[str, Any] | None) -> str:
    ch = e["choices"][0] if e and e.get("choices") else {}
    return (ch["delta"].get("content") if "delta" in ch else ch.get("text")) or ""


async def started(eng: Scripted, s: aiohttp.ClientSession, first: int, k: int = 1) -> tuple[str, AsyncIterator[Any]]:
    """A streamed chat request sent, the `k`-th the daemon submitted: its engine request id and its
    events, read up to the first with text (the engine's first output, token `first`, sent)."""
    req = asyncio.ensure_future(s.post(eng.url + "/v1/chat/completions", json=chat()))
    rid = (await eng.added(k))[k - 1]
    eng.emit(out(rid, [first]))
    it = sse_events((await req).content)
    await first_text(it)
    return rid, it


async def first_text(it: AsyncIterator[Any]) -> list[Any]:
    """The events up to the first that carries text: the response is under way, its route waits."""
    events = [await it.__anext__()]
    while not text_of(events[-1]):
        events.append(await it.__anext__())
    return events


async def test_stop_string_the_daemon_sees_in_the_callback_ends_the_stream_and_aborts(eng: Scripted, tok: Tokenizer) -> None:
    """The first output goes out through the route's task (the response starts there); the others are
    written by the callback. The daemon's stop string completes in one of those: the choice ends there
    (text before the stop, finish_reason "stop", usage, [DONE]) and its engine request is aborted."""
    ids = tok.encode("Hello world, this is a STOP and nothing after it", add_special_tokens=False)
    upto = next(k for k in range(len(ids)) if "STOP" in tok.decode(ids[:k]))  # the token that completes it
    async with session() as s:
        req = asyncio.ensure_future(s.post(eng.url + "/v1/chat/completions", json=chat(stop=["STOP"])))
        rid = (await eng.added())[0]
        eng.emit(out(rid, ids[:1]))  # the response's headers go out with the first delta
        r = await req
        assert r.status == 200
        it = sse_events(r.content)
        events = await first_text(it)
        eng.emit(*(out(rid, [i]) for i in ids[1:]))  # the engine does not act on the stop string
        events += [e async for e in it]
    assert events[-1] is None
    assert "".join(map(text_of, events)) == "Hello world, this is a "
    fins = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
    assert fins[-1] == "stop" and fins.count("stop") == 1
    assert events[-2]["usage"]["completion_tokens"] == upto
    assert eng.aborted() == {rid}
    assert eng.srv.direct_outputs > 0  # the callback wrote frames


async def test_a_client_that_reads_fast_then_stalls_is_cut(eng: Scripted, tok: Tokenizer) -> None:
    """A single-choice stream (the callback's case) whose client reads its first frames and then stops
    reading, on a socket with a tiny receive buffer: once the kernel's buffers and the transport's are
    full, the route's task holds the writes, more than `stream_buffer_tokens` wait, and the request is
    aborted; the client then reads what was produced, a `client_too_slow` error event and [DONE]."""
    hashes = tok.encode("#" * 80, add_special_tokens=False)
    assert len(hashes) == 1
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    host, port = eng.url.removeprefix("http://").split(":")
    await loop.sock_connect(sock, (host, int(port)))
    body = json.dumps({"prompt": "hi", "stream": True, "max_tokens": 4000}).encode()
    await loop.sock_sendall(sock, f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    rid = (await eng.added())[0]
    data = b""
    try:
        for _ in range(3):  # a fast client: each frame read as it comes
            eng.emit(out(rid, hashes * 16))
            while data.count(b"data: ") < _ + 1:
                data += await loop.sock_recv(sock, 65536)
        emitted = 3
        while rid not in eng.aborted():  # the client reads nothing more: the engine steps on until cut
            assert emitted < 100_000, "never cut"
            eng.emit(out(rid, hashes * 16))
            emitted += 1
            await asyncio.sleep(0)
        while chunk := await loop.sock_recv(sock, 1 << 16):
            data += chunk
    finally:
        sock.close()
    events = [ln[6:] for ln in data.decode().splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["error"]["code"] == "client_too_slow"
    got = sum(map(len, map(text_of, map(json.loads, events[:-2])))) // 80
    assert got == emitted * 16  # what the engine produced before the cut, then the error
    assert eng.srv.direct_outputs > 3  # it had gone through the callback while the client read


async def test_n2_choices_interleave(eng: Scripted, tok: Tokenizer) -> None:
    """n=2 (the route's task writes every delta): the choices' outputs come interleaved and unevenly,
    each choice's text and end arrive whole under its own index."""
    texts = ["The first choice says this.", "And the second one, something else entirely!"]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    async with session() as s:
        req = asyncio.ensure_future(s.post(eng.url + "/v1/chat/completions", json=chat(n=2)))
        rids = await eng.added(2)
        steps: list[RequestOutput] = []
        for k in range(max(map(len, ids))):
            for c in (0, 1):
                if k < len(ids[c]):
                    last = k == len(ids[c]) - 1
                    steps.append(out(rids[c], ids[c][k: k + 1], last, "length" if last else None))
        eng.emit(*steps[:3])
        r = await req
        eng.emit(*steps[3:])
        events = [e async for e in sse_events(r.content)]
    assert events[-1] is None and events[-2]["usage"]["completion_tokens"] == sum(map(len, ids))
    for c in (0, 1):
        mine = [e["choices"][0] for e in events[:-2] if e["choices"][0]["index"] == c]
        assert "".join(ch["delta"].get("content") or "" for ch in mine) == texts[c]
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["length"]


async def test_engine_error_after_direct_frames(eng: Scripted, tok: Tokenizer) -> None:
    """Outputs the callback wrote, then the engine fails the request: the error event and [DONE]."""
    ids = tok.encode("Some words first", add_special_tokens=False)
    async with session() as s:
        req = asyncio.ensure_future(s.post(eng.url + "/v1/completions", json={"prompt": "hi", "stream": True}))
        rid = (await eng.added())[0]
        eng.emit(out(rid, ids[:1]))
        it = sse_events((await req).content)
        events = await first_text(it)
        eng.emit(*(out(rid, [i]) for i in ids[1:]), out(rid, [], True, "error", error="the step failed"))
        events += [e async for e in it]
    assert events[-1] is None and events[-2]["error"]["message"] == "the step failed"
    assert "Some words first".startswith("".join(map(text_of, events))) and text_of(events[1])
    assert eng.srv.direct_outputs == len(ids) - 1


async def test_a_client_that_leaves_mid_stream_aborts_its_request(eng: Scripted, tok: Tokenizer) -> None:
    """The callback streams; the client goes away; the route's task is cancelled and aborts the request
    while the callback meets a closed transport."""
    ids = tok.encode("one two three four", add_special_tokens=False)
    async with session() as s:
        rid, it = await started(eng, s, ids[0])
        eng.emit(*(out(rid, [i]) for i in ids[1:]))
        while "three" not in text_of(await it.__anext__()):
            pass
    for _ in range(10_000):  # the engine steps on until the abort arrives
        if rid in eng.aborted():
            break
        eng.emit(out(rid, ids[:1]))
        await asyncio.sleep(0.001)
    assert rid in eng.aborted() and eng.srv.direct_outputs >= 2
    assert not eng.srv.gens  # the route is gone


async def test_a_malformed_engine_message_is_dropped_with_a_log_line(eng: Scripted, tok: Tokenizer,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    ids = tok.encode("still fine", add_special_tokens=False)
    async with session() as s:
        req = asyncio.ensure_future(s.post(eng.url + "/v1/completions", json={"prompt": "hi", "stream": True}))
        rid = (await eng.added())[0]
        with caplog.at_level(logging.ERROR, "mleagle.daemon.engine"):
            eng.emit(out(rid, ids[:1]),
                     b'{"type":"outputs","outputs":[{"rid":"%s","token_ids":["x"]}]}' % rid.encode(),
                     b'{"type":"outputs","outputs":[{"rid":"%s","token_ids":[1],"finished":"maybe"}]}' % rid.encode(),
                     b'{"type":"outputs","tokens":[["%s",[1],0,"x",0]]}' % rid.encode(),
                     b'{"type":"outputs","tokens":[["%s",[1]]]}' % rid.encode(), b"not json", b'{"type":"outputs","x":1}',
                     *(out(rid, [i]) for i in ids[1:]), out(rid, [], True, "length"))
            events = [e async for e in sse_events((await req).content)]
    assert "".join(map(text_of, events)) == "still fine" and events[-1] is None
    assert sum("dropped a malformed engine message" in m for m in caplog.messages) == 6


@pytest.mark.parametrize("device", ["cuda", "cpu"])
async def test_the_loop_spins_beside_a_gpu_engine_only(eng: Scripted, tok: Tokenizer, device: str) -> None:
    """`server.spin_ms`: beside a GPU engine the daemon's loop keeps polling while a request is in
    flight and for the window after it ends, then sleeps again (the spinner is gone, its count still);
    beside a CPU engine it never spins (that engine's forwards need the cores). The time its passes
    found nothing to do is counted apart (`spin_idle_s`: polling, not work), never more than the wall,
    and in it the intake path is rehearsed on a throwaway request every `REHEARSE_EVERY_S` (`rehearse`)."""
    srv = eng.srv
    srv.spin_s = 0.2
    srv.client.info = srv.client.info.model_copy(update={"device": device})  # type: ignore[union-attr]
    ids = tok.encode("two words", add_special_tokens=False)
    async with session() as s:
        req = asyncio.ensure_future(s.post(eng.url + "/v1/completions", json={"prompt": "hi", "stream": True}))
        rid = (await eng.added())[0]
        idle0, rehearsed0, t0 = srv.spin_idle_s, srv.rehearsals, time.monotonic()
        await asyncio.sleep(0.05)  # the request waits for its first token: the loop has nothing to do
        idle, rehearsed, waited = srv.spin_idle_s - idle0, srv.rehearsals - rehearsed0, time.monotonic() - t0
        during = srv.spins
        eng.emit(*(out(rid, [i]) for i in ids), out(rid, [], True, "length"))
        _ = [e async for e in sse_events((await req).content)]
    if device == "cpu":
        assert srv.spins == 0 and srv.spinner is None and srv.spin_idle_s == 0.0 and srv.rehearsals == 0
        return
    assert during > 10
    assert 0.2 * waited < idle <= waited, (idle, waited)
    # 50 ms with nothing to do: a rehearsal every 2 ms, less what the machine's load takes
    assert 5 <= rehearsed <= waited / REHEARSE_EVERY_S + 1, rehearsed
    await asyncio.sleep(0.05)  # inside the window after the request: still polling
    assert srv.spinner is not None and srv.spins > during
    await asyncio.sleep(0.3)  # past it
    assert srv.spinner is None
    n = srv.spins
    await asyncio.sleep(0.05)
    assert srv.spins == n


async def test_a_rehearsal_leaves_nothing_behind(eng: Scripted) -> None:
    """`Server.rehearse` (the spin's warm-up of the intake path) sends the engine nothing, counts no
    request or token in the metrics, and leaves nothing for the collector: every object it built goes
    as it returns."""
    import gc

    srv = eng.srv
    before = srv.metrics.render()
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            srv.rehearse()
        left = gc.collect()
    finally:
        gc.enable()
    assert srv.rehearsals == 3 and left == 0
    assert srv.metrics.render() == before
    await asyncio.sleep(0.05)
    assert eng.sent == []


async def test_steps_read_together_reach_a_stream_as_one_frame(eng: Scripted, tok: Tokenizer) -> None:
    """A daemon that fell behind reads several engine steps in one callback: a request's token-only
    deltas of consecutive steps go out as one frame (one write), with every token's text, in order;
    a whole output of the request (its end) and any other message (a pong) still come after the tokens
    before them; two streams are merged each on its own."""
    a_ids = tok.encode("one two three four five six", add_special_tokens=False)
    b_ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    assert len(a_ids) >= 6 and len(b_ids) >= 3
    async with session() as s:
        reqs = [asyncio.ensure_future(s.post(eng.url + "/v1/completions", json={"prompt": p, "stream": True}))
                for p in ("a", "b")]
        a, b = await eng.added(2)
        eng.emit(out(a, a_ids[:1]), out(b, b_ids[:1]))  # the responses start (their headers go out)
        its = [sse_events((await r).content) for r in reqs]
        firsts = [await first_text(it) for it in its]
        before = eng.srv.client.coalesced
        pong = encode(Pong(seq=1))
        eng.emit_behind([out(a, a_ids[1:2]), out(b, b_ids[1:2])], [out(a, a_ids[2:3])], [out(a, a_ids[3:4])],
                        pong, [out(a, a_ids[4:5])], [out(b, b_ids[2:], True, "length")])
        a_next = await its[0].__anext__()
        b_rest = [e async for e in its[1]]
        assert eng.srv.client.coalesced - before == 2  # a's steps 2 and 3 merged into step 1's delta
        scrape = eng.srv.metrics.render().decode()
        assert f"mleagle:daemon_coalesced_deltas_total {float(eng.srv.client.coalesced)}" in scrape
        eng.emit(out(a, a_ids[5:], True, "length"))
        a_rest = [e async for e in its[0]]
    # a: the three steps before the pong in one frame, then the step after it, then the end.
    assert text_of(a_next) == tok.decode(a_ids[1:4])
    a_events = [*firsts[0], a_next, *a_rest]
    assert "".join(map(text_of, a_events)) == tok.decode(a_ids) and a_events[-1] is None
    assert [text_of(e) for e in a_rest[:1]] == [tok.decode(a_ids[4:5])]
    # b: its token delta, then its last output (a whole one: not merged, after the tokens before it).
    b_events = [*firsts[1], *b_rest]
    assert "".join(map(text_of, b_events)) == tok.decode(b_ids) and b_events[-1] is None
    assert text_of(b_rest[0]) == tok.decode(b_ids[1:2])


async def test_a_first_delta_reaches_its_route_before_the_running_streams_frames() -> None:
    """A batch with a new request's first delta and the running streams' tokens: the first delta is in
    its route's queue when the reader's callback returns, with the step's marks added, while the
    others come in a callback of their own after the woken route has run (so its headers and first
    frame do not wait behind every running stream's write); everything arrives, each stream in
    order. A batch without a first delta is handled at once."""
    from mleagle.daemon.engine_client import EngineClient, _Req

    c = EngineClient(load_config("tiny-dummy"))
    sinks: dict[str, asyncio.Queue[tuple[int, Any]]] = {r: asyncio.Queue() for r in ("run1", "run2", "new")}
    for k, (r, q) in enumerate(sinks.items()):
        c.reqs[r] = _Req(q, k)
    first = out("new", [7], timing=[1.0, 2.0, 3.0])
    step = Outputs.of([out("run1", [1]), out("run2", [2]), first])
    step.sent = 4.0
    later = Outputs.of([out("run1", [5]), out("new", [8])])
    c._on_msgs(c.gen, [encode(step), encode(later)])  # type: ignore[arg-type]
    assert sinks["new"].qsize() == 1 and sinks["run1"].empty() and sinks["run2"].empty()
    o = sinks["new"].get_nowait()[1]
    assert o.token_ids == [7] and o.timing[:4] == [1.0, 2.0, 3.0, 4.0] and len(o.timing) == 5
    await asyncio.sleep(0)  # the deferred part
    got: dict[str, list[list[int]]] = {r: [] for r in sinks}
    for r, q in sinks.items():
        while not q.empty():
            got[r].append(q.get_nowait()[1].token_ids)
    assert got == {"run1": [[1, 5]], "run2": [[2]], "new": [[8]]}  # run1's two steps merged
    c._on_msgs(c.gen, [encode(Outputs.of([out("run2", [3])]))])  # type: ignore[arg-type]
    assert sinks["run2"].get_nowait()[1].token_ids == [3]
    # A batch that comes before the deferred rest of the one before it has run (the reader's next
    # callback in the same pass of the loop) handles that rest first: no stream's tokens overtake.
    c.reqs["new2"] = _Req(asyncio.Queue(), 9)
    c._on_msgs(c.gen, [encode(Outputs.of([out("run1", [10]), out("new2", [1], timing=[1.0, 2.0, 3.0])]))])  # type: ignore[arg-type]
    c._on_msgs(c.gen, [encode(Outputs.of([out("run1", [11])]))])  # type: ignore[arg-type]
    assert [sinks["run1"].get_nowait()[1].token_ids for _ in range(2)] == [[10], [11]]
    await asyncio.sleep(0)  # the first batch's callback finds nothing left to do
    assert sinks["run1"].empty()


async def test_a_finished_request_leaves_nothing_for_the_collector(eng: Scripted, tok: Tokenizer) -> None:
    """With the cyclic collector off, every request's objects go as its route returns, whatever way it
    ended (a stream the callback wrote, n=2 through the route's task, a whole response, a client that
    left mid-stream): the generation and its queue form no cycle (the queue's overflow callback and the
    route's direct writer would each close one), so a collection on the loop every stream shares has no
    per-request garbage to walk."""
    import gc

    from mleagle.daemon.generation import Generation, OutputQueue

    ids = tok.encode("a few words here", add_special_tokens=False)
    gc.collect()
    gc.disable()
    try:
        async with session() as s:
            # streamed, through the callback, to its end
            rid, it = await started(eng, s, ids[0])
            eng.emit(*(out(rid, [i]) for i in ids[1:-1]), out(rid, ids[-1:], True, "length"))
            assert [e async for e in it][-1] is None
            # n=2, and a whole (unstreamed) response
            req = asyncio.ensure_future(s.post(eng.url + "/v1/chat/completions", json=chat(n=2)))
            a, b = (await eng.added(3))[1:]
            eng.emit(out(a, ids, True, "length"), out(b, ids, True, "length"))
            assert [e async for e in sse_events((await req).content)][-1] is None
            req = asyncio.ensure_future(s.post(eng.url + "/v1/completions", json={"prompt": "hi"}))
            c = (await eng.added(4))[3]
            eng.emit(out(c, ids, True, "length"))
            assert (await (await req).json())["choices"][0]["text"] == tok.decode(ids)
            # a client that leaves mid-stream
            d, it = await started(eng, s, ids[0], k=5)
            eng.emit(out(d, ids[1:2]))
            await it.__anext__()
        for _ in range(1000):  # the last route learns that its client left
            if d in eng.aborted() and not eng.srv.gens:
                break
            await asyncio.sleep(0.005)
        assert d in eng.aborted() and not eng.srv.gens
        eng.emit(out(d, [], True, "abort"))  # the engine's answer to the abort: the client forgets the request
        await asyncio.sleep(0.05)  # the handlers' tasks finish
        # type(), not isinstance: isinstance reads `__class__`, which warns on torch's deprecated aliases
        left = [o for o in gc.get_objects() if type(o) in (Generation, OutputQueue)]
        assert not left, f"{len(left)} generations or queues kept alive only by a cycle"
    finally:
        gc.enable()
