"""`mleagle bench serve-matrix`, run as the command it is: real servers on the CPU (a tiny random model
with SmolLM2's tokenizer, so chat works and nothing is downloaded), two arms, the offline replay; every
cell of the JSON and the table filled, the ratio taken against the baseline, no process left behind,
also when the benchmark is stopped by SIGTERM mid-run or a server cannot start. The summary's
statistics are checked apart on made-up runs (no server)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mleagle.daemon.bench_matrix import METRICS, OFFLINE_METRICS, parse_arm, summary
from tests.spec_helpers import TINY_TOK

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Say hi.", "Name a colour.", "Count to three."]


def gone(pid: int) -> bool:
    """No such process, or only its zombie (it has exited; its parent has not reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def matrix_cmd(tmp_path: Path, *extra: str) -> list[str]:
    cfg, data = tmp_path / "tiny-tok.toml", tmp_path / "prompts.jsonl"
    cfg.write_text(TINY_TOK)
    data.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in PROMPTS))
    return [sys.executable, "-m", "mleagle.cli", "bench", "serve-matrix", "--config", str(cfg), "--device", "cpu",
            "--dataset", str(data), "--concurrency", "1", "--min-requests", "1", "--output", str(tmp_path / "m.json"),
            *extra]


@pytest.mark.slow
def test_two_arms_with_offline_replay(tmp_path: Path) -> None:
    md = tmp_path / "m.md"
    cmd = matrix_cmd(tmp_path, "--arm", "target=--draft none", "--arm", "spec=--draft random:2 --spec-policy always",
                     "--baseline", "target",
                     "--repeats", "1", "--requests-per-concurrency", "2", "--max-tokens", "8", "--warmup", "1",
                     "--offline", "--markdown", str(md))
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    rep = json.loads((tmp_path / "m.json").read_text())
    assert [(x["arm"], x["repeat"]) for x in rep["runs"]] == [("target", 0), ("spec", 0)]
    assert rep["arms"]["spec"]["flags"] == ["--draft", "random:2", "--spec-policy", "always"]
    assert rep["arms"]["spec"]["engine"]["draft"] == "random:2"
    assert rep["settings"]["requests"] == {"1": 2} and rep["machine"]["cores"] and not rep["interrupted"]
    tok = {}
    for x in rep["runs"]:
        assert x["error"] is None and x["server"]["exit_code"] == 0, x
        (res,) = x["results"]  # the raw `bench serve` result
        assert res["concurrency"] == 1 and res["num_prompts"] == 2 and res["completed"] == 2 and res["max_tokens"] == 8
        assert res["output_tokens"] > 0 and res["command"].startswith("mleagle bench serve --url http://127.0.0.1:")
        tok[x["arm"]] = res["output_throughput"]
        off = x["offline"]
        assert off["error"] is None and off["draft"] == rep["arms"][x["arm"]]["engine"]["draft"]
        (ores,) = off["results"]
        assert ores["completed"] == 2 and ores["output_throughput"] > 0
        # One request at a time: every decode iteration, served or replayed, carried one row.
        assert ores["engine"]["iterations"] > 0 and ores["engine"]["rows_per_iteration"] == 1.0
        assert res["server"]["engine_iterations"]["rows_per_iteration"] == 1.0
    rows = {row["arm"]: row for row in rep["summary"]}
    assert set(rows) == {"target", "spec"}
    spec_only = {"mean_depth", "accept_len"}  # what the speculation ran: nothing for target-only
    # The device's time on the iterations: counted on CUDA only, so "-" on this CPU.
    cuda_only = {"device_busy", "device_us_per_iter", "offline_device_busy", "offline_device_us_per_iter"}
    for row in rows.values():
        for k in [m for m, _, _ in METRICS + OFFLINE_METRICS] + ["vs_baseline", "offline_out_tok_s", "served_over_offline"]:
            if k in cuda_only or (k in spec_only and row["arm"] == "target"):
                assert row[k] is None, k
                continue
            assert row[k] is not None and row[k]["n"] == 1, (row["arm"], k)
        assert row["failed"] == 0
    # `always` drafts two steps every iteration; a random draft's verifies accept about the bonus token
    assert rows["spec"]["mean_depth"]["median"] == 2 and 1 <= rows["spec"]["accept_len"]["median"] < 1.5
    assert rows["target"]["vs_baseline"]["median"] == 1.0
    assert rows["spec"]["vs_baseline"]["median"] == pytest.approx(tok["spec"] / tok["target"])
    # The table: one row per (concurrency, arm), every cell filled, the same on stdout and in the file.
    assert md.read_text().strip() in r.stdout
    body = [ln for ln in md.read_text().split("TTFT split")[0].splitlines() if re.match(r"\| 1 \| (target|spec) \|", ln)]
    empty = [[c.strip() for c in ln.split("|")].count("-") for ln in body]
    assert len(body) == 2 and empty == [len(spec_only) + len(cuda_only), len(cuda_only)], body
    assert "| vs target |" in md.read_text() and "| served/offline |" in md.read_text()
    # The server's TTFT split: every phase of both arms in the summary and in its own table.
    for row in rows.values():
        assert set(row["ttft_phases"]) >= {"daemon_in", "prefill", "to_daemon", "total"}, row["ttft_phases"]
        assert row["ttft_phases"]["prefill"]["mean_ms"]["median"] > 0
    assert "TTFT split in the server" in md.read_text() and "| 1 | spec | " in md.read_text().split("TTFT split")[1]
    # Both daemons and both engines are gone.
    pids = [p for x in rep["runs"] for p in x["server"]["pids"]]
    assert len(pids) >= 4 and all(gone(p) for p in pids), pids


@pytest.mark.slow
def test_sigterm_mid_run_stops_the_server(tmp_path: Path) -> None:
    cmd = matrix_cmd(tmp_path, "--arm", "t=--draft none", "--repeats", "3", "--requests-per-concurrency", "200",
                     "--max-tokens", "64", "--warmup", "0")
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    err: list[str] = []
    try:
        assert p.stderr is not None
        for line in p.stderr:
            err.append(line)
            m = re.search(r"daemon pid (\d+), engine pid (\d+)", line)
            if m:
                pids = [int(m[1]), int(m[2])]
            if "concurrency 1, 200 requests" in line:
                break
        assert len(pids) == 2, "".join(err)
        time.sleep(0.5)  # requests in flight
        p.send_signal(signal.SIGTERM)
        out, rest = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, "".join(err) + rest
    assert "interrupted" in rest and "| 1 | t |" in out  # what finished is still reported
    rep = json.loads((tmp_path / "m.json").read_text())
    assert rep["interrupted"] and rep["runs"][0]["server"]["pids"][:1] == pids[:1]
    end = time.monotonic() + 10
    while not all(gone(x) for x in pids) and time.monotonic() < end:
        time.sleep(0.1)
    assert all(gone(x) for x in pids), pids


@pytest.mark.slow
def test_a_server_that_cannot_start_is_reported_and_reaped(tmp_path: Path) -> None:
    # The flags pass `serve`'s checks; the engine fails only when it loads the draft.
    cmd = matrix_cmd(tmp_path, "--arm", f"bad=--draft {tmp_path / 'no-such-draft'}", "--repeats", "1",
                     "--max-tokens", "8", "--warmup", "0", "--offline")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-4000:]
    (run,) = json.loads((tmp_path / "m.json").read_text())["runs"]
    assert run["error"] == "RuntimeError: server exited with 1" and run["server"]["exit_code"] == 1
    assert any("no-such-draft" in ln for ln in run["server"]["log_tail"])
    assert run["offline"]["error"].startswith("skipped")
    assert "| 1 | bad | - |" in r.stdout
    assert all(gone(p) for p in run["server"]["pids"])


def test_summary_medians_ranges_and_paired_ratios() -> None:
    def run(arm: str, rep: int, tok: float, ttft: float) -> dict:
        res = {"concurrency": 8, "failed": 0, "output_throughput": tok, "request_throughput": tok / 100,
               "ttft_ms": {"p50": ttft, "p90": 2 * ttft}, "itl_ms": {"p50": 1.0, "p99": 3.0}}
        off = {"concurrency": 8, "output_throughput": 2 * tok}
        return {"arm": arm, "repeat": rep, "results": [res], "offline": {"results": [off]}}

    # The machine drifts between repeats; within one, "b" is always 1.5x "a".
    runs = [run("a", 0, 100, 10), run("b", 0, 150, 5), run("b", 1, 300, 6), run("a", 1, 200, 20),
            run("a", 2, 400, 30), run("b", 2, 600, 7)]
    rows = {r["arm"]: r for r in summary(runs, ["a", "b"], [8], "a")}
    a, b = rows["a"], rows["b"]
    assert a["out_tok_s"] == {"median": 200, "min": 100, "max": 400, "n": 3}
    assert b["ttft_p50_ms"] == {"median": 6, "min": 5, "max": 7, "n": 3} and b["ttft_p90_ms"]["median"] == 12
    assert a["vs_baseline"]["median"] == 1.0
    assert b["vs_baseline"] == pytest.approx({"median": 1.5, "min": 1.5, "max": 1.5, "n": 3})  # paired, not 300/200
    assert b["served_over_offline"]["median"] == 0.5 and b["offline_out_tok_s"]["median"] == 600


def test_arm_flags_are_checked_like_serve() -> None:
    arm = parse_arm("always=--spec-policy always --max-running-requests 8", ["--config", "tiny-dummy"])
    assert arm.argv == ["--config", "tiny-dummy", "--spec-policy", "always", "--max-running-requests", "8"]
    assert arm.cfg.engine.spec_policy == "always" and arm.cfg.engine.max_running_requests == 8
    assert parse_arm("auto=", []).flags == []
    for bad in ("no-equals-sign", "x=--spec-policy sometimes", "x=--max-running-requests -1"):
        with pytest.raises(ValueError):
            parse_arm(bad, [])


def test_the_first_wave_of_a_closed_loop_is_left_out_of_the_steady_ttft() -> None:
    """A closed loop of concurrency c sends its first c requests at once: `ttft_steady_ms` is the TTFT
    of the requests sent after them (in sending order); failed ones count in neither."""
    from mleagle.daemon.bench_serve import Result, summarize

    rs = [Result(ok=True, ttft=0.050, e2e=0.1, output_tokens=2) for _ in range(4)]
    rs += [Result(ok=True, ttft=0.002, e2e=0.1, output_tokens=2) for _ in range(12)] + [Result(ok=False)]
    s = summarize(rs, 1.0, first_wave=4)
    assert s["ttft_steady_ms"]["p90"] == pytest.approx(2.0) and s["ttft_ms"]["p90"] == pytest.approx(50.0)
    assert summarize(rs, 1.0)["ttft_steady_ms"] == s["ttft_ms"]  # no wave: the same as every request


def test_throughput_until_the_last_send_leaves_out_the_drain() -> None:
    """`loaded`: a closed loop of 2 over 4 requests; the window runs from the first send (t=10) to the
    last (t=12), so only the chunks that arrived by then count (a chunk carrying the request's mean
    tokens per chunk), and the mean in flight is the requests' overlap with the window over its length."""
    from mleagle.daemon.bench_serve import Result, summarize

    def req(t_send: float, first: float, gaps: list[float], tokens: int) -> Result:
        e2e = first - t_send + sum(gaps)
        return Result(ok=True, t_send=t_send, t_first=first, ttft=first - t_send, itl=gaps, e2e=e2e,
                      output_tokens=tokens, chunks=1 + len(gaps))

    rs = [req(10.0, 10.1, [0.5, 0.5], 3),        # 10.1, 10.6, 11.1: all in; ends 11.1
          req(10.0, 10.2, [0.5, 0.5, 0.5], 8),   # 10.2 .. 11.7: 4 chunks of 2 tokens; ends 11.7
          req(11.1, 11.5, [0.4, 0.4], 3),        # 11.5, 11.9 in, 12.3 out
          req(12.0, 12.1, [0.1], 2)]             # sent last, at the window's end: nothing in it
    ld = summarize(rs, 2.2, first_wave=2)["loaded"]
    assert ld["seconds"] == pytest.approx(2.0)
    assert ld["output_throughput"] == pytest.approx((3 + 8 + 2) / 2.0)
    # in flight: 1.1 + 1.7 + 0.9 + 0 seconds over 2 s
    assert ld["inflight"] == pytest.approx(3.7 / 2.0)
    assert summarize(rs, 2.2, first_wave=4)["loaded"] is None  # one wave: no window
    assert summarize(rs, 2.2)["loaded"] is None  # an open loop
    assert summarize([Result(ok=True, ttft=0.1, e2e=0.2, output_tokens=2)] * 3, 1.0, 1)["loaded"] is None  # no send times


def test_the_ttft_split_summary_names_what_the_slowest_tenth_spent() -> None:
    """`phase_summary` over a run's records: per phase mean, p50 and p90, and the mean over the slowest
    tenth by total, which is where a tail's phase shows (here: `queue`)."""
    from mleagle.daemon.bench_serve import phase_summary

    names = ["daemon_in", "queue", "prefill"]
    fast = [[i, 0.001, 0.0, 0.002] for i in range(1, 19)]
    slow = [[19, 0.001, 0.040, 0.002], [20, 0.001, 0.050, 0.002]]
    s = phase_summary({"names": names, "seq": 20, "recent": fast + slow})
    assert s is not None and s["requests"] == 20
    q = s["phases"]["queue"]
    assert q["mean_ms"] == pytest.approx(4.5) and q["p50_ms"] == 0.0 and q["slowest_tenth_mean_ms"] == pytest.approx(45.0)
    assert s["phases"]["prefill"]["slowest_tenth_mean_ms"] == pytest.approx(2.0)
    assert s["phases"]["total"]["slowest_tenth_mean_ms"] == pytest.approx(48.0)
    assert phase_summary(None) is None and phase_summary({"names": names, "seq": 0, "recent": []}) is None
    # Over the records of chosen responses only (the requests after a closed loop's opening burst):
    # a record carries its response id after the phases.
    ided = [[*r, f"id{r[0]}"] for r in fast + slow]
    st = phase_summary({"names": names, "seq": 20, "recent": ided}, {"id1", "id2", "id20"})
    assert st is not None and st["requests"] == 3
    assert st["phases"]["queue"]["mean_ms"] == pytest.approx(50 / 3)
    assert phase_summary({"names": names, "seq": 20, "recent": ided}, {"id99"}) is None


def test_the_iteration_summary_sets_the_devices_time_beside_the_wall() -> None:
    """`iteration_summary`: iterations a second and rows each over the run; where the engine counted its
    device time (CUDA), the device's busy share and µs per timed iteration; without it, neither."""
    from mleagle.daemon.bench_serve import iteration_summary

    before = {"iterations": 100, "iteration_rows": 3000, "device_busy_s": 0.5, "device_busy_iterations": 90}
    after = {"iterations": 1100, "iteration_rows": 33000, "device_busy_s": 1.5, "device_busy_iterations": 1090}
    s = iteration_summary(before, after, 2.0)
    assert s == {"iterations": 1000, "iterations_per_s": 500.0, "rows_per_iteration": 30.0,
                 "device_busy_share": 0.5, "device_us_per_iteration": pytest.approx(1000.0)}
    cpu = {k: v for k, v in after.items() if k != "device_busy_s"} | {"device_busy_iterations": 90}
    assert iteration_summary(before, cpu, 2.0) == {"iterations": 1000, "iterations_per_s": 500.0, "rows_per_iteration": 30.0}
    assert iteration_summary(None, after, 2.0) is None


def test_the_speculation_summary_is_the_runs_share_of_the_counters() -> None:
    """`spec_summary` over the counters before and after a run: iterations by depth, their mean, the
    accept length of the run's verifies alone, and the policy's moves; None without a draft."""
    from mleagle.daemon.bench_serve import spec_summary

    pol = {"iterations_by_depth": [10, 0, 5], "switches": 1, "explore_iterations": 4, "catch_ups": 0,
           "catch_up_positions": 0, "catch_up_s": 0.0, "fills": 3, "fill_s": 0.001, "choose_s": 0.001,
           "choose_calls": 15, "iterations_by_bucket": {"1": [10, 0, 0], "8": [0, 0, 5]},
           "explore_by_reason": {"not measured yet": 4},
           "rows_by_depth": [10, 0, 40], "tokens_by_depth": [10, 0, 90], "seconds_by_depth": [0.01, 0.0, 0.0075],
           "timed_by_depth": [10, 0, 5]}
    before = {"spec_policy": pol, "spec": {"num_verify": 5, "num_accepted_tokens": 9}}
    after = {"spec_policy": pol | {"iterations_by_depth": [40, 0, 65], "switches": 3, "catch_ups": 2,
                                   "catch_up_positions": 30, "catch_up_s": 0.004, "fills": 7, "fill_s": 0.003,
                                   "choose_s": 0.0028, "choose_calls": 105,
                                   "explore_by_reason": {"not measured yet": 4, "runner-up": 8},
                                   "iterations_by_bucket": {"1": [10, 0, 0], "8": [30, 0, 60]},
                                   "cost_ms": {"8:0": 1.0, "8:2": 1.5}, "fill_cost_ms": 0.4,
                                   "rows_by_depth": [250, 0, 520], "tokens_by_depth": [250, 0, 1410],
                                   "seconds_by_depth": [0.04, 0.0, 0.0975], "timed_by_depth": [40, 0, 65]},
             "spec": {"num_verify": 65, "num_accepted_tokens": 99}}
    s = spec_summary(before, after)
    assert s is not None and s["iterations"] == 90 and s["depth_share"] == [pytest.approx(1 / 3, abs=1e-4), 0.0,
                                                                             pytest.approx(2 / 3, abs=1e-4)]
    assert s["mean_depth"] == pytest.approx(120 / 90) and s["accept_len"] == pytest.approx(1 + 90 / 60)
    assert (s["switches"], s["explore_iterations"], s["catch_ups"], s["catch_up_positions"]) == (2, 0, 2, 30)
    assert s["catch_up_ms"] == pytest.approx(4.0)
    assert s["fills"] == 4 and s["fill_ms"] == pytest.approx(2.0)
    assert s["choose_us"] == pytest.approx(20.0)  # 1.8 ms over 90 choices
    assert s["iterations_by_bucket"] == {"8": [30, 0, 55]}  # bucket 1 ran nothing in this run
    assert s["explore_by_reason"] == {"runner-up": 8}  # the run's own looks, by why
    # What each depth made in this run: depth 2's 480 request-iterations 1320 tokens, 60 timed at 1.5 ms.
    assert s["by_depth"] == {"0": {"rows": 240, "tokens_per_row": 1.0, "ms_per_iteration": 1.0},
                             "2": {"rows": 480, "tokens_per_row": 2.75, "ms_per_iteration": 1.5}}
    assert s["beliefs"] == {"cost_ms": {"8:0": 1.0, "8:2": 1.5}, "fill_cost_ms": 0.4}
    assert spec_summary({"spec_policy": None}, {"spec_policy": None}) is None and spec_summary(None, after) is None


@pytest.mark.slow
def test_a_closed_loop_split_over_client_processes(tmp_path: Path) -> None:
    """`bench serve --client-procs 2` against a real server: both processes run their share of the
    closed loop, every request completes and is counted once, and the report says how many client
    processes ran and how busy the busiest was."""
    from tests.daemon_helpers import ServerProc

    cfg, data, out = tmp_path / "tiny-tok.toml", tmp_path / "prompts.jsonl", tmp_path / "b.json"
    cfg.write_text(TINY_TOK)
    data.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in PROMPTS))
    srv = ServerProc("--config", str(cfg), "--device", "cpu")
    try:
        srv.wait_healthy(60)
        r = subprocess.run([sys.executable, "-m", "mleagle.cli", "bench", "serve", "--url", srv.url, "--dataset",
                            str(data), "--num-prompts", "7", "--concurrency", "3", "--client-procs", "2",
                            "--max-tokens", "4", "--ignore-eos", "--output", str(out)], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        res = json.loads(out.read_text())
        assert res["completed"] == 7 and res["failed"] == 0 and res["client_procs"] == 2
        assert res["output_tokens"] == 7 * 4 and 0 <= res["client_cpu_share"] < 1.5
        assert res["server"]["ttft_phases"]["requests"] == 7
        # The engine loop over the run, from a fresh ping before and after: it stepped, and its shares
        # of the run's wall time are shares (the busy total is the sum of its parts).
        lp = res["server"]["engine_loop"]
        assert lp["steps"] >= 4 and 0 < lp["step_share"] <= lp["busy_share"] <= 1.05, lp
        assert lp["busy_share"] == pytest.approx(sum(lp[k + "_share"] for k in ("step", "send_outputs", "pump", "messages")))
        assert lp["pong_share"] <= lp["messages_share"]  # answering pings is part of handling messages
        assert "engine loop busy" in r.stdout
        assert res["server"]["spec"] is None and "speculation" not in r.stdout  # a target-only server
        # Every request matched to its record by response id, across both client processes: the route
        # begins after the client sent; the daemon's last mark follows its write, which the client may
        # read a hair before it.
        out = res["server"]["ttft_outside"]
        assert out["requests"] == 7 and out["before_route"]["p50_ms"] > 0 and out["after_write"]["p50_ms"] > -1, out
        assert out["before_route"]["mean_ms"] + out["after_write"]["mean_ms"] < res["ttft_ms"]["mean"]
        # before_route in two at the client's HTTP write (its trace marks): both parts are there, the
        # client's own is not negative, and they add up
        assert out["client_send"]["p50_ms"] > 0 and out["to_route"]["p50_ms"] > 0, out
        assert out["client_send"]["mean_ms"] + out["to_route"]["mean_ms"] == pytest.approx(out["before_route"]["mean_ms"])
        assert "TTFT outside the split" in r.stdout
        # The same split over the 4 requests sent after the first wave of 3 (the concurrency).
        assert out["steady"]["requests"] == 4 and res["server"]["ttft_phases_steady"]["requests"] == 4
        assert "after the first wave, ms (4 requests)" in r.stdout
        # The daemon froze what start-up built once its engine was ready, and counts its collections (a
        # run of 7 requests may need none: a finished request's objects go without one); the client
        # processes count theirs.
        g = res["server"]["daemon_gc"]
        assert g["frozen"] > 10_000 and len(g["collections"]) == 3 and min(g["collections"]) >= 0, g
        c = res["client_gc"]
        assert len(c["collections"]) == len(c["pause_ms"]) == 3 and min(c["pause_ms"]) >= 0, c
        assert "daemon GC" in r.stdout and "client GC" in r.stdout
        assert "2 client processes" in r.stdout
        # Both client loops' timers, together: every 10 ms over the run, each late by 0 or more.
        lag = res["client_loop_lag"]
        assert lag["timers"] >= 2 and 0 <= lag["p50_ms"] <= lag["p99_ms"] <= lag["max_ms"], lag
        assert "client loop late" in r.stdout
        # Throughput until the last request was sent: a window inside the run, with at most the
        # concurrency in flight over it.
        ld = res["loaded"]
        assert 0 < ld["seconds"] < res["duration_s"] and 0 < ld["inflight"] <= 3 and ld["output_throughput"] > 0, ld
        assert "until the last send" in r.stdout
        bad = subprocess.run([sys.executable, "-m", "mleagle.cli", "bench", "serve", "--url", srv.url, "--rate", "2",
                              "--client-procs", "2"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "--client-procs" in bad.stderr
    finally:
        assert srv.terminate() == 0, srv.log()
