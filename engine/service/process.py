"""The engine process: `python -m mleagle.engine.service.process`, started and supervised by the daemon.

It reads its configuration as JSON from a file or, as the daemon starts it, from stdin (`--config-file -`:
nothing lands on disk, and the daemon leaves the API key out), builds `Engine(cfg)`, saves the
tokenizer under the run dir (so the daemon loads it without torch), connects to the daemon's channel
(`engine/contract/channel.py`: one Unix socket inside the daemon's 0700 run dir, requests in and
outputs out) and publishes state events on a zmq PUB socket. When the daemon dies (SIGKILL runs none of its
cleanup), the channel reaches its end and the engine gets SIGTERM from the kernel: it exits, and removes
the daemon's run dir on its way. The loop drains every
pending message (a blocking poll when idle, non-blocking when there is work), runs one `engine.step()`,
sends that step's deltas as one `Outputs` message (stamped with when it was sent: the daemon splits
each request's TTFT by it), then publishes the state events. Once ready, it freezes what start-up built out
of the garbage collector's reach and times every collection (`gc_watch`, in the engine's stats). A bad request is answered with a
`RequestError` and never stops the loop; a step that raises fails the requests in flight, and three
failures in a row end the process (the daemon restarts it). With tensor parallelism (`tp_size > 1`)
this process is rank 0: its Engine starts and supervises the other ranks (`engine/service/ranks.py`),
which follow its schedule and never talk to the daemon; a failed step then ends the process at once
with a `Fatal` and no per-request errors (the ranks may have stopped in different places: the engine
is dead, and the daemon fails its requests as `engine_dead`), and so does a dead rank, so the daemon
restarts them all.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from mleagle.engine.contract.channel import EngineChannel
from mleagle.engine.contract.config import MleagleConfig
from mleagle.engine.contract.gc_watch import GcWatch, freeze
from mleagle.engine.contract.outputs import RequestOutput, StepOutput
from mleagle.engine.contract.protocol import (
    AbortRequest,
    AddRequest,
    EventDetail,
    Fatal,
    Outputs,
    Ping,
    Pong,
    Ready,
    RequestError,
    Shutdown,
    decode_daemon_msg,
    encode,
    peak_rss_mb,
)
from mleagle.engine.service.parent import die_with_parent

log = logging.getLogger("mleagle.engine.service.process")
IDLE_POLL_MS = 250  # idle wake-up: notices a vanished parent even without PDEATHSIG
MAX_DRAIN = 512  # messages handled between two steps, so a flood cannot starve decoding
MAX_STEP_FAILURES = 3
REPARENT_WAIT_S = 5.0  # after SIGTERM: how long a dying daemon may take to release its children


def _tensor_parallel(engine: Any) -> bool:
    """The engine has other ranks, which fail (and are restarted) with this process."""
    tp = getattr(engine, "tp", None)
    return tp is not None and tp.size > 1


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def build_engine(cfg: MleagleConfig) -> Any:
    """The engine this process serves (rank 0 of its tensor-parallel ranks when tp_size > 1)."""
    from mleagle.engine.service.tp_driver import start_engine

    return start_engine(cfg)


class EngineLoop:
    """Owns the sockets and the request bookkeeping around one `Engine`."""

    def __init__(self, engine: Any, chan: EngineChannel, pump: EventPump | None = None,
                 gc_watch: GcWatch | None = None, spin_s: float = 0.0) -> None:
        self.engine = engine
        # After its last work the loop polls without sleeping this long (yielding the core to any
        # thread that wants it) before it blocks: the next request of a client that is reading its
        # last answer is taken at once, by a process whose caches are still its own (`server.spin_ms`).
        self.spin_s = spin_s
        self.spins = 0  # idle passes that polled instead of blocking (reported with the loop's stats)
        self.gc_watch = gc_watch  # collections and their pauses, reported with the engine's stats
        # Host seconds by phase of the loop (reported with the engine's stats): the engine's steps,
        # sending their outputs, the event pump, messages (answering the daemon's pings, which carry these
        # stats, counted apart too); the telemetry inside the steps is the telemetry's own count.
        self.spent = {"step": 0.0, "send_outputs": 0.0, "pump": 0.0, "messages": 0.0, "pong": 0.0}
        self.steps = 0
        self.pump = pump
        self.telemetry = pump.telemetry if pump is not None else None
        self.chan = chan
        self.live: set[str] = set()  # rids the engine holds that have not finished
        self.failures = 0
        self.ppid = os.getppid()
        from mleagle.engine.errors import EngineInputError

        self.input_error: type[Exception] = EngineInputError

    def send(self, msg: Any) -> None:
        self.chan.send(encode(msg))

    def handle(self, data: bytes) -> bool:
        """Apply one message; False means shut down."""
        try:
            msg = decode_daemon_msg(data)
        except ValueError as e:
            log.error("dropped a malformed message: %s", e)
            return True
        if isinstance(msg, AddRequest):
            try:
                self.engine.add_request(msg.rid, msg.prompt_ids, msg.params)
                self.live.add(msg.rid)
            except self.input_error as e:
                self.send(RequestError(rid=msg.rid, message=str(e), kind="input", param=getattr(e, "param", None)))
            except Exception as e:
                log.error("add_request %s failed:\n%s", msg.rid, traceback.format_exc())
                self.send(RequestError(rid=msg.rid, message=f"internal error: {e}", kind="internal"))
        elif isinstance(msg, AbortRequest):
            if msg.rid in self.live:
                try:
                    self.engine.abort(msg.rid)
                except Exception:
                    log.error("abort %s failed:\n%s", msg.rid, traceback.format_exc())
        elif isinstance(msg, Ping):
            t0 = time.perf_counter()
            self.send(self.pong(msg.seq))
            self.spent["pong"] += time.perf_counter() - t0
        elif isinstance(msg, EventDetail):
            if self.telemetry is not None:
                self.telemetry.full = msg.full
        elif isinstance(msg, Shutdown):
            return False
        return True

    def pong(self, seq: int) -> Pong:
        usage: Any = []
        stats: Any = {}
        try:
            usage = _jsonable(self.engine.pool_usage())
        except Exception:
            log.error("pool_usage failed:\n%s", traceback.format_exc())
        if hasattr(self.engine, "stats"):
            try:
                stats = _jsonable(self.engine.stats())
            except Exception:
                log.error("stats failed:\n%s", traceback.format_exc())
        if isinstance(stats, dict):
            if self.gc_watch is not None:
                stats["gc"] = self.gc_watch.snapshot()
            spent = {**self.spent, "telemetry": self.telemetry.spent_s if self.telemetry is not None else 0.0}
            # `device_wait_s` is inside `step_s`: the part of the steps spent blocked on the device
            spent["device_wait"] = stats.get("device_wait_s") or 0.0
            stats["loop"] = {"steps": self.steps, "spins": self.spins, **{f"{k}_s": round(v, 4) for k, v in spent.items()},
                             "events_full": self.telemetry.full if self.telemetry is not None else None,
                             "steps_sampled_out": self.telemetry.sampled_out if self.telemetry is not None else 0}
        rss = peak_rss_mb()
        return Pong(seq=seq, num_requests=len(self.live), pool_usage=usage, stats=stats, max_rss_mb=rss)

    def step(self) -> int | None:
        """One scheduler step; returns an exit code when the engine is beyond saving."""
        t0 = time.perf_counter()
        try:
            outs: list[StepOutput] = self.engine.step()
            self.failures = 0
        except Exception as e:
            self.failures += 1
            log.error("engine step failed (%d in a row):\n%s", self.failures, traceback.format_exc())
            err = f"internal engine error: {type(e).__name__}: {e}"
            if _tensor_parallel(self.engine):
                # Tensor parallel: the ranks may have failed at different collectives (a rank died, most
                # often); none can go on, so this engine is dead, not one request. Say so and exit: the
                # daemon fails every request in flight as `engine_dead` and restarts the ranks.
                self.send(Fatal(message=f"a tensor-parallel engine step failed: {type(e).__name__}: {e}"))
                return 1
            # We cannot tell which request broke the step: fail every request in flight, free them.
            failed = sorted(self.live)
            self.live.clear()
            for rid in failed:
                try:
                    self.engine.abort(rid)
                except Exception:
                    pass
            self.send(
                Outputs(outputs=[RequestOutput(rid=r, finished=True, finish_reason="error", error=err) for r in failed])
            )
            if self.failures >= MAX_STEP_FAILURES:
                self.send(Fatal(message=f"{self.failures} engine steps failed in a row; last: {err}"))
                return 1
            return None
        t1 = time.perf_counter()
        # Deltas of requests already failed above (their abort outputs) are not the daemon's business.
        outs = [o for o in outs if o.rid in self.live]
        for o in outs:
            if o.finished:
                self.live.discard(o.rid)
        if outs:
            msg = Outputs.of(outs)
            msg.sent = time.monotonic()
            self.send(msg)
        self.steps += 1
        self.spent["step"] += t1 - t0
        self.spent["send_outputs"] += time.perf_counter() - t1
        return None

    def run(self) -> int:
        """Serve until `Shutdown` or the daemon's end of the channel closes (0), or the engine fails."""
        try:
            return self._run()
        except (BrokenPipeError, ConnectionResetError):
            log.warning("the daemon closed the channel; engine exiting")
            _ORPHANED[0] = True
            return 0

    def _run(self) -> int:
        last_work = time.monotonic()
        while True:
            busy = self.engine.has_work()
            spinning = not busy and self.spin_s > 0 and time.monotonic() - last_work < self.spin_s
            timeout = 0 if busy or spinning else IDLE_POLL_MS
            n = 0
            while n < MAX_DRAIN and self.chan.poll(timeout):
                t0 = time.perf_counter()
                data = self.chan.recv()
                if data is None:
                    log.warning("the daemon closed the channel; engine exiting")
                    _ORPHANED[0] = True
                    return 0
                if not self.handle(data):
                    return 0
                self.spent["messages"] += time.perf_counter() - t0
                n += 1
                timeout = 0
            if spinning and not n:
                self.spins += 1
                os.sched_yield()
                continue
            stepped = self.engine.has_work()
            # Status events (rates, uptime, the last step's if it was sampled out) stay current while
            # idle, but not in front of an arrival: it was the first thing a request met at an idle
            # engine (the last step's events, a few hundred microseconds of its TTFT's `queue` phase).
            if not stepped and self.telemetry is not None:
                self.telemetry.idle()
            if not busy and os.getppid() != self.ppid:
                log.warning("daemon gone; engine exiting")
                _ORPHANED[0] = True
                return 0
            if stepped:
                code = self.step()
                if code is not None:
                    return code
                last_work = time.monotonic()
            # The state events go out after the step and its outputs, never before a step: an arrival
            # at an idle engine would otherwise wait for the events of the request before it (0.1-0.7 ms
            # on the 2-core dev VM, measured in its TTFT's `queue` phase).
            if self.pump is not None:
                t0 = time.perf_counter()
                self.pump.pump()
                if stepped:
                    self.spent["pump"] += time.perf_counter() - t0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m mleagle.engine.service.process", description=__doc__)
    ap.add_argument("--config-file", required=True, help="MleagleConfig as JSON; '-' reads it from stdin")
    ap.add_argument("--run-dir", required=True, help="private dir for the tokenizer copy")
    ap.add_argument("--channel", required=True, help="the daemon's Unix socket path (requests in, outputs out)")
    ap.add_argument("--events", default=None, help="zmq address to PUBlish state events on")
    ap.add_argument("--parent-pid", type=int, default=None, help="exit if this process is not our parent")
    return ap.parse_args(argv)


class EventPump:
    """Moves the engine's state events from its `EventBus` to a ZMQ PUB socket, between steps."""

    def __init__(self, pub: Any) -> None:
        self.pub = pub
        self.bus: Any = None
        self.telemetry: Any = None
        self.last_drops = 0.0

    def attach(self, engine: Any, full: bool = False, sample_every_s: float = 0.1) -> None:
        """Attach the engine's telemetry, publishing into a new bus this pump drains; every step's
        events only once the daemon says someone watches (`EventDetail`), one every `sample_every_s`
        before."""
        from mleagle.engine.contract.event_bus import EventBus
        from mleagle.engine.service.telemetry import Telemetry

        self.bus = EventBus()
        self.telemetry = Telemetry.attach(engine, self.bus, full, sample_every_s)

    def pump(self) -> None:
        if self.bus is None:
            return
        try:
            if len(self.bus):
                self.pub.publish(self.bus.drain())
            now = time.monotonic()
            if now - self.last_drops > 5.0 and (self.bus.dropped or self.pub.dropped):
                self.last_drops = now
                self.pub.publish([self.bus.drops_event("engine"), self.pub.drops_event()])
        except Exception:
            log.error("event publishing failed:\n%s", traceback.format_exc())

    def close(self) -> None:
        self.pump()
        self.pub.close()


def _event_pump(addr: str | None) -> EventPump | None:
    """Connect the PUB socket first thing: the daemon's SUB is bound and subscribed by the time the
    engine has loaded, so its first events are not lost to ZMQ's slow-joiner window."""
    if addr is None:
        return None
    try:
        from mleagle.engine.contract.event_bus import ZmqEventPublisher

        return EventPump(ZmqEventPublisher(addr, bind=False))
    except Exception:
        log.error("state events disabled:\n%s", traceback.format_exc())
        return None


_SIGTERM = [False]
# Set once the engine finds its daemon gone (the channel closed under it, or a new parent): like a
# SIGTERM, that can come before the kernel has re-parented this process, so the run dir's removal
# waits for the re-parenting then too.
_ORPHANED = [False]


def _max_request_tokens(engine: Any) -> int | None:
    """What `Engine.add_request` admits: prompt + max_new_tokens + lookahead within the pool."""
    try:
        return int(engine.allocator.capacity_tokens) - int(engine.worker.lookahead)
    except AttributeError:  # a stand-in engine
        return None


def _remove_orphaned_run_dir(run_dir: str, parent: int | None) -> None:
    """The daemon is gone and can no longer remove its run dir: do it, but only a dir of its naming
    (`mleagle-run-<its pid>-*`), never an arbitrary path. The kernel's SIGTERM for a dying parent can
    come while the dying daemon's other threads still hold its pid (getppid unchanged), so after a
    SIGTERM the re-parenting is given a moment to show."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # we are exiting anyway: let nothing cut this short
    if parent is None:
        return
    end = time.monotonic() + (REPARENT_WAIT_S if _SIGTERM[0] or _ORPHANED[0] else 0.0)
    while os.getppid() == parent and time.monotonic() < end:
        time.sleep(0.02)
    if os.getppid() == parent:
        return
    p = Path(run_dir)
    if p.name.startswith(f"mleagle-run-{parent}-") and p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    # PDEATHSIG fires at each re-parenting: when a killed daemon's threads exit one by one, we are handed
    # from thread to thread of its group and get one SIGTERM per step. Unwind once; a second SystemExit
    # raised inside main's cleanup would skip the run dir's removal.
    if _SIGTERM[0]:
        return
    _SIGTERM[0] = True
    raise SystemExit(0)  # unwinds through main's finally (PDEATHSIG sends SIGTERM when the daemon dies)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _main(args)
    finally:
        _remove_orphaned_run_dir(args.run_dir, args.parent_pid)


def _hard_exit(args: argparse.Namespace, code: int) -> None:
    """Exit without a clean stop (tensor parallel: the other ranks must fail, and be restarted, with
    us, and no group destructor may wait on them); the orphaned run dir is still removed."""
    logging.shutdown()
    _remove_orphaned_run_dir(args.run_dir, args.parent_pid)
    ranks = sys.modules.get("mleagle.engine.service.ranks")
    rt = ranks.runtime() if ranks is not None else None
    if rt is not None:
        rt.remove_store_dir()  # rank 0's private rendezvous folder (os._exit runs no atexit)
    os._exit(code)


def _main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine[0] %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when we stop (Ctrl-C hits it)
    text = sys.stdin.read() if args.config_file == "-" else Path(args.config_file).read_text()
    cfg = MleagleConfig.model_validate_json(text)
    # The daemon wrote the configuration after it knew this process's pid: it admits this connection.
    # It always reads; a send that cannot go out for a minute means it is gone.
    chan = EngineChannel(args.channel, send_timeout_s=60.0)
    t0 = time.perf_counter()
    pump = _event_pump(args.events)
    try:
        engine = build_engine(cfg)
        device: str | None = getattr(getattr(engine, "device", None), "type", None)  # "cuda", "cpu"
        if cfg.server.warm_up and hasattr(engine, "warm_up"):
            log.info("engine warmed up in %.2fs", engine.warm_up())  # before ready: no request meets a first use
        tok_dir = None
        if getattr(engine, "tokenizer", None) is not None:
            tok_dir = str(Path(args.run_dir) / "tokenizer")
            engine.tokenizer.save(tok_dir)
        if pump is not None:
            pump.attach(engine, sample_every_s=cfg.server.events_sample_ms / 1e3)
        ready = Ready(
            model_name=engine.model_name,
            max_context_len=int(engine.max_context_len),
            tokenizer_dir=tok_dir,
            spec_steps=int(getattr(engine, "spec_steps", None) or cfg.engine.spec_steps or 0),
            vocab_size=getattr(engine, "vocab_size", None),
            pid=os.getpid(),
            device=device,
            world_size=int(cfg.engine.tp_size),
            max_request_tokens=_max_request_tokens(engine),
        )
    except Exception as e:
        log.error("engine failed to start:\n%s", traceback.format_exc())
        with contextlib.suppress(OSError):
            chan.send(encode(Fatal(message=f"engine failed to start: {type(e).__name__}: {e}")))
        chan.close()
        if "mleagle.engine.service.ranks" in sys.modules and sys.modules["mleagle.engine.service.ranks"].runtime():
            _hard_exit(args, 1)  # not a clean stop: the other ranks must fail (and be restarted) with us
        return 1
    # What start-up built stays alive as long as the process: no full collection need walk it again.
    frozen = freeze()
    log.info("engine ready in %.1fs: %s, max context %d (%d objects frozen for the collector)",
             time.perf_counter() - t0, ready.model_name, ready.max_context_len, frozen)
    chan.send(encode(ready))
    try:
        # A CPU engine's forwards run on the cores the daemon needs to serve: it never spins (nor does
        # the daemon beside it, by the same rule on `Ready.device`).
        spin_s = cfg.server.spin_ms / 1e3 if device not in (None, "cpu") else 0.0
        code = EngineLoop(engine, chan, pump, GcWatch(frozen).install(), spin_s).run()
    except TimeoutError:
        log.error("the daemon stopped reading outputs; engine exiting")
        code = 1
    if pump is not None:
        pump.close()
    chan.close()
    if code == 0 and hasattr(engine, "close"):
        engine.close()  # a clean stop: the other tensor-parallel ranks stop too (and their launchers end)
    elif _tensor_parallel(engine):
        _hard_exit(args, code)  # a failure: the other ranks fail too and are restarted with us
    return code


if __name__ == "__main__":
    sys.exit(main())
