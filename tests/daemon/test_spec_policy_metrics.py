"""The speculation policy on `/metrics`: the daemon's counters follow the engine's cumulative totals
(each pong adds what grew; a restarted engine or a reset counts on from zero, never twice), and a real
`mleagle serve` (tiny-dummy, `--draft random:2`, `--spec-policy cycle`, so every depth runs) lists the
`mleagle:spec_policy_*` series with the values its engine reports in `/debug/engine` and relays the
per-step `spec_policy` events on `/v1/events`. Before a speculative engine reports, none are listed.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mleagle.daemon.metrics import Metrics
from mleagle.engine.spec.policy import SpecPolicy
from tests.daemon_helpers import ServerProc


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape: (name, sorted labels) -> value, by Prometheus's own parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def policy_series(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {k: v for k, v in samples(text).items() if k[0].startswith("mleagle:spec_policy_")}


def it(depth: int, model: str = "m") -> tuple[str, tuple[tuple[str, str], ...]]:
    return ("mleagle:spec_policy_iterations_total", (("depth", str(depth)), ("model_name", model)))


def run(p: SpecPolicy, n: int, bs: int = 2) -> None:
    """n iterations of a real policy, each accepting one draft per request where it drafted."""
    for _ in range(n):
        d = p.choose(bs)
        p.observe(bs, d.depth, [1] * bs if d.depth else [0] * bs, 0.01 + 0.002 * d.depth)


def test_counters_follow_the_engine_totals() -> None:
    m = Metrics("m")
    assert not policy_series(m.render().decode())  # nothing before a speculative engine reports
    p = SpecPolicy("cycle", 2)
    run(p, 5)  # depths 0, 1, 2, 0, 1
    m.set_policy(p.snapshot())
    got = samples(m.render().decode())
    assert [got[it(d)] for d in range(3)] == [2, 2, 1]
    assert got[("mleagle:spec_policy_tokens_gained_total", (("model_name", "m"),))] == 2 * 3  # 3 drafting × bs
    assert got[("mleagle:spec_policy_depth", (("model_name", "m"),))] == 1
    m.set_policy(p.snapshot())  # the same totals again: nothing added
    assert samples(m.render().decode())[it(0)] == 2
    run(p, 3)  # 2, 0, 1
    m.set_policy(p.snapshot())
    got = samples(m.render().decode())
    assert [got[it(d)] for d in range(3)] == [3, 3, 2]
    p.reset()  # the engine forgot its counts (its warm-up does this): counting goes on from zero
    run(p, 1)
    m.set_policy(p.snapshot())
    assert samples(m.render().decode())[it(0)] == 4
    q = SpecPolicy("cycle", 2)  # a restarted engine whose first report already exceeds the old totals
    run(q, 12)
    m.set_policy(q.snapshot(), epoch=1)
    got = samples(m.render().decode())
    assert [got[it(d)] for d in range(3)] == [4 + 4, 3 + 4, 2 + 4]
    m.set_policy(None)  # a target-only engine's stats: the series stay as they were
    assert samples(m.render().decode())[it(0)] == 8


def test_the_served_discount_per_bucket_is_a_gauge() -> None:
    """A bucket where drafting cost far more served than at warm-up: the policy's discount there is
    listed per bucket, and the engine status's totals carry it for the TUI."""
    from mleagle.engine.service.telemetry import policy_totals

    p = SpecPolicy("auto", 1, dwell=0, probe=4)
    for d, c in [(1, 1.2)] * 9 + [(0, 1.0)] * 9:  # the warm-up's timings
        p.observe(4, d, [1] * 4 if d else [], c)
    p.reset(keep_costs=True)
    for _ in range(60):  # served: depth 1 at five times its warm-up cost, depth 0 about as timed
        d = p.choose(4)
        p.observe(4, d.depth, [1] * 4 if d.depth else [], 6.0 if d.depth else 1.1)
    m = Metrics("m")
    m.set_policy(p.snapshot())
    got = samples(m.render().decode())
    f = got[("mleagle:spec_policy_served_discount", (("bucket", "4"), ("model_name", "m")))]
    assert 0 < f < 1 and f == pytest.approx(p.served_discounts()["4"])
    tot = policy_totals(p)
    assert tot is not None and tot.served_discount == {"4": f}


KEY = "policy-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def srv():
    s = ServerProc("--config", "tiny-dummy", "--draft", "random:2", "--spec-policy", "cycle", api_key=KEY)
    s.wait_healthy(60)
    yield s
    assert s.terminate() == 0, s.log()


async def generate(s: aiohttp.ClientSession, url: str, n: int) -> None:
    body = {"input_ids": [3, 4, 5, 6, 7], "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    async with s.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()


async def relayed_policy_events(srv: ServerProc) -> list[dict]:
    """Subscribe to `spec_policy` events only and send requests until some come through (the daemon's
    SUB socket joins the engine's PUB a moment after /health says ready; what is published before is
    lost), then read what follows for a moment."""
    ws_url = srv.url.replace("http://", "ws://") + "/v1/events?types=spec_policy"
    got: list[dict] = []
    async with aiohttp.ClientSession(headers=AUTH) as s, s.ws_connect(ws_url) as ws:
        for _ in range(30):
            await generate(s, srv.url, 12)
            try:
                while True:
                    m = await asyncio.wait_for(ws.receive(), 0.3)
                    if m.type == aiohttp.WSMsgType.TEXT:
                        got += [json.loads(ln) for ln in m.data.splitlines()]
            except asyncio.TimeoutError:
                pass
            if any(e["type"] == "spec_policy" for e in got):
                return got
    raise AssertionError(f"no spec_policy event came through /v1/events: {[e['type'] for e in got]}")


def test_real_daemon_lists_the_policy(srv: ServerProc) -> None:
    evs = asyncio.run(relayed_policy_events(srv))
    assert evs[0]["type"] == "snapshot" and {e["type"] for e in evs[1:]} == {"spec_policy"}
    pol = [e for e in evs if e["type"] == "spec_policy"]
    assert {e["depth"] for e in pol} == {0, 1, 2} and {e["reason"] for e in pol} == {"cycle"}
    srv.wait_pools_free()
    st, text = srv.get("/metrics")
    assert st == 200
    got = policy_series(text)
    snap = srv.engine()["stats"]["spec_policy"]  # the engine's own totals, after the scrape's fresh pong
    assert snap["mode"] == "cycle" and len(snap["iterations_by_depth"]) == 3
    assert [got[it(d, "tiny-dummy")] for d in range(3)] == snap["iterations_by_depth"]
    assert min(snap["iterations_by_depth"]) > 0
    lab = (("model_name", "tiny-dummy"),)
    for name, key in (("tokens_gained", "tokens_gained"), ("catch_ups", "catch_ups"),
                      ("catch_up_positions", "catch_up_positions"), ("switches", "switches")):
        assert got[(f"mleagle:spec_policy_{name}_total", lab)] == snap[key], name
    assert snap["catch_ups"] > 0 and snap["catch_up_positions"] >= snap["catch_ups"]
    assert got[("mleagle:spec_policy_catch_up_seconds_total", lab)] == pytest.approx(snap["catch_up_s"])
    assert got[("mleagle:spec_policy_depth", lab)] == snap["depth"]
    assert ("mleagle:spec_policy_predicted_gain", lab) in got and ("mleagle:spec_policy_measured_gain", lab) in got
    # The engine process's loop: its steps, and host time by phase; the collector frozen at start-up.
    stats = srv.engine()["stats"]
    loop, gcs = stats["loop"], stats["gc"]
    assert loop["steps"] >= sum(snap["iterations_by_depth"]) and loop["step_s"] > 0
    assert 0 < loop["telemetry_s"] < loop["step_s"] and loop["send_outputs_s"] > 0 and loop["pong_s"] > 0
    assert loop["device_wait_s"] == 0.0  # a CPU engine has no device to wait for (the GPU test counts it)
    assert stats["device_busy_s"] == 0.0 and stats["device_busy_iterations"] == 0  # nor device time to count
    assert gcs["frozen"] > 1000 and len(gcs["collections"]) == len(gcs["max_pause_ms"]) == 3
    assert snap["fills"] > 0 and snap["fill_max_s"] * snap["fills"] >= snap["fill_s"] > 0

