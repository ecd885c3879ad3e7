"""Tensor-parallel rank processes: rendezvous, local ranks, liveness, rank 0's schedule, the followers.

Topology. `tp_size` ranks on `nnodes` nodes, L = tp_size/nnodes per node; global rank = node_rank·L +
local rank, and the local rank is the GPU index. Rank 0 lives in the engine's own process (the daemon's
engine process, or the process that built an offline `Engine`). When that Engine starts, rank 0 hosts
the rendezvous store, publishes the engine configuration in it, and starts its node's other ranks as
child processes (`python -m mleagle.engine.service.ranks`); every other node runs `mleagle engine-ranks
--node-rank K`, which starts that node's ranks. Each rank joins the process group (NCCL on GPUs, gloo
on CPUs) and a gloo control group, builds the same Engine from the published configuration, and follows.
A process group set up by another launcher (torchrun, the tests) is adopted as it is (`adopt`).

The store is closed to strangers. On one node it is a torch FileStore in a fresh private folder
(`$TMPDIR/mleagle-tp-<pid>-*`, mode 0700, removed when rank 0 ends): nothing listens on any port, and
no other user can open it. Across nodes it is a TCPStore bound to MASTER_ADDR only (through a socket
bound here and handed over, since TCPStore itself listens on every interface). Either way every rank
talks to it through `SignedStore`: each key lives under a namespace derived from a secret, and each
value carries an HMAC-SHA256 of key and value under that secret, checked on every read. A value
without a valid tag is never believed: a forged failure report is ignored, a forged configuration or
process-group address makes the join fail, so whoever can reach the store but lacks the secret can
neither stop nor steer the engine. The secret is made fresh per engine on one node and handed to the
child ranks on their stdin (never a command line or an environment, which other users can read in
/proc); across nodes it is the content of `tp_secret_file`, a file only its owner can read (mode 0600,
the same on every node), which `engine-ranks --tp-secret-file` hands to its ranks the same way.
Heartbeats on one node are counters in files of the private folder (a FileStore only appends, so
heartbeats through it would grow it without end); across nodes they are signed values in the store.

Schedule. Before every scheduler step rank 0 broadcasts on the control group the control messages it
took since the last one (requests added, with their resolved seeds; aborts); every rank applies them and
runs the same deterministic scheduler and worker, so every rank launches the same forwards with the same
shapes, and the device-resident sampling (a counter-based RNG over the same gathered logits) makes the
same tokens. Only rank 0 reports to the daemon. A digest of rank 0's previous step outputs rides along;
a follower whose own outputs differ stops with a clear error instead of drifting into mismatched
collectives. An idle rank 0 sends nothing: followers wait in the control broadcast without a timeout.

Liveness: no rank may hang on a dead one. Each rank's watchdog thread bumps its heartbeat counter
(over its own store connection) and watches the others'; a counter that stops for `tp_timeout_s`, a
store that cannot be reached (rank 0, its host, is gone), a local child rank that exits, or a (signed)
failure reported in the store ends the process at once with `os._exit`, because a thread blocked in a
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
import hashlib
import hmac
import json
import logging
import os
import pickle
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mleagle.engine.contract.config import EngineConfig, MleagleConfig
from mleagle.engine.contract.protocol import pid_alive
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
    """Rank 0's view: the config, else $MASTER_ADDR / $MASTER_PORT (used across nodes only: one node's
    store is a private folder)."""
    addr = e.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = e.master_port if e.master_port is not None else int(os.environ.get("MASTER_PORT") or 0)
    if e.nnodes > 1 and not port:
        raise ValueError("a multi-node engine needs a rendezvous port: --master-port (or $MASTER_PORT)")
    if e.nnodes > 1 and not e.tp_secret_file:
        raise ValueError("a multi-node engine needs --tp-secret-file: a file only you can read (chmod 600), the same "
                         "on every node, whose secret signs the rendezvous store (e.g. `umask 077; python -c "
                         "'import secrets; print(secrets.token_hex(32))' > FILE`)")
    t = Topology(e.tp_size, e.nnodes, 0, addr, port)
    t.check()
    return t


# --- the rendezvous store: private, and every value signed ------------------------------------------
STORE_DIR_PREFIX = "mleagle-tp-"
SECRET_MIN_CHARS = 32  # a secret file holds at least 128 bits as hex (or more of anything else)
TAG_BYTES = 32  # HMAC-SHA256


class StoreTampered(RankError):
    """A value in the rendezvous store lacks this engine's signature: someone without the secret wrote it."""


def read_secret_file(path: str) -> bytes:
    """The multi-node secret: the content of a regular file that only its owner can read or write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ValueError(f"--tp-secret-file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ValueError(f"--tp-secret-file {path} must be a regular file of yours that no one else can read or "
                             f"write (it is mode {stat.S_IMODE(st.st_mode):o}: chmod 600 it)")
        data = os.read(fd, 1 << 16).strip()
    finally:
        os.close(fd)
    if len(data) < SECRET_MIN_CHARS:
        raise ValueError(f"--tp-secret-file {path} holds {len(data)} characters; a secret needs at least "
                         f"{SECRET_MIN_CHARS} (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return data


@dataclass
class Bootstrap:
    """What a rank needs besides its topology to reach the store: travels on stdin, never on a
    command line or in an environment (both readable by other users in /proc)."""

    secret: bytes
    store_dir: str | None = None  # one node: the private folder of the FileStore and the heartbeats

    def dumps(self) -> bytes:
        return json.dumps({"secret": self.secret.hex(), "store_dir": self.store_dir}).encode()

    @classmethod
    def loads(cls, data: bytes) -> Bootstrap:
        try:
            d = json.loads(data)
            return cls(bytes.fromhex(d["secret"]), d.get("store_dir"))
        except (ValueError, KeyError, TypeError) as e:
            raise RankError(f"no bootstrap on stdin (this process is started by rank 0 or engine-ranks): {e}") from None


class SignedStore(dist.Store):
    """A store (FileStore, TCPStore) whose keys live under a namespace derived from the secret and whose
    values carry an HMAC-SHA256 tag over key and value, checked on every read (`StoreTampered` if it
    does not match). The process groups rendezvous through it too, so the addresses the ranks connect
    to are signed as well."""

    def __init__(self, raw: Any, secret: bytes) -> None:
        super().__init__()
        self.raw = raw
        self._mac_key = hmac.new(secret, b"mleagle-tp-store-mac", hashlib.sha256).digest()
        self.ns = hmac.new(secret, b"mleagle-tp-store-namespace", hashlib.sha256).hexdigest()[:32] + "/"
        self.warned = False  # a forged value was seen and logged

    def _k(self, key: str) -> str:
        return self.ns + key

    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._mac_key, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def _seal(self, key: str, value: bytes | str) -> bytes:
        v = value.encode() if isinstance(value, str) else bytes(value)
        return self._tag(key, v) + v

    def _open(self, key: str, data: bytes) -> bytes:
        tag, value = data[:TAG_BYTES], data[TAG_BYTES:]
        if len(data) < TAG_BYTES or not hmac.compare_digest(tag, self._tag(key, value)):
            raise StoreTampered(f"the rendezvous store's value of {key!r} is not signed with this engine's secret")
        return value

    def set(self, key: str, value: bytes | str) -> None:
        self.raw.set(self._k(key), self._seal(key, value))

    def get(self, key: str) -> bytes:
        return self._open(key, self.raw.get(self._k(key)))

    def check(self, keys: list[str]) -> bool:
        return bool(self.raw.check([self._k(k) for k in keys]))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        ks = [self._k(k) for k in keys]
        if timeout is None:
            self.raw.wait(ks)
        else:
            self.raw.wait(ks, timeout)

    def add(self, key: str, amount: int) -> int:
        # A signed counter: read, check, write back only if nobody wrote in between.
        k = self._k(key)
        while True:
            old = self.raw.get(k) if self.raw.check([k]) else b""
            cur = int(self._open(key, old)) if old else 0
            new = self._seal(key, str(cur + amount))
            if self.raw.compare_set(k, old, new) == new:
                return cur + amount

    def delete_key(self, key: str) -> bool:
        return bool(self.raw.delete_key(self._k(key)))

    def num_keys(self) -> int:
        return int(self.raw.num_keys())


def _sweep_store_dirs() -> None:
    """Remove this user's store folders whose rank 0 is gone (a rank 0 killed with SIGKILL runs no cleanup)."""
    for d in Path(tempfile.gettempdir()).glob(STORE_DIR_PREFIX + "*"):
        try:
            pid = int(d.name[len(STORE_DIR_PREFIX):].split("-", 1)[0])
            if d.is_symlink() or not d.is_dir() or d.stat().st_uid != os.getuid() or pid_alive(pid):
                continue
        except (ValueError, OSError):
            continue
        shutil.rmtree(d, ignore_errors=True)


def _bootstrap(e: EngineConfig, topo: Topology) -> Bootstrap:
    """Rank 0's: one node, a fresh secret and a fresh private folder; several, the shared secret file."""
    if topo.nnodes > 1:
        assert e.tp_secret_file is not None  # topology() insists
        return Bootstrap(read_secret_file(e.tp_secret_file))
    _sweep_store_dirs()
    d = tempfile.mkdtemp(prefix=f"{STORE_DIR_PREFIX}{os.getpid()}-")  # mkdtemp: mode 0700
    os.chmod(d, 0o700)
    return Bootstrap(secrets.token_bytes(32), d)


def _raw_store(topo: Topology, boot: Bootstrap, timeout_s: float, server: bool = False) -> Any:
    """A new connection to the store (rank 0 with `server`: the store itself)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if boot.store_dir is not None:
        path = os.path.join(boot.store_dir, "store")
        if not server and not os.path.exists(path):
            raise RankError(f"the rendezvous store {path} is gone (rank 0 ended)")
        st = dist.FileStore(path, -1)  # -1: never removes the file itself; rank 0 removes the folder
        st.set_timeout(timeout)
        return st
    if not server:
        return dist.TCPStore(topo.addr, topo.port, None, False, timeout)
    # TCPStore's own server listens on every interface: bind the address the other nodes were told,
    # and only that, and hand TCPStore the listening socket.
    family, kind, proto, _, addr = socket.getaddrinfo(topo.addr, topo.port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise RankError(f"cannot bind the rendezvous store to {topo.addr}:{topo.port} ({e.strerror}): --master-addr "
                        "must be an address of this node") from None
    port = sock.getsockname()[1]
    return dist.TCPStore(topo.addr, port, topo.tp, True, timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())


def connect(topo: Topology, boot: Bootstrap, timeout_s: float = JOIN_TIMEOUT_S) -> SignedStore:
    return SignedStore(_raw_store(topo, boot, timeout_s), boot.secret)


def _failure(store: SignedStore) -> str | None:
    """The failure reported in the store, if a rank or launcher (a holder of the secret) reported one."""
    if not store.check([FAILED_KEY]):
        return None
    try:
        return store.get(FAILED_KEY).decode(errors="replace")
    except StoreTampered:
        if not store.warned:  # once per connection: a forged value stays there, and this runs every heartbeat
            store.warned = True
            log.warning("ignored a failure report in the rendezvous store that is not signed with the engine's secret")
        return None


class _FileBeats:
    """One node: each rank's heartbeat counter in its own file of the private folder, overwritten in place."""

    def __init__(self, d: str, rank: int) -> None:
        self.d, self.n = d, 0
        self.fd = os.open(os.path.join(d, f"hb-{rank}"), os.O_RDWR | os.O_CREAT, 0o600)

    def bump(self) -> None:
        self.n += 1
        os.pwrite(self.fd, self.n.to_bytes(8, "little"), 0)

    def read(self, r: int) -> int:
        try:
            with open(os.path.join(self.d, f"hb-{r}"), "rb") as f:
                return int.from_bytes(f.read(8), "little")
        except FileNotFoundError:
            return 0

    def close(self) -> None:
        os.close(self.fd)


class _StoreBeats:
    """Across nodes: signed counters in the TCP store (which overwrites in place); a forged one is no news."""

    def __init__(self, store: SignedStore, rank: int) -> None:
        self.store, self.rank, self.n = store, rank, 0

    def bump(self) -> None:
        self.n += 1
        self.store.set(f"hb/{self.rank}", str(self.n))

    def read(self, r: int) -> int:
        key = f"hb/{r}"
        if not self.store.check([key]):
            return 0
        try:
            return int(self.store.get(key))
        except (StoreTampered, ValueError):
            return 0

    def close(self) -> None:
        pass


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
        assert rt.boot is not None
        try:
            # Its own connection: the main thread's store may be busy in a long wait (the join barrier).
            store = connect(rt.topo, rt.boot, 30)
            beats: _FileBeats | _StoreBeats = (_FileBeats(rt.boot.store_dir, rt.rank) if rt.boot.store_dir is not None
                                               else _StoreBeats(store, rt.rank))
        except Exception as e:
            rt.die(f"rank {rt.rank}: cannot reach the rendezvous store ({e})", report=False)
            return
        try:
            self._watch(rt, store, beats)
        finally:
            beats.close()

    def _watch(self, rt: Runtime, store: SignedStore, beats: _FileBeats | _StoreBeats) -> None:
        others = [r for r in range(rt.size) if r != rt.rank]
        seen: dict[int, tuple[int, float]] = {}
        while not self.halt.wait(HEARTBEAT_S):
            now = time.monotonic()
            try:
                why = _failure(store)  # only a signed report counts: a stranger's write is ignored
                if why is not None:
                    rt.die(why, report=False)
                beats.bump()
                for r in others:
                    v = beats.read(r)
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

    def __init__(self, topo: Topology, rank: int, local_rank: int, store: SignedStore | None, owned: bool,
                 children: list[tuple[int, subprocess.Popen[bytes]]] | None = None, boot: Bootstrap | None = None):
        self.topo, self.rank, self.local_rank = topo, rank, local_rank
        self.size = topo.tp
        self.store = store
        self.boot = boot
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
        if report and self.store is not None and self.boot is not None:
            report_failure(self.topo, self.boot, why)
        self.remove_store_dir()
        os._exit(1)

    def remove_store_dir(self) -> None:
        """Rank 0 of one node: remove the private store folder (the followers then find the store gone)."""
        if self.rank == 0 and self.owned and self.boot is not None and self.boot.store_dir is not None:
            shutil.rmtree(self.boot.store_dir, ignore_errors=True)

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
                if why is None and self.store is not None:
                    why = _failure(self.store)
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
                assert self.store is not None  # an owned runtime has its store
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
            assert self.store is not None
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
        self.remove_store_dir()
        set_current(TPGroup())
        _RT = None


_RT: Runtime | None = None


def runtime() -> Runtime | None:
    return _RT


def report_failure(topo: Topology, boot: Bootstrap, why: str, store: SignedStore | None = None,
                   rank: int | None = None, pid: int | None = None) -> None:
    """Tell every rank through the store (best effort, never blocking long), signed. With `rank`/`pid`
    (a launcher reporting a dead child), only if that pid is the one the rank registered in this store:
    the store may already belong to a newer rank 0, whose engine must not be failed."""
    try:
        if store is None:
            store = connect(topo, boot, 2)
        if rank is not None:
            key = f"pid/{rank}"
            if not store.check([key]) or store.get(key).decode() != str(pid):
                return
        if _failure(store) is None:  # none yet, or only a stranger's (which ours replaces)
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
        assert rt.store is not None  # joining (not adopting) always has a store
        dist.init_process_group(backend, store=dist.PrefixStore("pg", rt.store), rank=rt.rank, world_size=rt.size,  # type: ignore[arg-type]
                                timeout=COLLECTIVE_TIMEOUT)
    rt.ctl = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    set_current(rt.tp)
    _RT = rt
    return rt


def _spawn_rank(topo: Topology, local_rank: int, parent: int, boot: Bootstrap) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "mleagle.engine.service.tp_driver", "--rank", str(topo.global_rank(local_rank)),
           "--local-rank", str(local_rank), "--tp", str(topo.tp), "--nnodes", str(topo.nnodes),
           "--node-rank", str(topo.node_rank), "--master-addr", topo.addr, "--master-port", str(topo.port),
           "--parent-pid", str(parent)]
    # The environment is passed on whole (PYTHONPATH, NCCL_* and the NVLink-multicast switches among it);
    # the secret goes on a pipe (the pipe's buffer holds it whole: this never blocks).
    p = subprocess.Popen(cmd, env=dict(os.environ), stdin=subprocess.PIPE)
    assert p.stdin is not None
    try:
        p.stdin.write(boot.dumps())
        p.stdin.close()
    except BrokenPipeError:
        pass  # it died at once: the watchdog or the launcher sees the exit
    return p


def start_rank0(cfg: MleagleConfig) -> Runtime:
    """Rank 0 of an engine with tp_size > 1: host the store, publish the config, start the local ranks,
    join the group. Remote nodes' ranks (`mleagle engine-ranks`) join through the same store."""
    topo = topology(cfg.engine)
    boot = _bootstrap(cfg.engine, topo)
    try:
        raw = _raw_store(topo, boot, JOIN_TIMEOUT_S, server=True)
    except BaseException:
        if boot.store_dir is not None:
            shutil.rmtree(boot.store_dir, ignore_errors=True)
        raise
    if boot.store_dir is None:
        topo.port = raw.port
    store = SignedStore(raw, boot.secret)
    store.set(CONFIG_KEY, cfg.for_engine())  # no secret (the API key) ever reaches the store
    children = [(lr, _spawn_rank(topo, lr, os.getpid(), boot)) for lr in range(1, topo.local_size)]
    where = f"a private store in {boot.store_dir}" if boot.store_dir else f"{topo.addr}:{topo.port}, signed"
    log.info("tensor parallel: rank 0 of %d (%d per node on %d nodes), rendezvous %s, %d local ranks started",
             topo.tp, topo.local_size, topo.nnodes, where, len(children))
    rt = Runtime(topo, 0, 0, store, owned=True, children=children, boot=boot)
    try:
        rt.watch(cfg.engine.tp_timeout_s)  # before the join: a local rank that dies while starting is noticed
        _join(rt, _backend(cfg))
    except BaseException:
        rt.kill_children()
        rt.remove_store_dir()
        raise
    atexit.register(rt.stop_engine)
    return rt


def join_follower(topo: Topology, rank: int, local_rank: int, boot: Bootstrap) -> tuple[Runtime, MleagleConfig]:
    """A rank above 0 started by rank 0 or by `engine-ranks`: meet rank 0's store, read the engine's
    configuration from it (signed by rank 0, or refused), join the group."""
    store = connect(topo, boot)
    cfg = MleagleConfig.model_validate_json(store.get(CONFIG_KEY))
    if cfg.engine.tp_size != topo.tp:
        raise RankError(f"rank 0 runs tp_size {cfg.engine.tp_size}, this rank was started for {topo.tp}")
    store.set(f"pid/{rank}", str(os.getpid()))  # what a launcher checks before reporting this rank dead
    rt = Runtime(topo, rank, local_rank, store, owned=True, boot=boot)
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
    ap.add_argument("--tp-secret-file", default=os.environ.get("MLEAGLE_TP_SECRET_FILE"),
                    help="the file (mode 0600) holding the secret rank 0 was given with --tp-secret-file "
                         "(default $MLEAGLE_TP_SECRET_FILE)")
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
    if not a.tp_secret_file:
        print("mleagle engine-ranks: --tp-secret-file (or $MLEAGLE_TP_SECRET_FILE) is required: the same secret "
              "file rank 0 was given", file=sys.stderr)
        return 2
    try:
        boot = Bootstrap(read_secret_file(a.tp_secret_file))
    except ValueError as e:
        print(f"mleagle engine-ranks: {e}", file=sys.stderr)
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
        procs[:] = [_spawn_rank(topo, lr, os.getpid(), boot) for lr in range(topo.local_size)]
        log.info("started ranks %s (pids %s), rendezvous %s:%d",
                 [topo.global_rank(lr) for lr in range(topo.local_size)], [p.pid for p in procs], topo.addr, topo.port)
        codes = _wait_ranks(procs, topo, boot)
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
        _await_new_store(topo, boot, topo.global_rank(0), procs[0].pid, timeout=30.0)
        time.sleep(delay)
        delay = min(delay * 2, 30.0)
    return 0


def _await_new_store(topo: Topology, boot: Bootstrap, rank: int, pid: int, timeout: float) -> None:
    """Until the rendezvous store is gone or holds another registration for `rank` than `pid`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            st = connect(topo, boot, 2)
            key = f"pid/{rank}"
            if not st.check([key]) or st.get(key).decode() != str(pid):
                return
        except Exception:
            return
        time.sleep(0.2)


def _wait_ranks(procs: list[subprocess.Popen[bytes]], topo: Topology, boot: Bootstrap) -> list[int]:
    """Wait for every rank; the first failure is reported to the engine and ends the others (they
    would hang on it)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(lr, p, c) for lr, (p, c) in enumerate(zip(procs, codes)) if c not in (None, 0)]
        for lr, p, c in failed:
            r = topo.global_rank(lr)
            report_failure(topo, boot, f"rank {r} (pid {p.pid}, node {topo.node_rank}) exited with code {c}",
                           rank=r, pid=p.pid)
        if failed:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return [int(p.wait()) for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes]  # type: ignore[arg-type]
        time.sleep(0.2)
