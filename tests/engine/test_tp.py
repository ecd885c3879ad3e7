"""Tensor parallelism on the CPU: two gloo ranks against TP=1, both layouts, the seeds' regression.

The rank-side checks live in `tests/tp_spmd.py` (one run of two processes, joined like torchrun joins
them, serves every test here; see its docstring). Asserted here: logits of every forward (prefill with
prompt logprobs, decode, verify, each draft-extend step) equal TP=1's to 1e-5 relative in both layouts,
also with one KV head replicated over the ranks, with replicated draft layers, with a reduced draft
vocabulary and with a draft reading fused target features through two blocks per step, and the ranks hold bit-identical logits (what their identical sampling rests on); greedy
speculative output equals TP=1 target-only output eagerly and through (emulated) whole-iteration and
per-forward graphs, also with overlap scheduling, with every pool of every rank free afterwards; the seeds' regression; and start-up validation that names what does not divide.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine, EngineInputError, tp_shape_errors
from mleagle.engine.executor.forward_batch import ForwardMode, row_meta
from tests.spec_helpers import TINY_TOK, tiny_cfg

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_spmd(tmp: Path, world: int = 2, timeout: float = 300) -> list[dict[str, Any]]:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.tp_spmd", str(r), str(world), str(port), str(tmp)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    out = []
    for r, p in enumerate(procs):
        f = tmp / f"rank{r}.json"
        assert p.returncode == 0 and f.is_file(), f"rank {r} failed ({p.returncode}):\n{logs[r][-4000:]}"
        out.append(json.loads(f.read_text()))
    return out


@pytest.fixture(scope="module")
def spmd_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp")


@pytest.fixture(scope="module")
def ranks(spmd_dir: Path) -> list[dict[str, Any]]:
    return spawn_spmd(spmd_dir)


def test_logits_equal_tp1_in_both_layouts(ranks: list[dict[str, Any]]) -> None:
    res = ranks[0]["logits"]
    assert {k.split("/")[0] for k in res} == {"all_reduce", "scattered"}
    for key, r in res.items():
        assert r["same_plan"] and r["forwards"] > 10, key
        assert r["max_rel_err"] < 1e-5, (key, r["max_rel_err"])
        assert r["tokens_equal"], key
        modes = set(r["modes"])
        if "random" in key:
            assert {"target:EXTEND", "target:TARGET_VERIFY", "draft0:DRAFT_EXTEND", "draft1:DRAFT_EXTEND"} <= modes
        else:
            assert {"target:EXTEND", "target:DECODE"} <= modes
        # KV pools hold this rank's heads: one of two, or one replicated head (kv=1); a replicated draft all.
        assert r["kv_heads_per_rank"] == 1, key
        assert r["draft_kv_heads_per_rank"] == (2 if key.endswith("replicate") else 1), key
        assert r["pool_slots"] == r["ref_pool_slots"], key
        v = int(key.split("/v")[1].split("/")[0])  # padded to equal shards, cut back to the vocabulary
        assert r["vocab_out"] == v and r["head_rows_per_rank"] == -(-v // 2), key
        if "random" in key:  # draft logits over the whole vocabulary, or the reduced one (85 ids)
            assert r["draft_vocab_out"] == [85 if "/dv85/" in key else v], key


def test_ranks_hold_identical_logits(ranks: list[dict[str, Any]]) -> None:
    d0, d1 = ranks[0]["digests"], ranks[1]["digests"]
    assert d0.keys() == d1.keys() and all(d0[k] == d1[k] for k in d0)


def test_greedy_speculation_equals_tp1_target_only_and_pools_free(ranks: list[dict[str, Any]]) -> None:
    r0, r1 = ranks[0]["exact"], ranks[1]["exact"]
    assert len(r0) == 19  # 12 configurations under all_reduce, the 7 whose forwards differ under scattered too
    for key, r in r0.items():
        assert r["equal"], key
        assert r["free"] and r1[key]["free"], key
        assert r1[key]["preemptions"] == r["preemptions"], key  # the same schedule on both ranks
        assert (r1[key]["depths"], r1[key]["catch_ups"]) == (r["depths"], r["catch_ups"]), key  # the same depths
        if key.endswith("cycle"):  # every depth ran, with catch-ups, on both ranks alike
            assert all(n > 0 for n in r["depths"]) and r["catch_ups"] > 0, key
        assert (r1[key]["replays"], r1[key]["iter_replays"]) == (r["replays"], r["iter_replays"]), key
        if key.endswith("graphs"):  # plain greedy decode: whole-iteration replays, collectives inside
            assert r["iter_replays"] > 0, key
        if key.endswith("per_forward"):  # iteration_graph off: every decode forward replays its own graph
            assert r["replays"] > 0 and r["iter_replays"] == 0, key
        if "tight" in key:
            assert r["preemptions"] > 0, key
        assert r1[key]["graph_fused"] == r["graph_fused"], key
        if key.endswith("fused_overlap"):  # arrivals while others decode: staged fused steps, on both ranks
            assert r["graph_fused"] > 0, key


def test_prefix_cache_hits_and_reset_alike_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """Shared-prefix prompts run three times, the cache reset on rank 0 before the third: every run's
    output equals TP=1 target-only, the second run hits, the third does not, and both ranks count the
    same hits (a follower whose cache kept its prefixes would admit differently and diverge)."""
    for layout in ("all_reduce", "scattered"):
        r0, r1 = ranks[0]["prefix"][layout], ranks[1]["prefix"][layout]
        assert r0["equal"] == [True, True, True], layout
        h = r0["hits"]
        assert h == r1["hits"] and h[1] > h[0] and h[2] == h[1] + h[0], (layout, h)
        assert r0["free"] and r1["free"], layout


def test_constrained_output_under_tp_equals_tp1(ranks: list[dict[str, Any]]) -> None:
    """Grammar-constrained greedy output under TP=2 (both layouts, target-only and with a draft under
    `auto`, emulated graphs and overlap): equal to TP=1 constrained target-only, the grammar-masked
    graphs replayed alike on both ranks (depth by depth), every pool free."""
    r0, r1 = ranks[0]["constrained"], ranks[1]["constrained"]
    assert len(r0) == 4
    for key, r in r0.items():
        assert r["equal"] and r["free"] and r1[key]["free"], key
        assert r["masked"] == r1[key]["masked"] and sum(r["masked"].values()) > 0, key


def test_seed_regression_draft_extend_logprob_rows_under_scattered_tp(ranks: list[dict[str, Any]]) -> None:
    """The un-pruned draft-extend graph carries bs·(S+1) logprob rows, padded to the TP size and split
    over the ranks; its gathered logits equal eager at every request's selected row. `[bs]` (SGLang's
    #26416) in a captured graph's counts makes the gathered logits at the selected rows wrong (the
    counts matter: the output shows it); injected before capture, the capture check refuses the graph."""
    s = ranks[0]["seed"]
    w = s["width"]
    for bs in (3, 5):
        healthy, fault, capture = s[f"healthy/bs{bs}"], s[f"fault_unchecked/bs{bs}"], s[f"fault_capture/bs{bs}"]

        def rule(pbs: int) -> list[int]:
            return list(row_meta(ForwardMode.DRAFT_EXTEND, pbs, w, tp_size=2, layout="scattered")
                        .global_num_tokens_for_logprob)

        assert all(m == rule(int(p)) and sum(m) >= int(p) * w for p, m in healthy["metas"].items())
        assert not healthy["refused"] and healthy["rows"] == bs * w
        assert healthy["max_rel_err_sel"] < 1e-5 and healthy["bad_sel_rows"] == []
        # Wrong counts in a graph: the metadata differs from the rule, and the logits at the selected rows.
        assert any(m != rule(int(p)) for p, m in fault["metas"].items())
        assert not fault["refused"] and fault["bad_sel_rows"], fault
        assert fault["max_rel_err_sel"] > 0.1
        assert all(r >= 2 * fault["bucket"] for r in fault["bad_sel_rows"])  # past the [bs]-per-rank rows
        assert capture["refused"]
    for r in ranks:
        assert "error" not in r


def test_startup_validation_names_what_does_not_divide() -> None:
    with pytest.raises(EngineInputError, match="num_attention_heads=3 is not divisible by tp_size=2"):
        Engine(tiny_cfg(heads=3, kv=1, hidden=48), tp_size=2)
    with pytest.raises(EngineInputError, match=r"intermediate_size=131 .*; run it without tensor parallelism"):
        Engine(tiny_cfg(inter=131), tp_size=2)
    cfg = tiny_cfg(heads=6, kv=3, hidden=48, inter=96)
    assert tp_shape_errors(cfg.model.arch, 2, "") == [
        "num_key_value_heads=3 neither divides nor is divisible by tp_size=2; use --tp 1, 3 or 6 (tp_size under "
        "[engine])"]  # the fix: the sizes it divides into
    assert tp_shape_errors(cfg.model.arch, 3, "") == []
    assert tp_shape_errors(tiny_cfg(kv=1).model.arch, 4, "draft ") == []  # one KV head, replicated


def test_config_rejects_bad_topology() -> None:
    with pytest.raises(ValueError, match="tp_size=3 is not divisible by nnodes=2"):
        Engine(tiny_cfg(), tp_size=3, nnodes=2)


# --- processes: two "nodes", the daemon -----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model with SmolLM2's tokenizer (text in, text out; heads divide over 2 ranks)."""
    p = tmp_path_factory.mktemp("cfg") / "tiny-tok.toml"
    p.write_text(TINY_TOK)
    return p


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    """The multi-node secret, as an operator keeps it: a file only its owner can read."""
    import secrets

    p = tmp_path / "tp-secret"
    p.write_text(secrets.token_hex(32))
    p.chmod(0o600)
    return p


def generate_json(*args: str, timeout: float = 120) -> list[dict[str, Any]]:
    r = subprocess.run([sys.executable, "-m", "mleagle.cli", "generate", "--json", "--no-progress", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines()]


def test_two_launchers_as_two_nodes(tiny_tok: Path, secret_file: Path) -> None:
    """Rank 0 in `generate` (node 0) and rank 1 in `engine-ranks --node-rank 1` (node 1), gloo over
    loopback, meeting at MASTER_ADDR:MASTER_PORT: the same tokens as TP=1, and node 1's launcher ends
    cleanly (exit 0) when the engine stops."""
    args = ["--model", str(tiny_tok), "--prompt", "Hello there", "--prompt", "The sky is", "--max-new-tokens", "10",
            "--draft", "random:2"]
    want = Engine(str(tiny_tok), draft="random:2").generate(["Hello there", "The sky is"],
                                                           SamplingParams(temperature=0, max_new_tokens=10))
    port = str(free_port())
    node1 = subprocess.Popen([sys.executable, "-m", "mleagle.cli", "engine-ranks", "--tp", "2", "--nnodes", "2",
                              "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", port, "--no-restart",
                              "--tp-secret-file", str(secret_file)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        got = generate_json(*args, "--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port,
                            "--tp-layout", "scattered", "--tp-secret-file", str(secret_file))
        out = node1.communicate(timeout=60)[0]
    finally:
        if node1.poll() is None:
            node1.kill()
    assert [g["token_ids"] for g in got] == [c.token_ids for c in want]
    assert [g["text"] for g in got] == [c.text for c in want]
    assert node1.returncode == 0, out
    assert "started ranks [1]" in out and "stopped cleanly" in out


class LP(list):
    """Logprobs compare equal within float32 reduction-order noise (TP sums partial products in another order)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, list) and len(self) == len(other) and all(
            abs(a - b) < 1e-4 for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]


def test_a_dead_rank_on_another_node_ends_rank_0(tiny_tok: Path, secret_file: Path) -> None:
    """Node 1's rank is killed mid-generation: its launcher reports it in the rendezvous store, rank 0
    (in `generate` on node 0) ends at once with the reason instead of hanging in a collective, and the
    launcher (--no-restart) exits non-zero."""
    import time

    port = str(free_port())
    node1 = subprocess.Popen([sys.executable, "-m", "mleagle.cli", "engine-ranks", "--tp", "2", "--nnodes", "2",
                              "--node-rank", "1", "--master-port", port, "--no-restart", "--tp-secret-file",
                              str(secret_file)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    gen = subprocess.Popen([sys.executable, "-m", "mleagle.cli", "generate", "--model", str(tiny_tok), "--prompt", "Hi",
                            "--max-new-tokens", "500", "--ignore-eos", "--tp", "2", "--nnodes", "2", "--master-port",
                            port, "--tp-secret-file", str(secret_file)],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert gen.stdout is not None
        buf = ""
        while "tokens" not in buf:  # the progress line: generation has started on both nodes
            ch = gen.stdout.read(1)
            assert ch, buf
            buf += ch
        t0 = time.monotonic()
        os.kill(_children(node1.pid)[0], 9)
        out = buf + gen.communicate(timeout=60)[0]
        took = time.monotonic() - t0
        n1 = node1.communicate(timeout=60)[0]
    finally:
        for p in (gen, node1):
            if p.poll() is None:
                p.kill()
    assert gen.returncode != 0 and took < 15, (gen.returncode, took, out[-2000:])
    assert "rank 1 (pid" in out and "exited with code -9" in out, out[-2000:]
    assert node1.returncode == 1 and "ranks ended with codes [-9]" in n1, n1


def _oai_calls(url: str, key: str = "none") -> list[Any]:
    import openai

    c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
    res: list[Any] = []
    for prompt in ("Hello there", "The three primary colors are"):
        r = c.completions.create(model="tiny-tok", prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
        ch = r.choices[0]
        res.append((ch.text, ch.finish_reason, r.usage.completion_tokens, ch.logprobs.tokens))
        res.append(LP(ch.logprobs.token_logprobs))
    chunks = list(c.completions.create(model="tiny-tok", prompt="Once upon a time", max_tokens=10, temperature=0,
                                       stream=True))
    res.append("".join(ch.choices[0].text for ch in chunks if ch.choices))
    r = c.chat.completions.create(model="tiny-tok", messages=[{"role": "user", "content": "Name a fruit."}],
                                  max_tokens=10, temperature=0)
    res.append((r.choices[0].message.content, r.choices[0].finish_reason))
    r = c.completions.create(model="tiny-tok", prompt="Seeded", max_tokens=10, temperature=0.9, seed=5)
    res.append(r.choices[0].text)
    # Structured output under tensor parallelism: every rank builds the same matchers from the same
    # requests, so the constrained tokens (and the drafts' masks) agree across ranks and with TP=1.
    r = c.completions.create(model="tiny-tok", prompt="Pick a color:", max_tokens=8, temperature=0,
                             extra_body={"structured_outputs": {"regex": "(red|green|blue)( [a-z]{1,6})?"}})
    text = r.choices[0].text
    assert r.choices[0].finish_reason != "stop" or re.fullmatch("(red|green|blue)( [a-z]{1,6})?", text), text
    res.append((text, r.choices[0].finish_reason))
    r = c.chat.completions.create(model="tiny-tok", messages=[{"role": "user", "content": "JSON, please."}],
                                  max_tokens=16, temperature=0, response_format={"type": "json_object"})
    res.append((r.choices[0].message.content, r.choices[0].finish_reason))
    return res


async def _stream_until_error(url: str, started: Any, key: str) -> dict[str, Any]:
    import aiohttp

    from tests.daemon_helpers import sse_events

    body = {"model": "tiny-tok", "prompt": "Hello", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    out: dict[str, Any] = {"text": "", "error": None, "done": False}
    hdr = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body, headers=hdr) as r:
        async for ev in sse_events(r.content):
            if ev is None:
                out["done"] = True
            elif "error" in ev:
                out["error"] = ev["error"]
            elif ev.get("choices"):
                out["text"] += ev["choices"][0]["text"]
                started.set()
    return out


def _children(pid: int) -> list[int]:
    return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def test_daemon_tp2_answers_as_tp1_and_survives_a_killed_rank(tiny_tok: Path) -> None:
    import asyncio
    import signal

    from tests.daemon_helpers import ServerProc

    common = ("--config", str(tiny_tok), "--draft", "random:2")
    ref = ServerProc(*common)
    try:
        ref.wait_healthy(60)
        want = _oai_calls(ref.url)
        assert ref.terminate() == 0, ref.log()
    finally:
        ref.kill()
    # The API key comes from the environment: no rank process, and not the rendezvous store, ever sees it.
    key = "tp-secret-key-5b1f"
    srv = ServerProc(*common, "--tp", "2", env={"MLEAGLE_API_KEY": key})
    srv.api_key = key
    try:
        srv.wait_healthy(90)
        assert _oai_calls(srv.url, key) == want
        srv.wait_pools_free()
        d = srv.engine()
        kids = _children(d["pid"])
        assert len(kids) == 1  # rank 1, started by rank 0's engine process
        for pid in (d["pid"], kids[0]):
            for f in ("environ", "cmdline"):
                assert key.encode() not in Path(f"/proc/{pid}/{f}").read_bytes(), (pid, f)
        # The store (a private folder on one node; tests/test_tp_hardening.py tries it as a stranger) holds
        # the configuration rank 1 was built from, without the key.
        store = next(Path(os.readlink(f)).parent / "store" for f in Path(f"/proc/{d['pid']}/fd").iterdir()
                     if "/mleagle-tp-" in os.readlink(f))
        cfg = store.read_bytes()
        assert key.encode() not in cfg and b'"tp_size":2' in cfg.replace(b" ", b"")
        started = asyncio.Event()
        job = asyncio.create_task(_stream_until_error(srv.url, started, key))
        await asyncio.wait_for(started.wait(), 60)
        os.kill(kids[0], signal.SIGKILL)
        res = await asyncio.wait_for(job, 60)
        assert res["error"] is not None and res["done"] and res["text"], res  # an error, never a hang
        assert res["error"]["code"] == "engine_dead", res
        srv.wait_restart(60, 90)
        d2 = srv.engine()
        assert d2["restarts"] == 1 and d2["pid"] != d["pid"] and len(_children(d2["pid"])) == 1
        assert _oai_calls(srv.url, key) == want
        assert srv.terminate() == 0, srv.log()
    finally:
        srv.kill()


@pytest.mark.parametrize("run", ["events", "events_iter"])
def test_events_carry_per_rank_counts(ranks: list[dict[str, Any]], run: str) -> None:
    """Rank 0's logprob-metadata events: every forward's per-rank token and logprob counts by the layout's
    rule (all rows on every rank; or padded equal shares), all agreeing with the logit rows; eager, and
    with decode steps replayed as whole-iteration graphs (whose forwards no runner observer sees)."""
    assert set(ranks[0][run]) == {"all_reduce", "scattered"}
    for layout, evs in ranks[0][run].items():
        assert {e[1] for e in evs} >= {"EXTEND", "TARGET_VERIFY", "DRAFT_EXTEND"}
        for runner, mode, bs, width, rows, gnt, gntl, tp, lay, agree in evs:
            assert tp == 2 and lay == layout and agree, (runner, mode)
            if mode != "EXTEND":  # uniform: bs·W tokens; draft-extend logits pruned to one row per request
                want = row_meta(ForwardMode(mode), bs, width, pruned=mode == "DRAFT_EXTEND", tp_size=2, layout=layout)
                assert (gnt, gntl, rows) == (list(want.global_num_tokens), list(want.global_num_tokens_for_logprob),
                                             want.logit_rows), (runner, mode, bs)
            if layout == "scattered":
                assert len(set(gntl)) == 1 and sum(gntl) == -(-rows // 2) * 2
                assert len(set(gnt)) == 1 and sum(gnt) % 2 == 0
            else:
                assert gntl == [rows, rows] and gnt[0] == gnt[1]


async def test_tui_shows_per_rank_counts(ranks: list[dict[str, Any]], spmd_dir: Path) -> None:
    """`mleagle-tui` replaying rank 0's real events: the Logprobs tab names the ranks and the layout and
    shows each runner's per-rank tokens and logprob rows (the table lists them per forward)."""
    from mleagle.tui.app import MleagleTui
    from mleagle.tui.source import ReplaySource
    from tests.tui_helpers import screen_text, until

    src = ReplaySource(spmd_dir / "events_scattered.jsonl", speed=0)
    app = MleagleTui(src)
    async with app.run_test(size=(160, 40)) as pilot:
        await until(pilot, lambda: src.done)
        await pilot.press("5")
        await pilot.pause()
        app.refresh_view(force=True)
        await pilot.pause()
        text = screen_text(app)
    assert "tensor parallel 2 ranks, scattered" in text, text
    verify = [e for e in ranks[0]["events"]["scattered"] if e[0] == "target" and e[1] == "TARGET_VERIFY"][-1]
    line = next(x for x in text.splitlines() if "target" in x and "TARGET_VERIFY" in x and "per rank" in x)
    assert f"tokens {verify[5][0]} {verify[5][1]}  logprob rows {verify[6][0]} {verify[6][1]}  of {verify[4]}" in line


def test_gpu_tp_script_dry_run(tmp_path: Path) -> None:
    """scripts/gpu_tp.py (the two-GPU run) on the CPU: gloo, tiny model, emulated graphs, both layouts."""
    out = tmp_path / "gpu_tp.json"
    r = subprocess.run([sys.executable, "scripts/gpu_tp.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and set(res["runs"]) == {"tp1", "tp2/all_reduce", "tp2/scattered"}
    for key in ("tp2/all_reduce", "tp2/scattered"):
        c = res["runs"][key]["vs_tp1"]
        assert c["teacher_forced_max_abs_dlogprob"] < 1e-4 and all(x["equal"] for x in c["greedy"])
        assert all(s["graph_replays"] + s["iteration_replays"] > 0 for s in res["runs"][key]["steps"])
    assert "| tp2/scattered | 4 |" in r.stdout


@pytest.mark.gpu
def test_gpu_tp_two_gpus(tmp_path: Path) -> None:
    """The two-GPU run itself (NCCL, Llama-3-8B shape, graphs), one layout and fewer steps."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "gpu_tp.json"
    r = subprocess.run([sys.executable, "scripts/gpu_tp.py", "--layouts", "scattered", "--steps", "16", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads(out.read_text())["ok"]
