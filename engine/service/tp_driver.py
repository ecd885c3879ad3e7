"""The tensor-parallel driver: what keeps the ranks of one engine in step, outside the engine itself.

`start_engine(config)` is how a tensor-parallel engine is made (and `follower_main`, `python -m
mleagle.engine.service.tp_driver --rank R ...`, is the process of each rank above 0): it refuses a shape that cannot be
sharded (before any rank starts), joins or starts the ranks (`ranks.attach`: this process becomes rank
0, or a follower, or adopts a group a launcher set up), builds the `Engine` on that group and installs
a `TPDriver` as its `StepControl`. At TP size 1 it returns a plain `Engine`.

The driver owns the control queue and the digests. On rank 0 every replicable operation the engine
performs (a request added with its resolved seed, an abort, a prefix-cache reset) is queued (`submit`),
and before every step the queue goes to the followers in one broadcast on the control group, with the
digest of rank 0's previous step's outputs (`run_step`); every rank then runs the same deterministic
scheduler and worker, so they launch the same forwards with the same shapes. A follower (`follow`)
applies the messages, checks the digest against its own and steps; a mismatch stops it with a clear
error instead of drifting into mismatched collectives. A step that raises on rank 0 is reported as the
failure of the rank that is gone (from the runtime's liveness checks), not as the collective that
noticed it.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from mleagle.engine.contract.config import MleagleConfig
from mleagle.engine.contract.outputs import StepOutput
from mleagle.engine.core.engine import Engine, resolve_engine_config
from mleagle.engine.distributed import TPGroup
from mleagle.engine.errors import EngineInputError
from mleagle.engine.service import ranks
from mleagle.engine.service.parent import die_with_parent
from mleagle.engine.service.ranks import (
    Bootstrap,
    Control,
    RankError,
    Runtime,
    Topology,
    join_follower,
    report_failure,
)

log = logging.getLogger("mleagle.engine.tp")


def outputs_digest(outs: Sequence[StepOutput]) -> int:
    """A cheap fingerprint of one step's outputs, equal on ranks that made the same tokens."""
    key = repr([(o.rid, list(o.token_ids), o.finished, o.finish_reason) for o in outs])
    return zlib.crc32(key.encode())


class TPDriver:
    """One rank's side of the engine's control channel (see the module docstring)."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.outbox: list[tuple[Any, ...]] = []
        self.digest = 0  # of this rank's last step's outputs

    # --- StepControl -----------------------------------------------------------------------------
    def submit(self, msg: tuple[Any, ...]) -> None:
        if self.rt.rank == 0:
            self.outbox.append(msg)

    def run_step(self, step: Callable[[], list[StepOutput]]) -> list[StepOutput]:
        try:
            if self.rt.rank == 0:
                self.rt.send(Control(self.outbox, step=True, digest=self.digest))
                self.outbox = []
            outs = step()
            self.digest = outputs_digest(outs)
            return outs
        except Exception as err:
            if self.rt.closed or not self.rt.owned:
                raise
            failed = self.rt.failed(err)  # name the rank that is gone, not the collective
            # Said now: the cleanup on the way out (the broken group's teardown) may not return.
            log.error("%s", failed)
            raise failed from err

    def close(self) -> None:
        """Rank 0: stop the followers (a no-op on a follower)."""
        if self.rt.rank == 0:
            self.rt.stop_engine()

    # --- rank 0 ------------------------------------------------------------------------------------
    def pause(self) -> None:
        """Rank 0: send the queued operations, then let the followers return from `follow` with every
        rank in the same scheduler state (the engine stays usable: a pause, not a close)."""
        self.rt.send(Control(self.outbox, stop=True))
        self.outbox = []

    # --- followers --------------------------------------------------------------------------------
    def follow(self, engine: Engine) -> int:
        """A follower's loop: apply rank 0's operations, step when it steps, until it stops."""
        while True:
            c = self.rt.recv()
            # The engine's own digest of its last step (kept across a stop, as rank 0's is).
            if c.digest != -1 and c.digest != self.digest:
                raise RankError(f"rank {self.rt.rank}'s outputs differ from rank 0's (digest {self.digest} vs "
                                f"{c.digest}): the ranks no longer compute the same tokens")
            for m in c.msgs:
                engine.apply_control(m)
            if c.stop:
                return 0
            if c.step:
                engine.step()


def driver_of(engine: Engine) -> TPDriver:
    """The driver a tensor-parallel engine runs under (`start_engine` installed it)."""
    if not isinstance(engine.control, TPDriver):
        raise RuntimeError("this engine was not started by mleagle.engine.service.tp_driver.start_engine")
    return engine.control


def start_engine(config: MleagleConfig | str | None = None, **overrides: Any) -> Engine:
    """An engine for `config` (with [engine] `overrides`): at TP size 1 a plain `Engine`; above it,
    this process as one of its ranks, with a `TPDriver` keeping the ranks together. The ranks start
    only once the engine has loaded the model and found its shape shardable."""
    holder: list[Runtime] = []

    def join() -> TPGroup:
        try:
            rt = ranks.attach(cfg)
        except (ValueError, RankError) as err:
            raise EngineInputError(str(err)) from err
        holder.append(rt)
        return rt.tp

    cfg, _ = resolve_engine_config(config, **overrides)
    if cfg.engine.tp_size <= 1:
        return Engine(config, **overrides)
    engine = Engine(config, tp=join, **overrides)
    engine.control = TPDriver(holder[0])
    return engine


def start_follower(rt: Runtime, cfg: MleagleConfig) -> tuple[Engine, TPDriver]:
    """A follower rank's engine, built from rank 0's published configuration, and its driver."""
    engine = Engine(cfg, tp=rt.tp)
    driver = TPDriver(rt)
    engine.control = driver
    return engine, driver


def follower_main(argv: list[str] | None = None) -> int:
    """One follower rank process (`python -m mleagle.engine.service.tp_driver --rank R ...`, its
    `Bootstrap` on stdin), started by rank 0 or by `mleagle engine-ranks`: join, build the engine from
    rank 0's configuration, follow."""
    ap = argparse.ArgumentParser(prog="python -m mleagle.engine.service.tp_driver")
    ranks.topology_args(ap)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--local-rank", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, default=None)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank[{a.rank}] %(levelname)s %(message)s")
    if a.parent_pid is not None:
        die_with_parent(a.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 (or the launcher) decides when we stop
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: where is this rank waiting?
    topo = Topology(a.tp, a.nnodes, a.node_rank, a.master_addr, a.master_port)
    boot = Bootstrap.loads(sys.stdin.buffer.read())  # the secret, from whoever started us (never argv)
    try:
        rt, cfg = join_follower(topo, a.rank, a.local_rank, boot)
        engine, driver = start_follower(rt, cfg)
        code = driver.follow(engine)
    except Exception as e:
        log.error("rank %d failed: %s: %s", a.rank, type(e).__name__, e, exc_info=True)
        rt_now = ranks.runtime()
        report_failure(topo, boot, f"rank {a.rank} failed: {type(e).__name__}: {e}", getattr(rt_now, "store", None))
        logging.shutdown()
        os._exit(1)  # a failed rank must not wait in a group destructor: the others are watching
    rt.finish_follower()
    return code


if __name__ == "__main__":
    # Run the imported module's copy: its runtime is the one the Engine finds (not this __main__'s).
    from mleagle.engine.service import tp_driver as _tp

    sys.exit(_tp.follower_main())
