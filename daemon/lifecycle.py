"""Running the server: bind, serve, and stop cleanly.

`serve(cfg)` starts the aiohttp app (uvloop when installed) and returns the process exit code.
SIGTERM or SIGINT starts a drain: the listening socket closes (new connections are refused), new
requests on open connections get 503, requests in flight run to completion for up to
`server.shutdown_timeout_s`, then whatever is left is failed (a stream gets a `shutting_down` error
event before `[DONE]`, a plain request a 503) and aborted, the engine is asked to exit (killed if it
does not) and the run dir removed; the exit code is 0. aiohttp's keep-alive timer is the idle
timeout: a connection that has not sent a complete request head within `server.idle_timeout_s` of
opening or of its last response is closed, which ends slowloris connections as well as idle ones. A second signal skips the wait. If the engine
dies and `server.restart_engine` is false, or it cannot start at all, the exit code is 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from aiohttp import web

from mleagle.daemon import redact
from mleagle.daemon.errors import APIError
from mleagle.daemon.server import SRV, create_app
from mleagle.engine.contract.config import MleagleConfig

log = logging.getLogger("mleagle.daemon")
CLEANUP_S = 30  # closing connections (2 s) and stopping the engine (10 s, then kill) fit well inside
FAIL_GRACE_S = 2.0  # after the drain deadline: time for failed streams to send their error events


def tokenize_serially() -> None:
    """The daemon tokenizes one prompt at a time on its event loop; `tokenizers` would hand each to its
    thread pool and wait for a worker to wake (an MT-Bench chat prompt after a 5 ms idle gap: 0.25-0.32
    ms serial against 0.47-1.0 ms pooled, 2-core dev VM). The user's own setting wins. Before the
    tokenizer's first use."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


async def serve_async(cfg: MleagleConfig, access_log: bool = False) -> int:
    t0 = time.perf_counter()
    tokenize_serially()
    # Before anything can log a request: no credential a client sends reaches the log.
    redact.install([cfg.server.key()])
    stop = asyncio.Event()
    code = [0]
    hurry = [False]

    def fatal(c: int) -> None:
        code[0] = c
        hurry[0] = True
        stop.set()

    app = create_app(cfg, on_fatal=fatal)
    srv = app[SRV]
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=2.0,
                           keepalive_timeout=cfg.server.idle_timeout_s,
                           access_log=logging.getLogger("aiohttp.access") if access_log else None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.server.host, cfg.server.port, reuse_address=True)
    await site.start()
    loop = asyncio.get_running_loop()

    def on_signal(name: str) -> None:
        if stop.is_set():
            log.warning("second %s: stopping now", name)
            hurry[0] = True
            srv.idle.set()
        else:
            log.info("%s: draining (up to %.0fs)", name, cfg.server.shutdown_timeout_s)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks)  # `kill -USR1 PID`: what is the daemon waiting on?
    server = getattr(site, "_server", None)
    socks = getattr(server, "sockets", None) or []
    port = socks[0].getsockname()[1] if socks else cfg.server.port
    # The one line tools parse to find the server (port 0 picks a free port).
    print(f"mleagle: serving {srv.model} on http://{cfg.server.host}:{port} (pid-ready in "
          f"{time.perf_counter() - t0:.2f}s; engine starting)", flush=True)
    await stop.wait()
    srv.draining = True
    await site.stop()  # stop listening; open connections carry on
    if not hurry[0] and srv.active:
        log.info("waiting for %d requests in flight", srv.active)
        try:
            await asyncio.wait_for(srv.idle.wait(), cfg.server.shutdown_timeout_s)
        except asyncio.TimeoutError:
            log.warning("drain deadline passed with %d requests in flight: aborting them", srv.active)
    if srv.active:
        # Fail what is left through the normal error path, so every stream ends with an error event
        # and [DONE] instead of being cut by the connection close below.
        srv.fail_inflight(APIError(503, "the server is shutting down: the drain deadline passed before this "
                                        "request finished", code="shutting_down"))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(srv.idle.wait(), FAIL_GRACE_S)
    log.info("drained; closing connections and stopping the engine")
    # Safety net: whatever happens below (a stuck close, a thread that never ends), the process exits.
    watchdog = threading.Timer(CLEANUP_S + 15, _hard_exit, (code[0],))
    watchdog.daemon = True
    watchdog.start()
    try:
        await asyncio.wait_for(runner.cleanup(), CLEANUP_S)
    except asyncio.TimeoutError:
        log.error("cleanup took over %ds; killing the engine and exiting", CLEANUP_S)
        gen = srv.client.gen
        if gen is not None and gen.proc.returncode is None:
            gen.proc.kill()
    log.info("stopped (exit code %d)", code[0])
    return code[0]


def dump_tasks() -> None:
    """Log every asyncio task and where it waits (for a server that seems stuck)."""
    for t in asyncio.all_tasks():
        buf = io.StringIO()
        t.print_stack(limit=12, file=buf)
        log.warning("task %s:\n%s", t.get_name(), buf.getvalue())


def _hard_exit(code: int) -> None:
    log.error("shutdown hung; exiting hard")
    logging.shutdown()
    os._exit(code)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (the `fast` extra), else None: asyncio's own."""
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


def serve(cfg: MleagleConfig, access_log: bool = False) -> int:
    factory = loop_factory()
    try:
        if sys.version_info >= (3, 11):
            with asyncio.Runner(loop_factory=factory) as runner:
                return runner.run(serve_async(cfg, access_log))
        if factory is not None:  # Python 3.10: no Runner; uvloop through its policy
            import uvloop  # type: ignore[import-not-found]

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        return asyncio.run(serve_async(cfg, access_log))
    except OSError as e:
        print(f"mleagle serve: {e}", file=sys.stderr)
        return 1
