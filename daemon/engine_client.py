"""The daemon's side of the engine: spawn and supervise the engine process, route its outputs.

`EngineClient` creates a private (0700) run dir `mleagle-run-<daemon pid>-*` under the temp folder,
first removing the run dirs of daemons that are gone (a daemon killed with SIGKILL runs no cleanup;
its engine removes the dir as it exits, and this sweep catches what is left when both died). Per
engine generation it listens there on the engine channel's Unix socket (`engine/contract/channel.py`:
requests out, outputs in, the one connection admitted by the spawned process's pid) and binds the
state events' zmq SUB socket, spawns
`python -m mleagle.engine.service.process`, hands it the configuration on stdin (never a file, and
without the API key; the key's environment variable is not inherited either) and waits for its
`Ready`. Each request registers a sink (an asyncio queue shared by the n choices of one HTTP request)
and gets its deltas there as `(tag, output)` (a `RequestOutput`, or a `TokenOutput` for one that is new
tokens only); an engine-side refusal arrives as `(tag, EngineRequestFailed)`. If the process dies (or closes
its channel), every request in flight gets an `EngineDead` error at once, the state turns `dead` (so `/health` says
503), and the engine is restarted with backoff, or `on_fatal` is called so the server exits non-zero
(`server.restart_engine = false`).
A watchdog pings the engine every `ping_interval_s` (the pongs also keep pool usage and counters
fresh); when nothing at all has come back for `ping_timeout_s` the engine is frozen (stopped,
deadlocked, stuck in a kernel): it is killed and handled exactly like a dead one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from mleagle.daemon.zmq_reader import ZmqReader
from mleagle.engine.contract.channel import DaemonChannel
from mleagle.engine.contract.config import MleagleConfig
from mleagle.engine.contract.outputs import RequestOutput, TokenOutput
from mleagle.engine.contract.protocol import (
    PROTOCOL_VERSION,
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
    decode_engine_msg,
    encode,
    pid_alive,
)
from mleagle.engine.contract.sampling_params import SamplingParams

log = logging.getLogger("mleagle.daemon.engine")
RUN_PREFIX = "mleagle-run-"
SECRET_ENV = ("MLEAGLE_API_KEY",)  # never inherited by the engine process
KILL_WAIT_S = 5.0  # after SIGKILL, how long to wait for the exit before giving the process up


def sweep_stale_run_dirs(root: str | None = None) -> list[str]:
    """Remove this user's run dirs whose daemon is gone (its pid is in the name); returns them."""
    gone = []
    base = Path(root or tempfile.gettempdir())
    for p in base.glob(RUN_PREFIX + "*"):
        try:
            pid = int(p.name[len(RUN_PREFIX):].split("-", 1)[0])
            if not p.is_dir() or p.is_symlink() or p.stat().st_uid != os.getuid() or pid_alive(pid):
                continue
        except (ValueError, OSError):
            continue
        shutil.rmtree(p, ignore_errors=True)
        gone.append(str(p))
    return gone


class EngineUnavailable(Exception):
    """The engine is starting, restarting, dead or stopping: try again later (HTTP 503)."""


class EngineDead(Exception):
    """The engine process died with this request in flight."""


class EngineRequestFailed(Exception):
    def __init__(self, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind  # "input" (HTTP 400) or "internal" (500)
        self.param = param  # the engine's SamplingParams field at fault, when it names one


def load_tokenizer(path: str) -> Any:
    """The engine's tokenizer, used once before it serves: its chat template and special-token pattern
    compile on first use, which would otherwise land in the first request's latency."""
    from mleagle.engine.contract.tokenizer import Tokenizer

    tok = Tokenizer.load(path)
    tok.decode(tok.encode_chat([{"role": "user", "content": "warm up"}]))
    return tok


@dataclass
class _Req:
    sink: asyncio.Queue[tuple[int, Any]]
    tag: int
    aborted: bool = False


@dataclass
class _Gen:
    """One engine process and the sockets that talk to it."""

    n: int
    proc: asyncio.subprocess.Process
    chan: DaemonChannel
    events: zmq.Socket  # SUB, bound before the engine starts, so no early event is lost
    readers: list[ZmqReader] = field(default_factory=list)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    ended: bool = False


class EngineClient:
    def __init__(
        self,
        cfg: MleagleConfig,
        *,
        restart: bool = True,
        on_fatal: Callable[[int], None] | None = None,
        on_state: Callable[[str], None] | None = None,
        on_pong: Callable[[Pong], None] | None = None,
        ready_timeout_s: float = 600.0,
        ping_interval_s: float | None = None,
        ping_timeout_s: float | None = None,
    ) -> None:
        self.cfg = cfg
        self.restart = restart
        self.on_fatal = on_fatal
        self.on_state = on_state
        self.on_pong = on_pong
        self.ready_timeout_s = ready_timeout_s
        self.ping_interval_s = ping_interval_s if ping_interval_s is not None else cfg.server.engine_ping_interval_s
        self.ping_timeout_s = ping_timeout_s if ping_timeout_s is not None else cfg.server.engine_ping_timeout_s
        self.last_seen = 0.0  # when the engine last sent anything (the watchdog's clock)
        self.state = "stopped"  # starting | ready | dead | stopping | stopped
        self.error: str | None = None  # why the last engine failed
        self.info: Ready | None = None
        self.tokenizer: Any = None
        self.restarts = 0
        self.last_pong: Pong | None = None
        self.last_pong_t = 0.0
        self.reqs: dict[str, _Req] = {}
        self.coalesced = 0  # token-only deltas merged into an earlier step's of the same batch (`_on_msgs`)
        self._later: list[Any] | None = None  # a batch's rest, put behind its first deltas (`_on_msgs`)
        self.events_full = False  # someone watches the state events: every step's, not a sample
        for d in sweep_stale_run_dirs():
            log.info("removed the run dir of a daemon that is gone: %s", d)
        self.run_dir = tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}-")  # mkdtemp makes it 0700
        os.chmod(self.run_dir, 0o700)
        self.ctx = zmq.Context()
        # Where the engine's state events go, the messages of one wake-up (each [kinds, lines], see
        # `split_events`) with the engine generation's number (the relay sets it); with none set they
        # are read and dropped.
        self.on_events: Callable[[int, list[list[bytes]]], None] | None = None
        self.gen: _Gen | None = None
        self._n = 0
        self._seq = 0
        self._pongs: dict[int, asyncio.Future[Pong]] = {}
        self._ready: asyncio.Future[Ready] | None = None
        self._stopping = False
        self._restart_task: asyncio.Task[None] | None = None
        self._pinger: asyncio.Task[None] | None = None

    # ---- lifecycle ------------------------------------------------------------------------------

    def _set_state(self, s: str) -> None:
        self.state = s
        if self.on_state is not None:
            self.on_state(s)

    @property
    def engine_pid(self) -> int | None:
        return self.gen.proc.pid if self.gen is not None else None

    async def start(self) -> None:
        """Spawn the engine and wait for its handshake; raises RuntimeError if it cannot start."""
        self._stopping = False
        self._set_state("starting")
        try:
            await self._spawn()
        except Exception as e:
            self.error = str(e)
            self._set_state("dead")
            self._kill_gen()
            raise
        if self._pinger is None:
            self._pinger = asyncio.create_task(self._ping_loop())

    async def _spawn(self) -> None:
        self._n += 1
        n = self._n
        d = self.run_dir
        ev_addr = f"ipc://{d}/g{n}-ev"
        holder: list[_Gen] = []  # the generation, once spawned: the channel's callbacks need it
        chan = DaemonChannel(f"{d}/g{n}.sock", lambda batch: self._on_msgs(holder[0], batch),
                             lambda why: self._channel_lost(holder[0], why) if holder else None)
        await chan.listen()
        # The daemon binds the SUB side and the engine's PUB connects to it before it even loads the
        # model: the subscription is in place before the first event (no slow-joiner loss).
        events = self.ctx.socket(zmq.SUB)
        events.setsockopt(zmq.RCVHWM, 10000)
        events.setsockopt(zmq.LINGER, 0)
        events.setsockopt(zmq.SUBSCRIBE, b"")
        events.bind(ev_addr)
        cmd = [sys.executable, "-m", "mleagle.engine.service.process", "--config-file", "-", "--run-dir", d,
               "--channel", chan.path, "--parent-pid", str(os.getpid())]
        if self.cfg.server.state_events:
            cmd += ["--events", ev_addr]
        env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
        # A new session: Ctrl-C in the terminal reaches the daemon only, which then stops the engine.
        try:
            proc = await asyncio.create_subprocess_exec(*cmd, start_new_session=True, stdin=asyncio.subprocess.PIPE,
                                                        env=env)
        except BaseException:
            chan.close()
            events.close(linger=0)
            raise
        gen = self.gen = _Gen(n, proc, chan, events)
        holder.append(gen)
        # The engine connects after reading its configuration, so its pid is known by then.
        chan.expected_pid = proc.pid
        assert proc.stdin is not None
        try:  # the configuration travels on a pipe, without secrets: nothing of it lands on disk
            proc.stdin.write(self.cfg.for_engine().encode())
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the process died at once; _watch reports it
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        gen.readers = [ZmqReader(events, lambda batch: self._on_events(gen, batch), multipart=True)]
        for r in gen.readers:
            r.start()
        watch = asyncio.create_task(self._watch(gen))
        gen.tasks.append(watch)
        t0 = time.perf_counter()
        try:
            ready = await asyncio.wait_for(asyncio.shield(self._ready), self.ready_timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            raise RuntimeError(f"engine not ready after {self.ready_timeout_s:.0f}s") from None
        if ready.protocol_version != PROTOCOL_VERSION:
            proc.kill()
            raise RuntimeError(f"engine speaks protocol {ready.protocol_version}, daemon {PROTOCOL_VERSION}")
        tok = None
        if ready.tokenizer_dir:
            tok = await asyncio.to_thread(load_tokenizer, ready.tokenizer_dir)
        self.info, self.tokenizer, self.error = ready, tok, None
        self.last_seen = time.monotonic()
        log.info("engine %d ready in %.1fs (pid %d): %s", n, time.perf_counter() - t0, proc.pid, ready.model_name)
        self._set_state("ready")
        if self.events_full:  # a new engine starts sampling its step events: tell it who watches
            with contextlib.suppress(EngineUnavailable):
                self._send(EventDetail(full=True))

    def _on_events(self, gen: _Gen, batch: list[list[bytes]]) -> None:
        if self.on_events is not None and not gen.ended:
            self.on_events(gen.n, batch)

    def _on_msgs(self, gen: _Gen, batch: list[bytes]) -> None:
        """Everything the engine sent since the last wake-up (its reader's callback).
        - A request's first delta goes to its route before anything else of the batch, and the rest
          is handled in a callback of its own after it: the woken routes write their headers and first
          frames before this callback writes every running stream's frame (at 32 streams that
          is most of a millisecond of the loop, which a first token no longer waits behind).
        - Where the batch is several steps (the daemon fell behind), a request's token-only deltas of
          consecutive steps go to its stream as one (`_handle`): one frame and one socket write instead
          of one per step, so a loop that falls behind catches up instead of writing every step it
          missed."""
        now = time.monotonic()
        if gen is self.gen:
            self.last_seen = now  # any message at all is a sign of life
        self._run_later()  # the rest of an earlier batch, if still waiting, goes before this one
        msgs = [m for m in map(self._decode, batch) if m is not None]
        firsts = 0
        for m in msgs:
            if not isinstance(m, Outputs) or all(o.timing is None for o in m.outputs):
                continue
            keep = []
            for o in m.outputs:
                if o.timing is None:
                    keep.append(o)
                    continue
                o.timing += [m.sent, now]  # a first delta: when its step was sent, and received here
                firsts += 1
                try:
                    self._deliver(o)
                except Exception:
                    log.exception("failed to deliver an engine output")
            m.outputs = keep
        if firsts and any(not isinstance(m, Outputs) or m.tokens or m.outputs for m in msgs):
            self._later = msgs
            asyncio.get_running_loop().call_soon(self._run_later)
        elif not firsts:
            self._handle_all(msgs)

    def _run_later(self) -> None:
        """The rest of a batch that `_on_msgs` put behind its first deltas, once (whichever comes first:
        its own callback or the next batch, which must not overtake it)."""
        msgs, self._later = self._later, None
        if msgs is not None:
            self._handle_all(msgs)

    def _handle_all(self, msgs: list[Any]) -> None:
        # One message (a daemon keeping up) has nothing to merge: its deltas go out as they come.
        held: dict[str, TokenOutput] | None = {} if len(msgs) > 1 else None
        for msg in msgs:
            try:
                self._handle(msg, held)
            except Exception:  # one bad message (or callback) must not drop the rest of the batch
                log.exception("failed to handle an engine message")
        if held:
            self._release(held)

    def _release(self, held: dict[str, TokenOutput]) -> None:
        """Deliver the token-only deltas `_handle` held back, and forget them."""
        for t in held.values():
            try:
                self._deliver(t)
            except Exception:  # one stream's failure must not keep the others' tokens
                log.exception("failed to deliver an engine output")
        held.clear()

    @staticmethod
    def _decode(data: bytes) -> Any:
        try:
            return decode_engine_msg(data)
        except ValueError as e:
            log.error("dropped a malformed engine message: %s", e)
            return None

    def _handle(self, msg: Any, held: dict[str, TokenOutput] | None) -> None:
        """One engine message. With `held` (the batch's), a token-only delta is held back there,
        merged with the request's earlier ones in the batch, and delivered before anything else of
        that request (a whole `RequestOutput`: logprobs, the end) or before any other kind of message;
        the caller delivers what is left (`_release`). Without it, delivered at once."""
        if isinstance(msg, Outputs):
            for rid, ids, n_prompt, n_out, n_cached in msg.tokens:
                t = held.get(rid) if held is not None else None
                if t is not None:  # the same request in an earlier step of this batch: one delta
                    t.token_ids.extend(ids)
                    t.num_output_tokens, t.num_cached_tokens = n_out, n_cached
                    self.coalesced += 1
                elif held is not None:
                    held[rid] = TokenOutput(rid, ids, n_prompt, n_out, n_cached)
                else:
                    self._deliver(TokenOutput(rid, ids, n_prompt, n_out, n_cached))
            for o in msg.outputs:  # first deltas went ahead in `_on_msgs`
                t = held.pop(o.rid, None) if held is not None else None
                if t is not None:
                    self._deliver(t)
                self._deliver(o)
            return
        if held:  # anything else keeps its place after the outputs before it
            self._release(held)
        if isinstance(msg, RequestError):
            r = self.reqs.pop(msg.rid, None)
            if r is not None and not r.aborted:
                r.sink.put_nowait((r.tag, EngineRequestFailed(msg.message, msg.kind, msg.param)))
        elif isinstance(msg, Pong):
            self.last_pong, self.last_pong_t = msg, time.monotonic()
            fut = self._pongs.pop(msg.seq, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            if self.on_pong is not None:
                self.on_pong(msg)
        elif isinstance(msg, Ready):
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg)
        elif isinstance(msg, Fatal):
            log.error("engine: %s", msg.message)
            self.error = msg.message
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(RuntimeError(msg.message))

    def _deliver(self, o: RequestOutput | TokenOutput) -> None:
        r = self.reqs.get(o.rid)
        if r is None:
            return
        if o.finished:
            del self.reqs[o.rid]
        if not r.aborted:
            r.sink.put_nowait((r.tag, o))

    async def _watch(self, gen: _Gen) -> None:
        rc = await gen.proc.wait()
        self._ended(gen, f"engine process exited with code {rc}")

    def _ended(self, gen: _Gen, default_why: str) -> None:
        """Engine `gen` is gone (exited, or killed as frozen): fail its requests, then restart or give up."""
        if self._stopping or gen is not self.gen or gen.ended:
            return
        gen.ended = True
        why = self.error or default_why
        log.error("engine %d died: %s", gen.n, why)
        self.error = why
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(why))
        self._fail_all(why)
        if self.state in ("starting",):
            return  # start() reports it
        self._set_state("dead")
        self._close_gen(gen, cancel_watch=False)
        if self.restart:
            self._restart_task = asyncio.create_task(self._restart_loop())
        elif self.on_fatal is not None:
            self.on_fatal(1)

    async def _frozen(self, gen: _Gen, silent: float) -> None:
        """The engine has not answered for `silent` seconds: refuse new work at once, kill it (SIGKILL
        ends a stopped process too), and handle it as dead once it is gone."""
        self.error = f"the engine stopped responding: nothing received for {silent:.1f}s (ping timeout)"
        log.error("engine %d (pid %d): %s; killing it", gen.n, gen.proc.pid, self.error)
        self._set_state("dead")
        await self._kill(gen)
        self._ended(gen, self.error)

    async def _kill(self, gen: _Gen) -> None:
        """SIGKILL the engine process (it ends a stopped one too) and wait up to `KILL_WAIT_S` for it."""
        if gen.proc.returncode is None:
            gen.proc.kill()
        try:
            await asyncio.wait_for(asyncio.shield(gen.proc.wait()), KILL_WAIT_S)
        except asyncio.TimeoutError:
            log.error("engine pid %d did not exit %.0fs after SIGKILL; giving it up", gen.proc.pid, KILL_WAIT_S)

    def _channel_lost(self, gen: _Gen, why: str) -> None:
        """The engine's end of the channel closed: it is exiting (or was killed). Refuse new work now, and
        fail its requests once the process is gone, as `_watch` does (its GPU memory is freed before a
        restart), killing it if it has not exited within `KILL_WAIT_S`."""
        if self._stopping or gen is not self.gen or gen.ended:
            return
        log.error("engine %d (pid %d): %s", gen.n, gen.proc.pid, why)
        if self.state == "ready":
            self._set_state("dead")
        gen.tasks.append(asyncio.ensure_future(self._reap(gen, why)))

    async def _reap(self, gen: _Gen, why: str) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(gen.proc.wait()), KILL_WAIT_S)
        except asyncio.TimeoutError:
            log.error("engine pid %d still runs %.0fs after closing its channel; killing it", gen.proc.pid, KILL_WAIT_S)
            await self._kill(gen)
        self._ended(gen, why if gen.proc.returncode is None else f"engine process exited with code {gen.proc.returncode}")

    def _fail_all(self, why: str) -> None:
        self._later = None  # the rest of a dead engine's last batch: its requests are failed here
        reqs, self.reqs = self.reqs, {}
        for r in reqs.values():
            if not r.aborted:
                r.sink.put_nowait((r.tag, EngineDead(f"the engine failed: {why}")))
        for fut in self._pongs.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable(why))
        self._pongs.clear()

    async def _restart_loop(self) -> None:
        delay = 0.5
        while not self._stopping:
            self.restarts += 1
            self._set_state("starting")
            try:
                await self._spawn()
                return
            except Exception as e:
                log.error("engine restart failed: %s", e)
                self.error = str(e)
                self._set_state("dead")
                self._kill_gen()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    def _kill_gen(self) -> None:
        if self.gen is not None:
            if self.gen.proc.returncode is None:
                self.gen.proc.kill()
            self._close_gen(self.gen)

    def _close_gen(self, gen: _Gen, cancel_watch: bool = True) -> None:
        for t in gen.tasks:
            if cancel_watch or t is not asyncio.current_task():
                t.cancel()
        for r in gen.readers:
            r.close()  # before the sockets: a closed fd must not stay registered with the loop
        gen.chan.close()
        gen.events.close(linger=0)

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine to exit, kill it after `timeout`, clean up sockets and the run dir."""
        self._stopping = True
        self._set_state("stopping")
        for t in (self._pinger, self._restart_task):
            if t is not None:
                t.cancel()
        gen = self.gen
        if gen is not None:
            if gen.proc.returncode is None:
                with contextlib.suppress(ConnectionError):
                    gen.chan.send(encode(Shutdown()))
                t0 = time.perf_counter()
                try:
                    await asyncio.wait_for(gen.proc.wait(), timeout)
                    log.info("engine stopped in %.2fs (exit code %s)", time.perf_counter() - t0, gen.proc.returncode)
                except asyncio.TimeoutError:
                    log.warning("engine did not stop in %.0fs: killing it", timeout)
                    gen.proc.kill()
                    await gen.proc.wait()
            self._close_gen(gen)
        self._fail_all("the server is shutting down")
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self._set_state("stopped")

    # ---- requests -------------------------------------------------------------------------------

    def _send(self, msg: Any) -> None:
        if self.gen is None or self.state != "ready":
            raise EngineUnavailable(self.error or f"engine is {self.state}")
        try:
            self.gen.chan.send(encode(msg))
        except ConnectionError as e:
            raise EngineUnavailable(f"engine channel: {e}") from None

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams, sink: asyncio.Queue[tuple[int, Any]], tag: int) -> None:
        if rid in self.reqs:
            raise ValueError(f"duplicate request id {rid!r}")
        self._send(AddRequest(rid=rid, prompt_ids=prompt_ids, params=params))
        self.reqs[rid] = _Req(sink, tag)

    def abort(self, rid: str) -> None:
        """Stop a request (client gone); its final output is swallowed, its slots freed by the engine."""
        r = self.reqs.get(rid)
        if r is None or r.aborted:
            return
        r.aborted = True
        try:
            self._send(AbortRequest(rid=rid))
        except EngineUnavailable:
            self.reqs.pop(rid, None)

    def set_event_detail(self, full: bool) -> None:
        """Every step's state events (someone subscribes) or a sample of them; kept across restarts."""
        if full == self.events_full:
            return
        self.events_full = full
        with contextlib.suppress(EngineUnavailable):
            self._send(EventDetail(full=full))

    @property
    def num_inflight(self) -> int:
        return len(self.reqs)

    async def ping(self, timeout: float = 5.0) -> Pong:
        self._seq += 1
        seq = self._seq
        fut: asyncio.Future[Pong] = asyncio.get_running_loop().create_future()
        self._pongs[seq] = fut
        try:
            self._send(Ping(seq=seq))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._pongs.pop(seq, None)

    async def _ping_loop(self) -> None:
        """The watchdog: a ping per interval, never waited for (a frozen engine must not stall this
        loop); the engine is frozen once it has sent nothing at all for `ping_timeout_s`."""
        while True:
            await asyncio.sleep(self.ping_interval_s)
            gen = self.gen
            if self.state != "ready" or gen is None or gen.ended:
                continue
            self._seq += 1
            with contextlib.suppress(EngineUnavailable):
                self._send(Ping(seq=self._seq))
            silent = time.monotonic() - self.last_seen
            if self.ping_timeout_s and silent > self.ping_timeout_s:
                await self._frozen(gen, silent)
