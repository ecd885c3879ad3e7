"""Tensor-parallel rank processes: rendezvous, local ranks, liveness, rank 0's schedule, the followers.

Topology. `tp_size` ranks on `nnodes` nodes, L = tp_size/nnodes per node; global rank = node_rank·L +
local rank, and the local rank is the GPU index. Rank 0 lives in the engine's own process (the daemon's
engine process, or the process that built an offline `Engine`). When that Engine starts, rank 0 hosts
the rendezvous store (torch.distributed's TCPStore at MASTER_ADDR:MASTER_PORT, as torchrun's c10d
rendezvous does), publishes the engine configuration in it, and starts its node's other ranks as child
processes (`python -m mleagle.engine.service.ranks`); every other node runs `mleagle engine-ranks
--node-rank K`, which starts that node's ranks. Each rank joins the process group (NCCL on GPUs, gloo
on CPUs) and a gloo control group, builds the same Engine from the published configuration, and follows.
A process group set up by another launcher (torchrun, the tests) is adopted as it is (`adopt`).

Schedule. Before every scheduler step rank 0 broadcasts on the control group the control messages it
took since the last one (requests added, with their resolved seeds; aborts); every rank applies them and
runs the same deterministic scheduler and worker, so every rank launches the same forwards with the same
shapes, and the device-resident sampling (a counter-based RNG over the same gathered logits) makes the
same tokens. Only rank 0 reports to the daemon. A digest of rank 0's previous step outputs rides along;
a follower whose own outputs differ stops with a clear error instead of drifting into mismatched
collectives. An idle rank 0 sends nothing: followers wait in the control broadcast without a timeout.

Liveness: no rank may hang on a dead one. Each rank's watchdog thread bumps a heartbeat counter in the
store (over its own connection) and watches the others'; a counter that stops for `tp_timeout_s`, a
store that cannot be reached (rank 0, its host, is gone), a local child rank that exits, or a failure
reported in the store ends the process at once with `os._exit`, because a thread blocked in a
collective cannot be interrupted. A rank that fails, and `engine-ranks` when one of its ranks dies
(checked against the pid that rank registered, so a failure is never reported to a newer rank 0),
report it in the store, so every node learns within a heartbeat. Child ranks also get SIGTERM when
their parent dies (PR_SET_PDEATHSIG). The daemon then restarts rank 0, which starts its node's ranks
again, and `engine-ranks` restarts its node's ranks for the new rank 0 (a clean stop of the engine
ends it with exit code 0); `tp_timeout_s` bounds the rest (a rank alive but stuck, a silent host).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mleagle.engine.contract.config import EngineConfig, MleagleConfig
from mleagle.engine.distributed import TPGroup, set_current

log = logging.getLogger("mleagle.engine.ranks")
CONFIG_KEY = "mleagle/config"
FAILED_KEY = "mleagle/failed"  # set by whoever sees a rank fail first: every watchdog then ends its rank
HEARTBEAT_S = 0.5
JOIN_TIMEOUT_S = 600.0  # ranks that never arrive (torchrun's rendezvous join timeout)
STOP_ACK_S = 10.0  # how long rank 0 waits for the followers to acknowledge a clean stop
CONTROL_TIMEOUT = datetime.timedelta(days=365)  # followers wait for an idle rank 0 without a limit
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


class RankError(RuntimeError):
    """The ranks disagree (a follower's outputs differ from rank 0's) or cannot be set up."""


@dataclass
class Topology:
    tp: int
    nnodes: int = 1
    node_rank: int = 0
    addr: str = "127.0.0.1"
    port: int = 0  # 0: rank 0 picks a free one (one node only)

    @property
    def local_size(self) -> int:
        return self.tp // self.nnodes

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.local_size + local_rank

    def check(self) -> None:
        if self.tp < 1 or self.nnodes < 1 or self.tp % self.nnodes:
            raise ValueError(f"--tp {self.tp} must be a positive multiple of --nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in 0..{self.nnodes - 1}")


def topology(e: EngineConfig) -> Topology:
    """Rank 0's view: the config, else $MASTER_ADDR / $MASTER_PORT, else loopback and a free port."""
    addr = e.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = e.master_port if e.master_port is not None else int(os.environ.get("MASTER_PORT") or 0)
    if e.nnodes > 1 and not port:
        raise ValueError("a multi-node engine needs a rendezvous port: --master-port (or $MASTER_PORT)")
    t = Topology(e.tp_size, e.nnodes, 0, addr, port)
    t.check()
    return t


@dataclass
class Control:
    """What rank 0 tells the followers before a step: messages to apply, then step, or stop."""

    msgs: list[tuple[Any, ...]] = field(default_factory=list)
    step: bool = False
    stop: bool = False
    digest: int = -1  # of rank 0's previous step's outputs (-1: not checked, e.g. a stop)


class Watchdog(threading.Thread):
    """Heartbeats and watches: other ranks' heartbeats, the store itself, and local child ranks."""

    def __init__(self, rt: Runtime, timeout: float):
        super().__init__(name="mleagle-rank-watchdog", daemon=True)
        self.rt, self.timeout = rt, timeout
        self.halt = threading.Event()

    def stop(self) -> None:
        self.halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(2 * HEARTBEAT_S + 5)

    def run(self) -> None:
        rt = self.rt
        try:
            # Its own connection: the main thread's store may be busy in a long wait (the join barrier).
            store = dist.TCPStore(rt.topo.addr, rt.topo.port, None, False, datetime.timedelta(seconds=30))
        except Exception as e:
            rt.die(f"rank {rt.rank}: cannot reach the rendezvous store ({e})", report=False)
            return
        others = [r for r in range(rt.size) if r != rt.rank]
        seen: dict[int, tuple[int, float]] = {}
        while not self.halt.wait(HEARTBEAT_S):
            now = time.monotonic()
            try:
                if store.check([FAILED_KEY]):
                    rt.die(store.get(FAILED_KEY).decode(), report=False)
                store.add(f"hb/{rt.rank}", 1)
                for r in others:
                    v = store.add(f"hb/{r}", 0)
                    last = seen.get(r)
                    if v and (last is None or v != last[0]):
                        seen[r] = (v, now)
                    elif last is not None and now - last[1] > self.timeout:
                        rt.die(f"rank {r} has not answered for {self.timeout:.0f}s")
            except Exception as e:
                if self.halt.is_set():
                    return
                rt.die(f"rank {rt.rank} lost the rendezvous store ({type(e).__name__}): rank 0 is gone", report=False)
            for lr, p in rt.children:
                if p.poll() is not None and not self.halt.is_set():
                    rt.die(f"rank {rt.topo.global_rank(lr)} (pid {p.pid}) exited with code {p.returncode}")


class Runtime:
    """This process's rank: its groups, the store, its local child ranks, the control channel."""

    def __init__(self, topo: Topology, rank: int, local_rank: int, store: Any, owned: bool,
                 children: list[tuple[int, subprocess.Popen[bytes]]] | None = None):
        self.topo, self.rank, self.local_rank = topo, rank, local_rank
        self.size = topo.tp
        self.store = store
        self.owned = owned  # this process set the group up (not torchrun or a test harness)
        self.children = children or []
        self.ctl: Any = None  # the gloo control group, made when the process group exists (`_join`)
        self.tp = TPGroup(rank, self.size, None)
        self.watchdog: Watchdog | None = None
        self.closed = False
        self.broken = False  # a step failed in a collective: no clean stop is possible
        self._hdr = torch.zeros(4, dtype=torch.int64)

    # --- liveness ---------------------------------------------------------------------------------
    def watch(self, timeout: float) -> None:
        if self.store is not None and self.watchdog is None:
            self.watchdog = Watchdog(self, timeout)
            self.watchdog.start()

    def die(self, why: str, report: bool = True) -> None:
        """A rank is gone: every collective may hang now, so end this process (and its child ranks),
        telling the other ranks first when the store is still there (over a fresh connection: the main
        thread may hold its own in a long wait)."""
        log.error("mleagle: tensor-parallel engine going down: %s", why)
        self.kill_children()
        if report and self.store is not None:
            report_failure(self.topo, why)
        os._exit(1)

    def failed(self, err: BaseException) -> RankError:
        """A step raised (a collective failed): name the rank that is gone where anyone knows, and mark
        this runtime broken (no clean stop: the others are failing too)."""
        self.broken = True
        why = None
        t0 = time.monotonic()
        while why is None and time.monotonic() - t0 < 2.0:  # a launcher's report may be a moment behind
            for lr, p in self.children:
                if p.poll() is not None:
                    why = f"rank {self.topo.global_rank(lr)} (pid {p.pid}) exited with code {p.returncode}"
            try:
                if why is None and self.store is not None and self.store.check([FAILED_KEY]):
                    why = self.store.get(FAILED_KEY).decode()
            except Exception:
                why = "the rendezvous store is gone (rank 0's process)"
            if why is None:
                time.sleep(0.1)
        return RankError(f"a tensor-parallel rank failed: {why or f'{type(err).__name__}: {err}'}")

    def kill_children(self) -> None:
        for _, p in self.children:
            if p.poll() is None:
                p.kill()

    # --- the control channel (rank 0 → followers) ------------------------------------------------
    def send(self, c: Control) -> None:
        data = pickle.dumps(c.msgs) if c.msgs else b""
        h = self._hdr
        h[0], h[1], h[2], h[3] = len(data), int(c.step), int(c.stop), c.digest
        dist.broadcast(h, 0, group=self.ctl)
        if data:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.ctl)

    def recv(self) -> Control:
        h = self._hdr
        dist.broadcast(h, 0, group=self.ctl)
        n, step, stop, digest = (int(x) for x in h.tolist())
        msgs: list[tuple[Any, ...]] = []
        if n:
            buf = torch.empty(n, dtype=torch.uint8)
            dist.broadcast(buf, 0, group=self.ctl)
            msgs = pickle.loads(buf.numpy().tobytes())
        return Control(msgs, bool(step), bool(stop), digest)

    # --- ending -------------------------------------------------------------------------------------
    def stop_engine(self) -> None:
        """Rank 0: the engine is closed; followers return from `follow` (and, ours, exit)."""
        if self.rank != 0 or self.closed:
            return
        if not self.owned:
            self.send(Control(stop=True))
            return
        self.closed = True
        if self.broken:  # the other ranks are failing: nothing to tell them, nothing to wait for
            self.kill_children()
            self._destroy()
            return
        if self.watchdog is not None:  # followers exiting now is the plan, not a failure
            self.watchdog.stop()
        try:
            self.send(Control(stop=True))
            try:
                self.store.wait([f"done/{r}" for r in range(1, self.size)], datetime.timedelta(seconds=STOP_ACK_S))
            except Exception:
                log.warning("not every rank acknowledged the stop in %.0fs", STOP_ACK_S)
        except Exception:
            log.warning("could not tell the other ranks to stop; killing the local ones")
        t0 = time.monotonic()
        for _, p in self.children:
            try:
                p.wait(max(0.1, STOP_ACK_S - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
        self._destroy()

    def finish_follower(self) -> None:
        """A follower of ours after a clean stop: quiet the watchdog, acknowledge, leave the groups."""
        self.closed = True
        if self.watchdog is not None:
            self.watchdog.stop()
        try:
            self.store.set(f"done/{self.rank}", "1")
        except Exception:
            pass
        self._destroy()

    def _destroy(self) -> None:
        global _RT
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        set_current(TPGroup())
        _RT = None


_RT: Runtime | None = None


def runtime() -> Runtime | None:
    return _RT


def report_failure(topo: Topology, why: str, store: Any = None, rank: int | None = None, pid: int | None = None) -> None:
    """Tell every rank through the store (best effort, never blocking long). With `rank`/`pid` (a
    launcher reporting a dead child), only if that pid is the one the rank registered in this store:
    the store may already belong to a newer rank 0, whose engine must not be failed."""
    try:
        if store is None:
            store = dist.TCPStore(topo.addr, topo.port, None, False, datetime.timedelta(seconds=2))
        if rank is not None:
            key = f"pid/{rank}"
            if not store.check([key]) or store.get(key).decode() != str(pid):
                return
        if not store.check([FAILED_KEY]):
            store.set(FAILED_KEY, why)
    except Exception:
        pass


def _backend(cfg: MleagleConfig) -> str:
    return "nccl" if cfg.engine.resolved_device() == "cuda" else "gloo"


def _join(rt: Runtime, backend: str) -> Runtime:
    """Join the process group (the default group: the model's collectives) and the control group."""
    global _RT
    if backend == "nccl":
        torch.cuda.set_device(rt.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.PrefixStore("pg", rt.store), rank=rt.rank, world_size=rt.size,
                                timeout=COLLECTIVE_TIMEOUT)
    rt.ctl = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    set_current(rt.tp)
    _RT = rt
    return rt


def _spawn_rank(topo: Topology, local_rank: int, parent: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "mleagle.engine.service.tp_driver", "--rank", str(topo.global_rank(local_rank)),
           "--local-rank", str(local_rank), "--tp", str(topo.tp), "--nnodes", str(topo.nnodes),
           "--node-rank", str(topo.node_rank), "--master-addr", topo.addr, "--master-port", str(topo.port),
           "--parent-pid", str(parent)]
    # The environment is passed on whole (PYTHONPATH, NCCL_* and the NVLink-multicast switches among it).
    return subprocess.Popen(cmd, env=dict(os.environ))


def start_rank0(cfg: MleagleConfig) -> Runtime:
    """Rank 0 of an engine with tp_size > 1: host the store, publish the config, start the local ranks,
    join the group. Remote nodes' ranks (`mleagle engine-ranks`) join through the same store."""
    topo = topology(cfg.engine)
    store = dist.TCPStore(topo.addr, topo.port, topo.tp, True, datetime.timedelta(seconds=JOIN_TIMEOUT_S),
                          wait_for_workers=False)
    topo.port = store.port
    store.set(CONFIG_KEY, cfg.for_engine())  # no secret (the API key) ever reaches the store
    children = [(lr, _spawn_rank(topo, lr, os.getpid())) for lr in range(1, topo.local_size)]
    log.info("tensor parallel: rank 0 of %d (%d per node on %d nodes), rendezvous %s:%d, %d local ranks started",
             topo.tp, topo.local_size, topo.nnodes, topo.addr, topo.port, len(children))
    rt = Runtime(topo, 0, 0, store, owned=True, children=children)
    try:
        rt.watch(cfg.engine.tp_timeout_s)  # before the join: a local rank that dies while starting is noticed
        _join(rt, _backend(cfg))
    except BaseException:
        rt.kill_children()
        raise
    atexit.register(rt.stop_engine)
    return rt


def join_follower(topo: Topology, rank: int, local_rank: int) -> tuple[Runtime, MleagleConfig]:
    """A rank above 0 started by rank 0 or by `engine-ranks`: meet rank 0's store, read the engine's
    configuration from it, join the group."""
    store = dist.TCPStore(topo.addr, topo.port, None, False, datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    cfg = MleagleConfig.model_validate_json(store.get(CONFIG_KEY))
    if cfg.engine.tp_size != topo.tp:
        raise RankError(f"rank 0 runs tp_size {cfg.engine.tp_size}, this rank was started for {topo.tp}")
    store.set(f"pid/{rank}", str(os.getpid()))  # what a launcher checks before reporting this rank dead
    rt = Runtime(topo, rank, local_rank, store, owned=True)
    rt.watch(cfg.engine.tp_timeout_s)
    _join(rt, _backend(cfg))
    return rt, cfg


def adopt() -> Runtime:
    """A process group another launcher set up (torchrun, the tests): use it as it is."""
    if _RT is None:
        topo = Topology(dist.get_world_size())
        _join(Runtime(topo, dist.get_rank(), int(os.environ.get("LOCAL_RANK", dist.get_rank())), None, owned=False),
              dist.get_backend())
    assert _RT is not None
    return _RT


def attach(cfg: MleagleConfig) -> Runtime:
    """The runtime an Engine with tp_size > 1 runs on: this process's (a follower, an adopted group),
    or, in a process with none, a new one with this process as rank 0."""
    n = cfg.engine.tp_size
    if _RT is not None and _RT.owned and _RT.rank == 0:
        # Its followers run the first engine's schedule; a second would need ranks of its own.
        raise RankError("this process already runs a tensor-parallel engine as rank 0: close() it first")
    rt = _RT if _RT is not None else adopt() if dist.is_available() and dist.is_initialized() else None
    if rt is None:
        rt = start_rank0(cfg)
    if rt.size != n:
        raise RankError(f"this process is one of {rt.size} tensor-parallel ranks; the engine asks for {n}")
    return rt


def topology_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tp", type=int, required=True, help="tensor-parallel size (all nodes together)")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    ap.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT") or 0))


def launcher_main(argv: list[str] | None = None) -> int:
    """`mleagle engine-ranks`: run one node's ranks of an engine whose rank 0 is on another node."""
    ap = argparse.ArgumentParser(
        prog="mleagle engine-ranks",
        description="Start this node's tensor-parallel ranks of an mleagle engine (rank 0 runs on node 0 in "
                    "`mleagle serve`/`generate`/`bench` with the same --tp/--nnodes/--master-addr/--master-port). "
                    "Restarts them when they fail (the engine restarts); exits 0 when the engine stops cleanly.")
    topology_args(ap)
    ap.add_argument("--no-restart", action="store_true", help="exit non-zero when the ranks fail")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-ranks %(levelname)s %(message)s")
    topo = Topology(a.tp, a.nnodes, a.node_rank, a.master_addr, a.master_port)
    try:
        topo.check()
    except ValueError as e:
        print(f"mleagle engine-ranks: {e}", file=sys.stderr)
        return 2
    if topo.node_rank == 0:
        print("mleagle engine-ranks: node 0 holds rank 0, which the engine itself starts (serve, generate, "
              "bench with --tp); run engine-ranks on the other nodes", file=sys.stderr)
        return 2
    if not topo.port:
        print("mleagle engine-ranks: --master-port (or $MASTER_PORT) is required", file=sys.stderr)
        return 2
    procs: list[subprocess.Popen[bytes]] = []
    stopping = threading.Event()

    def on_signal(sig: int, _frame: Any) -> None:
        stopping.set()
        for p in procs:
            if p.poll() is None:
                p.terminate()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    delay = 1.0
    while not stopping.is_set():
        procs[:] = [_spawn_rank(topo, lr, os.getpid()) for lr in range(topo.local_size)]
        log.info("started ranks %s (pids %s), rendezvous %s:%d",
                 [topo.global_rank(lr) for lr in range(topo.local_size)], [p.pid for p in procs], topo.addr, topo.port)
        codes = _wait_ranks(procs, topo)
        if stopping.is_set():
            return 0
        if all(c == 0 for c in codes):
            log.info("the engine stopped cleanly")
            return 0
        log.error("ranks ended with codes %s", codes)
        if a.no_restart:
            return 1
        # Rank 0 is going down (told through the store) and will be restarted: wait until its store is
        # no longer the one our dead ranks joined, so the new ranks meet the new rank 0.
        _await_new_store(topo, topo.global_rank(0), procs[0].pid, timeout=30.0)
        time.sleep(delay)
        delay = min(delay * 2, 30.0)
    return 0


def _await_new_store(topo: Topology, rank: int, pid: int, timeout: float) -> None:
    """Until the rendezvous store is gone or holds another registration for `rank` than `pid`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            st = dist.TCPStore(topo.addr, topo.port, None, False, datetime.timedelta(seconds=2))
            key = f"pid/{rank}"
            if not st.check([key]) or st.get(key).decode() != str(pid):
                return
        except Exception:
            return
        time.sleep(0.2)


def _wait_ranks(procs: list[subprocess.Popen[bytes]], topo: Topology) -> list[int]:
    """Wait for every rank; the first failure is reported to the engine and ends the others (they
    would hang on it)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(lr, p, c) for lr, (p, c) in enumerate(zip(procs, codes)) if c not in (None, 0)]
        for lr, p, c in failed:
            r = topo.global_rank(lr)
            report_failure(topo, f"rank {r} (pid {p.pid}, node {topo.node_rank}) exited with code {c}", rank=r, pid=p.pid)
        if failed:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return [int(p.wait()) for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes]  # type: ignore[arg-type]
        time.sleep(0.2)
