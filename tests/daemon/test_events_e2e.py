"""State events end to end on the CPU: a real `mleagle serve` (tiny-dummy target, `--draft random:2`,
API key on) whose `GET /v1/events` WebSocket is subscribed with aiohttp while concurrent native
`/generate` requests run (some with logprobs, one streamed and dropped early by its client). The
stream must start with a snapshot, validate event by event against the schema, carry batch, pool,
logprob-metadata and acceptance events, show every pool of every runner (target, draft0, draft1) free
again once the requests end, and report logprob metadata that agrees with the logit rows in each mode
(EXTEND, TARGET_VERIFY, DRAFT_EXTEND). The route is behind the key and validates its type filter.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import aiohttp
import pytest

from mleagle.engine.contract.events import EVENT_TYPES, LogprobMetaEvent, PoolEvent, RequestEvent, parse_event
from tests.daemon_helpers import ServerProc

KEY = "events-key"
RUNNERS = {"target", "draft0", "draft1"}
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def srv():
    # Token ids and logprobs in request events are opt-in (another user's output): this test opts in.
    # At full depth every iteration: the acceptance events this test reads come from verify steps.
    # One sampled step a minute while nobody watches: however slow a loaded machine's steps, a request
    # of many steps leaves some out.
    s = ServerProc("--config", "tiny-dummy", "--draft", "random:2", "--spec-policy", "always", "--max-running-requests", "8",
                   "--events-include-text", "--events-sample-ms", "60000", api_key=KEY)
    s.wait_healthy(60)
    asyncio.run(warm_relay(s))
    yield s
    assert s.terminate() == 0, s.log()


async def warm_relay(srv: ServerProc) -> None:
    """Send tiny requests until their events come back through /v1/events: the daemon reports healthy
    before its SUB socket has joined the engine's PUB, and PUB silently discards what it publishes
    before that (ZMQ's slow joiner), so the first events of a fresh daemon can be lost."""
    async with aiohttp.ClientSession() as s, s.ws_connect(ws_url(srv), headers=AUTH) as ws:
        for _ in range(50):
            await gen(s, srv, [1, 2, 3], 2, None)
            try:
                while True:
                    m = await asyncio.wait_for(ws.receive(), 0.5)
                    if m.type == aiohttp.WSMsgType.TEXT and '"request"' in m.data and '"queued"' in m.data:
                        return
            except asyncio.TimeoutError:
                continue
    raise AssertionError("no event came through /v1/events")


def ws_url(srv: ServerProc, query: str = "") -> str:
    return srv.url.replace("http://", "ws://") + "/v1/events" + query


class Recorder:
    """Reads every frame of one subscription into `raw` (parsed JSON) until cancelled."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.raw: list[dict[str, Any]] = []
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for m in self.ws:
            if m.type == aiohttp.WSMsgType.TEXT:
                for line in m.data.splitlines():
                    self.raw.append(json.loads(line))

    async def wait(self, cond: Any, timeout: float = 20.0) -> None:
        t = 0.0
        while not cond():
            assert t < timeout, f"condition not reached; {Counter(e['type'] for e in self.raw)}"
            await asyncio.sleep(0.05)
            t += 0.05

    def last_pools(self) -> dict[str, dict[str, Any]]:
        return {e["runner"]: e for e in self.raw if e["type"] == "pool"}


async def gen(s: aiohttp.ClientSession, srv: ServerProc, ids: list[int], n: int, logprobs: int | None) -> dict:
    sp: dict[str, Any] = {"max_new_tokens": n, "temperature": 0}
    if logprobs is not None:
        sp["logprobs"] = logprobs
    async with s.post(srv.url + "/generate", json={"input_ids": ids, "sampling_params": sp}, headers=AUTH) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def abandoned_stream(s: aiohttp.ClientSession, srv: ServerProc) -> None:
    """A streamed request whose client goes away after two chunks: the engine must abort and free it."""
    body = {"input_ids": [7, 8, 9, 10], "sampling_params": {"max_new_tokens": 400, "temperature": 0}, "stream": True}
    async with s.post(srv.url + "/generate", json=body, headers=AUTH) as r:
        assert r.status == 200
        got = 0
        async for line in r.content:
            if line.startswith(b"data:"):
                got += 1
                if got == 2:
                    break


async def test_stream_carries_valid_events_and_pools_return_free(srv: ServerProc) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(ws_url(srv), headers=AUTH) as ws:
            rec = Recorder(ws)
            await rec.wait(lambda: len(rec.raw) >= 1)
            jobs = [gen(s, srv, list(range(3 + i, 12 + 3 * i)), 6 + 3 * i, 3 if i % 2 == 0 else None) for i in range(5)]
            outs = await asyncio.gather(*jobs, abandoned_stream(s, srv))
            # the requests are over: wait until each runner's latest pool event says fully free
            await rec.wait(lambda: (p := rec.last_pools()).keys() >= RUNNERS and all(
                p[r]["kv_used"] == 0 and p[r]["req_used"] == 0 for r in RUNNERS) and sum(
                1 for e in rec.raw if e["type"] == "request" and e["state"] in ("finished", "aborted")) >= 6)
            await asyncio.sleep(0.3)  # anything still in flight (a status tick) is taken in too
            rec.task.cancel()

    events = [parse_event(e) for e in rec.raw]  # raises on any event that does not fit the schema
    assert events[0].type == "snapshot" and all(e.type != "snapshot" for e in events[1:])
    types = Counter(e.type for e in events)
    for t in ("batch", "pool", "logprob_meta", "acceptance", "request"):
        assert types[t] > 0, types
    assert set(types) <= set(EVENT_TYPES)
    seqs = [e.seq for e in events[1:]]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), "relay reordered or duplicated events"
    assert seqs[-1] - seqs[0] + 1 == len(seqs), "events lost between the engine and this subscriber"

    # logprob metadata: every forward agrees with its logit rows, in every mode, and the modes are there
    lpm = [e for e in events if isinstance(e, LogprobMetaEvent)]
    bad = [e for e in lpm if not e.agree]
    assert not bad, bad[:3]
    modes = {(e.runner, e.mode) for e in lpm}
    assert {("target", "EXTEND"), ("target", "TARGET_VERIFY"), ("draft0", "DRAFT_EXTEND"),
            ("draft1", "DRAFT_EXTEND")} <= modes, modes
    for e in lpm:
        assert e.logit_rows == e.expected_rows == sum(e.global_num_tokens_for_logprob)
        if e.mode == "TARGET_VERIFY":
            assert e.width == 3 and e.logit_rows == e.bs * 3  # S+1 rows per request
    # batches: the draft-extend batch of each layer follows its verify step, with the same requests
    batches = [e for e in events if e.type == "batch"]
    verify = {e.step: e for e in batches if e.mode == "TARGET_VERIFY"}
    for e in batches:
        if e.mode == "DRAFT_EXTEND":
            assert e.runner in ("draft0", "draft1") and e.step in verify and e.rids == verify[e.step].rids
        assert e.num_tokens == sum(e.num_tokens_per_req) and len(e.rids) == e.bs == len(e.num_tokens_per_req)
    # acceptance: S=2 chain, bounded by the batch
    acc = [e for e in events if e.type == "acceptance"]
    for e in acc:
        assert e.S == 2 and len(e.accepted_per_depth) == 2 and e.accepted_per_depth[1] <= e.accepted_per_depth[0] <= e.bs
        assert len(e.accept_lens) == e.bs and all(1 <= a <= 3 for a in e.accept_lens)

    # pools: seen for every runner, bounded, and all free at the end
    pools = [e for e in events if isinstance(e, PoolEvent)]
    assert {p.runner for p in pools} >= RUNNERS
    assert max(p.kv_used for p in pools if p.runner == "target") > 0
    assert all(0 <= p.kv_used <= p.kv_total and 0 <= p.req_used <= p.req_total for p in pools)
    last = {p.runner: p for p in pools}
    assert all(last[r].kv_used == 0 and last[r].req_used == 0 for r in RUNNERS), last

    # request lifecycle: each /generate rid ends finished, with its tokens and logprobs when asked
    reqs = [e for e in events if isinstance(e, RequestEvent)]
    by_rid: dict[str, list[RequestEvent]] = {}
    for e in reqs:
        by_rid.setdefault(e.rid, []).append(e)
    for i, o in enumerate(outs[:5]):
        rid = next(r for r in by_rid if r.startswith(o["meta_info"]["id"]))
        states = [e.state for e in by_rid[rid]]
        assert states[0] == "queued" and "running" in states and states[-1] == "finished", states
        toks = [t for e in by_rid[rid] for t in (e.tokens or [])]
        if i % 2 == 0:
            assert [t.token_id for t in toks] == o["token_ids"]
            assert all(t.logprob is not None and len(t.top) == 3 for t in toks)
        else:
            assert toks == []
    assert sum(1 for e in reqs if e.state == "aborted") == 1, Counter(e.state for e in reqs)


async def test_type_filter_and_snapshot_of_current_state(srv: ServerProc) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(ws_url(srv, "?types=pool,acceptance"), headers=AUTH) as ws:
            rec = Recorder(ws)
            await rec.wait(lambda: len(rec.raw) >= 1)
            snap = parse_event(rec.raw[0])
            assert snap.type == "snapshot"
            # the earlier test left the engine idle: its snapshot shows every runner free
            assert {p.runner for p in snap.pools} == RUNNERS and all(p.kv_used == 0 for p in snap.pools)
            assert snap.engine is not None and snap.engine.spec_steps == 2 and snap.engine.draft == "random:2"
            await gen(s, srv, [5, 6, 7, 8], 8, None)
            await rec.wait(lambda: any(e["type"] == "acceptance" for e in rec.raw))
            rec.task.cancel()
        assert {e["type"] for e in rec.raw[1:]} <= {"pool", "acceptance"}
        async with s.get(srv.url + "/v1/events?types=pool,nope", headers=AUTH) as r:
            assert r.status == 400 and "nope" in (await r.json())["error"]["message"]


async def test_every_step_is_reported_only_while_someone_watches(srv: ServerProc) -> None:
    """Without a subscriber the engine reports a sample of its steps (the daemon told it: `EventDetail`);
    while one watches, every step; the engine's loop stats (`/debug/engine`) say which and count the
    steps left out."""
    async with aiohttp.ClientSession() as s:

        async def loop_stats() -> dict[str, Any]:
            async with s.get(srv.url + "/debug/engine", headers=AUTH) as r:
                assert r.status == 200
                return (await r.json())["stats"]["loop"]

        for _ in range(100):  # an earlier test's subscriber may still be leaving
            if (st := await loop_stats())["events_full"] is False:
                break
            await asyncio.sleep(0.05)
        assert st["events_full"] is False
        n0 = st["steps_sampled_out"]
        await gen(s, srv, list(range(3, 20)), 64, None)
        assert (await loop_stats())["steps_sampled_out"] > n0
        async with s.ws_connect(ws_url(srv), headers=AUTH) as ws:
            rec = Recorder(ws)
            await rec.wait(lambda: len(rec.raw) >= 1)
            st = await loop_stats()
            assert st["events_full"] is True
            await gen(s, srv, list(range(3, 20)), 64, None)
            assert (await loop_stats())["steps_sampled_out"] == st["steps_sampled_out"]
            rec.task.cancel()
        for _ in range(100):
            if (await loop_stats())["events_full"] is False:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the engine still reports every step with nobody watching")


async def test_events_need_the_api_key(srv: ServerProc) -> None:
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(aiohttp.WSServerHandshakeError) as ei:
                await s.ws_connect(ws_url(srv), headers=headers)
            assert ei.value.status == 401
        async with s.get(srv.url + "/v1/events") as r:
            assert r.status == 401


def test_a_server_without_state_events() -> None:
    """`--no-state-events`: a speculative engine serves requests as ever, `/v1/events` is a 404 that says why, and the engine's loop reports no
    telemetry time and no event pumping (nothing was attached)."""
    s = ServerProc("--config", "tiny-dummy", "--draft", "random:2", "--spec-policy", "always", "--no-state-events")
    try:
        s.wait_healthy(60)

        async def go() -> None:
            async with aiohttp.ClientSession() as c:
                body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
                async with c.post(s.url + "/generate", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert len((await r.json())["token_ids"]) == 12
                async with c.get(s.url + "/v1/events") as r:
                    assert r.status == 404
                    err = (await r.json())["error"]
                    assert err["code"] == "state_events_off" and "--no-state-events" in err["message"]
                async with c.get(s.url + "/debug/engine") as r:
                    loop = (await r.json())["stats"]["loop"]
                    assert loop["steps"] >= 4 and loop["telemetry_s"] == 0.0 and loop["pump_s"] == 0.0, loop

        asyncio.run(go())
    finally:
        assert s.terminate() == 0, s.log()
