"""`mleagle bench serve-matrix`: server configurations x concurrencies x repeats, measured through real servers.

Each arm is a named set of `mleagle serve` flags (`--arm "target=--draft none"`), on top of shared ones
(`--config`, `--device`, `--serve-args`). For every repeat, the arms run in an order that rotates
from one repeat to the next, each in a server of its own started for that repeat (one server's
throughput moves by up to ±20 % from one start to the next, so a single start per arm would measure
its luck): the server is started on a free loopback port, waited for (`/health`), warmed up with a
few requests, then `bench serve`'s own client (`daemon/bench_serve.py`) runs each concurrency c with
4·c requests (`--requests-per-concurrency`, at least `--min-requests`), greedy, natural EOS; then the server is stopped (SIGTERM,
then SIGKILL, and whatever it started is waited for). With `--offline` the same prompts at the same
concurrencies are replayed straight through the engine of the same configuration
(`engine/entrypoints/bench_replay.py`, a closed loop over `add_request`/`step` in a process of its
own), which says how much of the served figure is engine scheduling and how much is the daemon. The
report gives per (arm, concurrency) the median over repeats with its min-max range of output tok/s,
requests/s, TTFT p50/p90 and ITL p50/p99, each arm's throughput against the baseline arm's (paired
per repeat) and the offline replay's; it prints a markdown table and writes one JSON with every raw
run (the dict `bench serve` writes), the command, the machine and each arm's server flags. Progress
goes to stderr. No server outlives the benchmark: a failed run stops its server, SIGINT, SIGTERM and
SIGHUP stop the one running, and on Linux a server gets SIGTERM when the benchmark dies even by
SIGKILL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mleagle.daemon import bench_serve
from mleagle.daemon.cli import build_parser as serve_parser
from mleagle.daemon.cli import make_config
from mleagle.daemon.openai_api import ChatRequest, CompletionRequest, to_sampling_params
from mleagle.engine.contract.config import MleagleConfig, data_dir

DEFAULT_ARMS = ["target=--draft none", "auto=", "always=--spec-policy always"]
# (report key, path into a `bench serve` result, column title)
METRICS: list[tuple[str, tuple[str, ...], str]] = [
    ("out_tok_s", ("output_throughput",), "out tok/s"),
    # The same until the last request was sent (`bench_serve.loaded`): the run without its drain.
    ("loaded_tok_s", ("loaded", "output_throughput"), "tok/s until last send"),
    ("req_s", ("request_throughput",), "req/s"),
    ("ttft_p50_ms", ("ttft_ms", "p50"), "TTFT p50 ms"),
    ("ttft_p90_ms", ("ttft_ms", "p90"), "TTFT p90 ms"),
    # The same after the first wave (the c requests a closed loop sends at once): a steady load's TTFT.
    ("ttft_steady_p90_ms", ("ttft_steady_ms", "p90"), "TTFT p90 after wave ms"),
    ("itl_p50_ms", ("itl_ms", "p50"), "ITL p50 ms"),
    ("itl_p99_ms", ("itl_ms", "p99"), "ITL p99 ms"),
    # The daemon's own CPU per streamed token over the run (`bench serve`, from `/debug/engine`).
    ("daemon_us_per_tok", ("server", "daemon_cpu_us_per_token"), "daemon CPU us/tok"),
    # Token deltas the daemon merged because it read several engine steps at once (its loop was behind).
    ("daemon_coalesced", ("server", "daemon_coalesced"), "daemon merged deltas"),
    # The engine process's main thread: its busy share of the run, and the part of it that is the
    # serving path's (sending outputs, state events, the daemon's messages) rather than steps.
    ("engine_busy", ("server", "engine_loop", "busy_share"), "engine loop busy"),
    ("engine_step_share", ("server", "engine_loop", "step_share"), "engine step share"),
    # The part of the steps the host spent blocked on the device (a GPU's result copies): near the step
    # share the device is the limit, near 0 the host is.
    ("engine_wait_share", ("server", "engine_loop", "device_wait_share"), "engine device wait share"),
    # The engine's decode iterations a second over the run and the decoding rows each carried: beside
    # the offline replay's, where a served engine's shortfall is (fewer rows: requests away from it).
    ("rows_per_iter", ("server", "engine_iterations", "rows_per_iteration"), "engine rows/iteration"),
    ("iters_per_s", ("server", "engine_iterations", "iterations_per_s"), "engine iterations/s"),
    # On CUDA, the device's time on those iterations: its share of the run, and µs an iteration (against
    # 1e6 / iterations a second, the rest is the device waiting for the host).
    ("device_busy", ("server", "engine_iterations", "device_busy_share"), "engine device busy share"),
    ("device_us_per_iter", ("server", "engine_iterations", "device_us_per_iteration"), "engine device us/iteration"),
    # What the speculation ran: its mean draft depth per decode iteration (the policy's mix of S') and
    # the accept length of its verifies; "-" for a target-only server.
    ("mean_depth", ("server", "spec", "mean_depth"), "mean depth"),
    ("accept_len", ("server", "spec", "accept_len"), "accept length"),
    # The load generator's own CPU share of one core: near 1, its queueing is in its TTFT and ITL.
    ("client_cpu_share", ("client_cpu_share",), "client CPU share"),
    # Its loops' stalls (a 10 ms timer 5 ms late or more), in all: time every stream of that loop waited.
    ("client_stalled_ms", ("client_loop_lag", "stalled_ms"), "client loop stalled ms"),
]
# The same from the offline replay (engine alone): what the daemon adds to latency shows beside them.
OFFLINE_METRICS: list[tuple[str, tuple[str, ...], str]] = [
    ("offline_loaded_tok_s", ("loaded", "output_throughput"), "offline tok/s until last send"),
    ("offline_ttft_p90_ms", ("ttft_ms", "p90"), "offline TTFT p90 ms"),
    ("offline_ttft_steady_p90_ms", ("ttft_steady_ms", "p90"), "offline TTFT p90 after wave ms"),
    ("offline_itl_p99_ms", ("itl_ms", "p99"), "offline ITL p99 ms"),
    ("offline_rows_per_iter", ("engine", "rows_per_iteration"), "offline rows/iteration"),
    ("offline_iters_per_s", ("engine", "iterations_per_s"), "offline iterations/s"),
    ("offline_device_busy", ("engine", "device_busy_share"), "offline device busy share"),
    ("offline_device_us_per_iter", ("engine", "device_us_per_iteration"), "offline device us/iteration"),
]
SECRET_ENV = ("MLEAGLE_API_KEY",)  # the benchmark's own loopback servers run without a key
STOP_KIDS_S = 15.0  # after the daemon exits: how long its engine (and ranks) may take to follow

# The children are started through this instead of `-m`: it asks Linux for SIGTERM when the benchmark
# dies (even by SIGKILL, where no `finally` runs), then runs the module as `python -m` would. The
# signal follows the thread that forked, so children are only ever started from the main thread.
LAUNCH = """\
import ctypes, os, runpy, signal, sys
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except OSError:
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)  # the benchmark died before prctl ran
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def log(msg: str) -> None:
    print(f"[serve-matrix {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- processes --------------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a live process, from /proc; None when it is gone (or no /proc)."""
    try:
        s = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = s[s.rindex(")") + 2:].split()
    return rest[0], rest[19]  # fields 3 and 22


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every process below `pid`, as (pid, start time): the engine and its ranks under a daemon. The
    start time tells a process we saw from a later one that reused its pid."""
    out: list[tuple[int, str]] = []
    todo = [pid]
    while todo:
        for f in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            with contextlib.suppress(OSError, ValueError):
                for k in map(int, f.read_text().split()):
                    st = _stat(k)
                    if st is not None:
                        out.append((k, st[1]))
                        todo.append(k)
    return out


def alive(ident: tuple[int, str]) -> bool:
    st = _stat(ident[0])
    return st is not None and st[1] == ident[1] and st[0] != "Z"


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Hold off SIGINT/SIGTERM/SIGHUP while a child is being stopped: a second Ctrl-C must not leave
    the stop half done (it escalates to SIGKILL by itself). Main thread only, like every signal call."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    got: list[int] = []
    prev = {s: signal.signal(s, lambda n, _f: got.append(n)) for s in sigs}
    try:
        yield
    finally:
        for s, h in prev.items():
            signal.signal(s, h)
        if got:
            raise KeyboardInterrupt(f"signal {got[0]}")


class Child:
    """A process this benchmark started in a session of its own (a Ctrl-C at the terminal reaches only
    the benchmark, which then stops it in order), and everything it started."""

    def __init__(self, module: str, args: list[str], what: str, capture: bool) -> None:
        self.what = what
        self.cmd = [sys.executable, "-c", LAUNCH, str(os.getpid()), module, *args]
        env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
        # Uncaptured output goes to our stderr (fd 2): stdout is the report's.
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE if capture else 2,
                                     stderr=subprocess.STDOUT if capture else None, text=True,
                                     start_new_session=True, env={**env, "PYTHONUNBUFFERED": "1"})
        self.kids: set[tuple[int, str]] = set()

    def note_kids(self) -> None:
        self.kids.update(descendants(self.proc.pid))

    def pids(self) -> list[int]:
        return [self.proc.pid, *sorted(k for k, _ in self.kids)]

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, `timeout` seconds, SIGKILL; then the processes it started get STOP_KIDS_S to follow
        (the daemon stops its engine; the engine's ranks die with it) before they are killed by pid."""
        with shielded():
            if self.proc.poll() is None:
                self.note_kids()
                self.proc.terminate()
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    log(f"{self.what}: no exit {timeout:.0f}s after SIGTERM; killing it")
                    self.note_kids()
                    self.proc.kill()
                    self.proc.wait(30)
            end = time.monotonic() + STOP_KIDS_S
            while any(alive(k) for k in self.kids) and time.monotonic() < end:
                time.sleep(0.1)
            for k in self.kids:
                if alive(k):
                    log(f"{self.what}: pid {k[0]} outlived its parent; killing it")
                    with contextlib.suppress(OSError):
                        os.kill(k[0], signal.SIGKILL)
            return self.proc.returncode


class Server(Child):
    """`mleagle serve FLAGS --host 127.0.0.1 --port 0`: the port is read from the line the daemon prints
    when it listens; its output is kept (the last lines, for failures) and optionally logged."""

    def __init__(self, argv: list[str], what: str, log_path: Path | None) -> None:
        super().__init__("mleagle.cli", ["serve", *argv, "--host", "127.0.0.1", "--port", "0"], what, True)
        self.lines: deque[str] = deque(maxlen=60)
        self.url = ""
        self.listening = threading.Event()
        threading.Thread(target=self._pump, args=(log_path,), daemon=True).start()

    def _pump(self, log_path: Path | None) -> None:
        assert self.proc.stdout is not None
        with open(log_path, "a") if log_path else contextlib.nullcontext() as f:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                if f is not None:
                    f.write(line)
                    f.flush()
                if not self.url and line.startswith("mleagle: serving"):
                    self.url = line.split(" on ")[1].split()[0]
                    self.listening.set()
        self.listening.set()

    def tail(self) -> str:
        return "\n".join(self.lines)

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, None

    def wait_ready(self, timeout: float) -> float:
        """Seconds until `/health` answered 200 (the engine loaded and warmed up)."""
        t0 = time.monotonic()
        end = t0 + timeout
        while not self.listening.wait(0.2):
            if time.monotonic() > end or self.proc.poll() is not None:
                break
        while self.url and time.monotonic() < end and self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                if self.get("/health", 2.0)[0] == 200:
                    self.note_kids()
                    return time.monotonic() - t0
            time.sleep(0.2)
        state = f"exited with {self.proc.returncode}" if self.proc.poll() is not None else f"not ready in {timeout:.0f}s"
        raise RuntimeError(f"server {state}")


# --- the plan ---------------------------------------------------------------------------------------
@dataclass
class Arm:
    name: str
    flags: list[str]  # the arm's own serve flags
    argv: list[str]  # what `mleagle serve` gets: the shared flags, then the arm's
    cfg: MleagleConfig  # the configuration those flags make (what the offline replay runs)


def parse_arm(text: str, shared: list[str]) -> Arm:
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
        raise ValueError(f"--arm {text!r}: give NAME=FLAGS (a name of letters, digits, _ . + -; FLAGS may be empty)")
    flags = shlex.split(rest)
    argv = [*shared, *flags]
    try:  # the flags are checked the way `mleagle serve` checks them, before any server starts
        ns = serve_parser().parse_args(argv)
        cfg = make_config(ns)
    except SystemExit:
        raise ValueError(f"arm {name}: `mleagle serve {shlex.join(argv)}` refuses these flags (see above)") from None
    except (ValidationError, ValueError, OSError) as e:
        raise ValueError(f"arm {name}: bad configuration: {e}") from None
    return Arm(name, flags, argv, cfg)


def parse_ints(text: str) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {text!r}: a comma-separated list of positive integers") from None
    if not xs or min(xs) < 1:
        raise ValueError(f"--concurrency {text!r}: a comma-separated list of positive integers")
    return xs


def client_procs(a: argparse.Namespace, conc: int) -> int:
    """Client processes for a run at `conc`: `--client-procs`, or by default one per 16 streams (at
    most 4): one asyncio client parsing every chunk of 32-64 fast streams queues them itself."""
    return a.client_procs if a.client_procs else max(1, min(4, conc // 16))


def client_args(a: argparse.Namespace, url: str, n: int, conc: int, seed: int) -> argparse.Namespace:
    """`bench serve`'s arguments for one run, parsed by its own parser (so its defaults hold)."""
    argv = ["--url", url, "--endpoint", a.endpoint, "--dataset", a.dataset,
            "--num-prompts", str(n), "--concurrency", str(conc), "--max-tokens", str(a.max_tokens),
            "--temperature", "0", "--seed", str(seed), "--timeout", str(a.timeout),
            "--client-procs", str(client_procs(a, conc))]
    if a.data_dir:
        argv += ["--data-dir", a.data_dir]
    if a.ignore_eos:
        argv.append("--ignore-eos")
    ns = bench_serve.build_parser().parse_args(argv)
    ns.argv = argv
    ns.api_key = None  # our servers run without a key (SECRET_ENV is kept from them)
    return ns


def n_requests(a: argparse.Namespace, c: int) -> int:
    return max(a.min_requests, a.requests_per_concurrency * c)


# --- machine ----------------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """What the numbers ran on, as far as this (torch-free) process can tell; the offline replay adds
    torch's view of the device (under `offline_engine`)."""
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), cpu)
    info: dict[str, Any] = {"node": platform.node(), "platform": platform.platform(), "cpu": cpu,
                            "cores": os.cpu_count(), "python": platform.python_version(),
                            "loadavg_start": [round(x, 2) for x in os.getloadavg()], "gpus": None}
    smi = shutil.which("nvidia-smi")
    if smi:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            r = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            info["gpus"] = [ln.strip() for ln in r.stdout.splitlines() if ln.strip()] or None
    return info


# --- one arm of one repeat --------------------------------------------------------------------------
def served_session(a: argparse.Namespace, arm: Arm, rep: int, order: int, concs: list[int], tag: str,
                   runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Start the arm's server, warm it up, run every concurrency, stop it; its record goes into `runs`
    at once, so an interrupted session still reports the concurrencies it finished."""
    rec: dict[str, Any] = {"repeat": rep, "arm": arm.name, "order": order, "results": [], "error": None}
    runs.append(rec)
    log_path = Path(a.log_dir) / f"{tag}.log" if a.log_dir else None
    log(f"{tag}: starting `mleagle serve {shlex.join(arm.argv)}`")
    t0 = time.monotonic()
    srv = Server(arm.argv, tag, log_path)
    rec["server"] = {"command": "mleagle " + shlex.join(srv.cmd[5:]), "pid": srv.proc.pid}
    try:
        rec["server"]["ready_s"] = srv.wait_ready(a.start_timeout)
        st, dbg = srv.get("/debug/engine")
        if st == 200 and isinstance(dbg, dict):
            rec["server"]["engine_pid"] = dbg.get("pid")
        log(f"{tag}: ready at {srv.url} in {rec['server']['ready_s']:.1f}s (daemon pid {srv.proc.pid}, "
            f"engine pid {rec['server'].get('engine_pid')})")
        if a.warmup:
            log(f"{tag}: warm-up, {a.warmup} requests")
            w = asyncio.run(bench_serve.run(client_args(a, srv.url, a.warmup, min(a.warmup, max(concs)), a.seed + 1)))
            rec["warmup"] = w
        for c in concs:
            n = n_requests(a, c)
            log(f"{tag}: concurrency {c}, {n} requests")
            res = asyncio.run(bench_serve.run(client_args(a, srv.url, n, c, a.seed)))
            rec["results"].append(res)
            log(f"{tag}: concurrency {c}: {res['output_throughput']:.1f} tok/s, {res['request_throughput']:.2f} req/s,"
                f" {res['failed']} failed, {res['duration_s']:.1f}s")
        # The engine's counters over the session (acceptance, draft steps run, preemptions), and its
        # restarts: an engine that died and came back mid-run has skewed that run.
        st, dbg = srv.get("/debug/engine", 30.0)
        if st == 200 and isinstance(dbg, dict):
            rec["server"]["engine_stats"] = dbg.get("stats")
            rec["server"]["engine_restarts"] = dbg.get("restarts")
            if dbg.get("restarts"):
                log(f"{tag}: WARNING: the engine restarted {dbg['restarts']} times during the session")
    except Exception as e:  # one broken arm must not take the others' results with it
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["server"]["log_tail"] = list(srv.lines)
        log(f"{tag}: FAILED: {rec['error']}; the server's last output:\n{srv.tail()}")
    finally:
        srv.note_kids()
        rec["server"]["pids"] = srv.pids()
        code = srv.stop(a.stop_timeout)
        rec["server"]["exit_code"] = code
        rec["server"]["session_s"] = time.monotonic() - t0
        log(f"{tag}: server stopped (exit code {code})")
    return rec


def offline_spec(a: argparse.Namespace, arm: Arm, concs: list[int]) -> dict[str, Any]:
    """What the replay needs: the arm's engine config, the sampling parameters the daemon makes of
    `bench serve`'s request body, and the very prompts each served run sent, in the same order."""
    ns = client_args(a, "", 1, 1, a.seed)
    body = bench_serve.request_body(ns, arm.cfg.model.name, "x")
    req = ChatRequest.model_validate(body) if a.endpoint == "chat" else CompletionRequest.model_validate(body)
    params = to_sampling_params(req, a.max_tokens, 0)
    ddir = data_dir(a.data_dir)
    wc = min(a.warmup, max(concs))
    return {"config": arm.cfg.for_engine(), "params": params.model_dump(mode="json"), "chat": a.endpoint == "chat",
            "warmup": {"concurrency": max(1, wc),
                       "prompts": bench_serve.load_prompts(a.dataset, ddir, a.warmup, a.seed + 1) if a.warmup else []},
            "runs": [{"concurrency": c, "prompts": bench_serve.load_prompts(a.dataset, ddir, n_requests(a, c), a.seed)}
                     for c in concs]}


def offline_session(a: argparse.Namespace, arm: Arm, spec: dict[str, Any], tmp: Path, tag: str) -> dict[str, Any]:
    rec: dict[str, Any] = {"results": [], "error": None}
    sp, out = tmp / f"{tag}-spec.json", tmp / f"{tag}-out.json"
    sp.write_text(json.dumps(spec))
    log(f"{tag}: offline replay through the engine")
    t0 = time.monotonic()
    child = Child("mleagle.engine.entrypoints.bench_replay", ["--spec", str(sp), "--out", str(out)], tag, False)
    try:
        code = child.proc.wait()
        if code != 0 or not out.is_file():
            raise RuntimeError(f"the replay exited with {code} (its output is above)")
        raw = json.loads(out.read_text())
        for run in raw.pop("runs"):
            res = bench_serve.summarize([bench_serve.Result(**r) for r in run["requests"]], run["duration_s"],
                                        run["concurrency"])
            rec["results"].append({"concurrency": run["concurrency"], "num_prompts": len(run["requests"]), **res,
                                   "engine": bench_serve.iteration_summary(run.get("engine_before"), run.get("engine_after"),
                                                                           run["duration_s"])})
            log(f"{tag}: concurrency {run['concurrency']}: {res['output_throughput']:.1f} tok/s")
        rec.update(raw)
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        log(f"{tag}: FAILED: {rec['error']}")
    finally:
        child.note_kids()
        child.stop(a.stop_timeout)
        rec["session_s"] = time.monotonic() - t0
    return rec


# --- the report -------------------------------------------------------------------------------------
def cell(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def dig(d: dict[str, Any], path: tuple[str, ...]) -> float | None:
    """The figure at `path`, None where a run lacks it (an older report, a server without /debug)."""
    for k in path:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return float(d)  # type: ignore[arg-type]


def digs(got: list[dict[str, Any]], path: tuple[str, ...]) -> list[float]:
    return [v for g in got if (v := dig(g, path)) is not None]


Runs = dict[tuple[str, int, int], dict[str, Any]]  # (arm, repeat, concurrency) -> a run's result


def paired(served: Runs, other: Runs, who: str, arm: str, c: int, reps: list[int]) -> list[float]:
    """Per repeat where both ran: `arm`'s served output tok/s over `who`'s in `other`."""
    out = []
    for k in reps:
        x, y = served.get((arm, k, c)), other.get((who, k, c))
        if x is not None and y is not None and y["output_throughput"] > 0:
            out.append(x["output_throughput"] / y["output_throughput"])
    return out


def summary(runs: list[dict[str, Any]], arms: list[str], concs: list[int], base: str) -> list[dict[str, Any]]:
    """Per (concurrency, arm): each metric over the repeats; throughput against the baseline arm and
    against the offline replay, as ratios paired within a repeat (both sides ran minutes apart, not a
    whole matrix apart, so the machine's drift cancels)."""
    served: Runs = {}
    offline: Runs = {}
    for r in runs:
        for res in r.get("results") or []:
            served[(r["arm"], r["repeat"], res["concurrency"])] = res
        for res in (r.get("offline") or {}).get("results") or []:
            offline[(r["arm"], r["repeat"], res["concurrency"])] = res
    reps = sorted({r["repeat"] for r in runs})
    rows = []
    for c in concs:
        for arm in arms:
            got = [served[(arm, k, c)] for k in reps if (arm, k, c) in served]
            row: dict[str, Any] = {"concurrency": c, "arm": arm, "repeats": len(got),
                                   "failed": sum(g["failed"] for g in got)}
            for key, path, _ in METRICS:
                row[key] = cell(digs(got, path))
            off = [offline[(arm, k, c)] for k in reps if (arm, k, c) in offline]
            for key, path, _ in OFFLINE_METRICS:
                row[key] = cell(digs(off, path))
            row["vs_baseline"] = cell(paired(served, served, base, arm, c, reps))
            row["offline_out_tok_s"] = cell(digs(off, ("output_throughput",)))
            row["served_over_offline"] = cell(paired(served, offline, arm, arm, c, reps))
            # The server's TTFT split (`bench serve`'s `ttft_phases`): mean per phase, and its mean over
            # the slowest tenth of the requests, over the repeats.
            names = [n for g in got for n in ((g.get("server") or {}).get("ttft_phases") or {}).get("phases", {})]
            row["ttft_phases"] = {n: {k: cell(digs(got, ("server", "ttft_phases", "phases", n, k)))
                                      for k in ("mean_ms", "slowest_tenth_mean_ms")} for n in dict.fromkeys(names)}
            # What the split does not see (`bench serve`'s `ttft_outside`), before and after it.
            out = {n: {k: cell(digs(got, ("server", "ttft_outside", n, k))) for k in ("mean_ms", "slowest_tenth_mean_ms")}
                   for n in ("before_route", "after_write")}
            if out["before_route"]["mean_ms"] is not None:
                row["ttft_phases"] = {"before_route": out["before_route"], **row["ttft_phases"],
                                      "after_write": out["after_write"]}
            rows.append(row)
    return rows


def fmt(x: float, ratio: bool = False) -> str:
    if ratio:
        return f"{x:.2f}"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def show(c: dict[str, float] | None, ratio: bool = False) -> str:
    if c is None:
        return "-"
    m, lo, hi = (fmt(c[k], ratio) for k in ("median", "min", "max"))
    return m if lo == hi else f"{m} ({lo}-{hi})"


def table(rows: list[dict[str, Any]], base: str, offline: bool) -> str:
    head = ["conc", "arm", METRICS[0][2], f"vs {base}", *(t for _, _, t in METRICS[1:])]
    if offline:
        head += ["offline tok/s", "served/offline", *(t for _, _, t in OFFLINE_METRICS)]
    head.append("failed")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if i != 1 else "---" for i in range(len(head))) + "|"]
    for r in rows:
        cells = [str(r["concurrency"]), r["arm"], show(r["out_tok_s"]), show(r["vs_baseline"], True),
                 *(show(r[k]) for k, _, _ in METRICS[1:])]
        if offline:
            cells += [show(r["offline_out_tok_s"]), show(r["served_over_offline"], True),
                      *(show(r.get(k)) for k, _, _ in OFFLINE_METRICS)]
        cells.append(str(r["failed"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def phase_table(rows: list[dict[str, Any]]) -> str:
    """The TTFT split in the server per (concurrency, arm): each phase's mean ms, and after the slash
    its mean over the slowest tenth of the requests (medians over the repeats); '' without splits.
    `before_route` and `after_write`, where the client could match its requests to the server's, are
    the client's time outside the split (their slowest tenth: by the client's TTFT)."""
    names = list(dict.fromkeys(n for r in rows for n in r.get("ttft_phases") or {}))
    if not names:
        return ""
    lines = ["| conc | arm | " + " | ".join(names) + " |", "|---:|---|" + "---:|" * len(names)]

    def one(ph: dict[str, Any], n: str) -> str:
        m, sl = ((ph.get(n) or {}).get(k) for k in ("mean_ms", "slowest_tenth_mean_ms"))
        return "-" if m is None else f"{fmt(m['median'])} / {fmt(sl['median'])}" if sl else fmt(m["median"])

    for r in rows:
        ph = r.get("ttft_phases") or {}
        lines.append(f"| {r['concurrency']} | {r['arm']} | " + " | ".join(one(ph, n) for n in names) + " |")
    return "\n".join(lines)


def legend(rep: dict[str, Any]) -> str:
    s, m = rep["settings"], rep["machine"]
    where = ", ".join(m["gpus"]) if m.get("gpus") else f"{m['cpu'] or 'CPU'} ({m['cores']} cores)"
    reqs = ", ".join(f"c{c}: {n}" for c, n in s["requests"].items())
    return (f"{rep['model']} on {where}; {s['dataset']} ({s['endpoint']}), max_tokens {s['max_tokens']}, greedy, "
            f"{'ignore_eos' if s['ignore_eos'] else 'natural EOS'}; requests per run {reqs}; "
            f"{s['warmup']} warm-up requests per server; median over {s['repeats']} repeat{'s' * (s['repeats'] != 1)} "
            "(min-max), a fresh server per arm per repeat, arm order rotating; ratios paired within a repeat.")


def save(rep: dict[str, Any], path: str | None) -> None:
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".part")
        tmp.write_text(json.dumps(rep, indent=1))
        tmp.replace(p)  # a reader (or an interrupt) never meets half a file


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mleagle bench serve-matrix",
        description="Start servers for several configurations and benchmark each at several concurrencies, "
                    "repeated with fresh servers in rotating order; optionally replay the same load offline.")
    ap.add_argument("--arm", action="append", default=None, metavar="NAME=FLAGS",
                    help="a configuration: a name and its `mleagle serve` flags, e.g. 'target=--draft none' "
                         f"(repeatable; default: {' '.join(repr(x) for x in DEFAULT_ARMS)})")
    ap.add_argument("--baseline", default=None, help="the arm the others are compared with (default: the first)")
    ap.add_argument("--config", default=None, help="serve --config for every arm")
    ap.add_argument("--device", default=None, help="serve --device for every arm")
    ap.add_argument("--dtype", default=None, help="serve --dtype for every arm")
    ap.add_argument("--serve-args", default="", help="more serve flags for every arm, one string (before the arm's)")
    ap.add_argument("--concurrency", default="1,8,32,64", help="comma-separated concurrencies")
    ap.add_argument("--requests-per-concurrency", type=int, default=4, help="a run at concurrency c sends this times c")
    ap.add_argument("--min-requests", type=int, default=16, help="... but at least this many requests")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=16, help="requests each fresh server gets before timing")
    ap.add_argument("--dataset", default="mt_bench", help="mt_bench | gsm8k | alpaca | path.jsonl")
    ap.add_argument("--data-dir", default=None, help="default: $MLEAGLE_DATA_DIR, else ../shared/data")
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens (default: natural EOS)")
    ap.add_argument("--seed", type=int, default=0, help="prompt order (warm-up prompts use seed + 1)")
    ap.add_argument("--offline", action="store_true",
                    help="also replay each run's prompts through the arm's engine alone (closed loop, same concurrency)")
    ap.add_argument("--client-procs", type=int, default=0,
                    help="bench serve --client-procs for every run (default 0: one per 16 streams, at most 4)")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to be healthy")
    ap.add_argument("--stop-timeout", type=float, default=60.0, help="seconds after SIGTERM before SIGKILL")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take (bench serve --timeout)")
    ap.add_argument("--log-dir", default=None, help="keep each server's output here (one file per server)")
    ap.add_argument("--output", default="results/bench_serve_matrix.json", help="the JSON report ('' for none)")
    ap.add_argument("--markdown", default=None, help="also write the table here")
    return ap


def on_signal(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through every `finally`, which stops the servers


def bench_matrix_main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    shared = [*(["--config", a.config] if a.config else []), *(["--device", a.device] if a.device else []),
              *(["--dtype", a.dtype] if a.dtype else []), *shlex.split(a.serve_args)]
    try:
        if a.repeats < 1 or a.requests_per_concurrency < 1 or a.min_requests < 1 or a.warmup < 0:
            raise ValueError("--repeats, --requests-per-concurrency and --min-requests must be >= 1, --warmup >= 0")
        concs = parse_ints(a.concurrency)
        arms = [parse_arm(x, shared) for x in (a.arm or DEFAULT_ARMS)]
        names = [x.name for x in arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names repeat: {names}")
        base = a.baseline or names[0]
        if base not in names:
            raise ValueError(f"--baseline {base!r} is none of the arms {names}")
        # The prompts are read once here too, so a missing dataset fails before any server starts.
        specs = {x.name: offline_spec(a, x, concs) for x in arms} if a.offline else {}
        if not a.offline:
            bench_serve.load_prompts(a.dataset, data_dir(a.data_dir), 1, a.seed)
    except (ValueError, OSError) as e:
        print(f"mleagle bench serve-matrix: {e}", file=sys.stderr)
        return 2
    if a.log_dir:
        Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    cmd = "mleagle bench serve-matrix " + shlex.join(sys.argv[1:] if argv is None else argv)
    rep: dict[str, Any] = {
        "command": cmd, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(),
        "model": arms[0].cfg.model.name,
        "settings": {"dataset": a.dataset, "endpoint": a.endpoint, "max_tokens": a.max_tokens, "temperature": 0.0,
                     "ignore_eos": a.ignore_eos, "seed": a.seed, "repeats": a.repeats, "concurrency": concs,
                     "requests": {str(c): n_requests(a, c) for c in concs}, "warmup": a.warmup,
                     "offline": a.offline, "baseline": base, "shared_serve_flags": shared},
        "arms": {x.name: {"flags": x.flags, "serve_command": "mleagle serve " + shlex.join(x.argv),
                          "model": x.cfg.model.name, "engine": x.cfg.engine.model_dump(mode="json")} for x in arms},
        "runs": [], "summary": None, "table": None, "interrupted": False,
    }
    log(f"{len(arms)} arms x {len(concs)} concurrencies x {a.repeats} repeats"
        f"{' (+ offline replay)' if a.offline else ''}; report: {a.output or '-'}")
    prev = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="mleagle-matrix-") as tmp:
            for k in range(a.repeats):
                order = arms[k % len(arms):] + arms[:k % len(arms)]  # each arm takes each slot in turn
                for j, arm in enumerate(order):
                    tag = f"r{k + 1}-{arm.name}"
                    rec = served_session(a, arm, k, j, concs, tag, rep["runs"])
                    if a.offline and "ready_s" not in rec["server"]:
                        # The replay builds the same engine: it would fail the same way, only later.
                        rec["offline"] = {"results": [], "error": "skipped: the server never became ready"}
                    elif a.offline:
                        rec["offline"] = offline_session(a, arm, specs[arm.name], Path(tmp), tag + "-offline")
                        if rep["machine"].get("offline_engine") is None and rec["offline"].get("machine"):
                            rep["machine"]["offline_engine"] = rec["offline"]["machine"]
                    save(rep, a.output)
    except KeyboardInterrupt as e:
        rep["interrupted"] = True
        log(f"interrupted ({e or 'SIGINT'}); reporting what finished")
    finally:
        for s, h in prev.items():
            signal.signal(s, h)
    rep["duration_s"] = time.monotonic() - t0
    rep["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    rows = summary(rep["runs"], [x.name for x in arms], concs, base)
    rep["summary"] = rows
    rep["table"] = legend(rep) + "\n\n" + table(rows, base, a.offline)
    phases = phase_table(rows)
    if phases:
        rep["table"] += ("\n\nTTFT split in the server, ms: mean / mean of the slowest tenth of the requests "
                         "(medians over the repeats); before_route and after_write: the client's time outside "
                         "the split, from sending to the route and from the first frame written to reading it\n\n"
                         + phases)
    save(rep, a.output)
    print(rep["table"])
    if a.markdown:
        Path(a.markdown).write_text(rep["table"] + "\n")
    if a.output:
        print(f"wrote {a.output}")
    errors = [r["error"] for r in rep["runs"] if r["error"]] + [
        r["offline"]["error"] for r in rep["runs"] if r.get("offline") and r["offline"]["error"]]
    failed = sum(row["failed"] for row in rows)
    if errors or failed:
        print(f"mleagle bench serve-matrix: {len(errors)} sessions failed, {failed} requests failed", file=sys.stderr)
    return 130 if rep["interrupted"] else 1 if errors or failed else 0


if __name__ == "__main__":
    sys.exit(bench_matrix_main())
