"""Issue 22 against a real `mleagle serve --tp 2` (two gloo ranks on the CPU, the tiny random model):
a stranger who tries what the probe did (find the rendezvous store, read it, write `mleagle/failed`,
overwrite every key it lists) neither stops nor steers the engine; a dead rank ends the streams in
flight with `engine_dead`; a model whose shape does not divide is refused with the fix.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.daemon_helpers import ServerProc, gen_stream

KEY = "tp-hardening-key-41c7"
BODY = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}


def children(pid: int) -> list[int]:
    return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def listening(pids: list[int]) -> list[tuple[str, int]]:
    """Every TCP (v4 and v6) socket these processes listen on, as (address, port) to connect to."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = f[1].split(":")
            raw = bytes.fromhex(addr)
            ip = socket.inet_ntop(socket.AF_INET6 if v6 else socket.AF_INET,
                                  b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
            if ipaddress.ip_address(ip).is_unspecified or ipaddress.ip_address(ip).is_loopback:
                out.append(("::1" if v6 else "127.0.0.1", int(port, 16)))  # reachable from loopback
    return out


def open_files(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                out.append(os.readlink(fd))
            except OSError:
                pass
    return out


# One process tries every port at once, each in a thread: a TCPStore client's handshake with a port
# that is not a store (gloo's listeners) can wait forever, whatever its timeout.
PROBE = """
import datetime, json, os, sys, threading, time
from torch.distributed import TCPStore
reached = []
def probe(host, port):
    try:
        st = TCPStore(host, port, None, False, datetime.timedelta(seconds=2))
        keys = st.list_keys()
    except Exception:
        return
    st.set("mleagle/failed", "a stranger says the engine failed")
    for k in keys:
        st.set(k, "garbage")
    reached.append([host, port, keys])
ts = [threading.Thread(target=probe, args=tuple(a), daemon=True) for a in json.loads(sys.argv[1])]
for t in ts:
    t.start()
end = time.monotonic() + 10  # one deadline for all: a probe the far end leaves hanging has not reached it
for t in ts:
    t.join(max(0.0, end - time.monotonic()))
print(json.dumps(reached), flush=True)
os._exit(0)
"""


def generate(srv: ServerProc) -> list[int]:
    import urllib.request

    req = urllib.request.Request(srv.url + "/generate", data=json.dumps(BODY).encode(),
                                 headers={"Content-Type": "application/json", **srv.headers})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["token_ids"]


@pytest.fixture(scope="module")
def tp_srv():
    s = ServerProc("--config", "tiny-dummy", "--tp", "2", "--threads", "1", env={"MLEAGLE_API_KEY": KEY})
    s.api_key = KEY
    try:
        s.wait_healthy(120)
        s.ref = generate(s)
        yield s
        assert s.terminate() == 0, s.log()
    finally:
        s.kill()


def test_a_stranger_cannot_stop_or_steer_the_rendezvous_store(tp_srv: ServerProc) -> None:
    from torch.distributed import FileStore

    d = tp_srv.engine()
    pids = [d["pid"], *children(d["pid"])]
    assert len(pids) == 2
    ports, files = listening(pids), open_files(pids)
    # What the probe did, on every port the ranks listen on: connect as a TCPStore client, read what it
    # lists, write `mleagle/failed`, overwrite every key with garbage.
    reached = json.loads(subprocess.run([sys.executable, "-c", PROBE, json.dumps(ports)], capture_output=True,
                                        text=True, timeout=60).stdout or "null")
    time.sleep(4 * 0.5 + 1)  # several heartbeats: every watchdog has looked at the store by now
    st, health = tp_srv.get("/health")
    assert reached == [] and st == 200 and health["restarts"] == 0, \
        f"a stranger reached the rendezvous store: {reached}; /health {st} {health}"
    # The store on one node is a file in a private folder: only its owner may enter. Even the owner's
    # other programs (the strongest stranger short of one that can kill the ranks) cannot forge a value:
    # every one is signed with the engine's secret.
    dirs = {str(Path(f).parent) for f in files if "/mleagle-tp-" in f}
    assert len(dirs) == 1, dirs
    store_dir = Path(dirs.pop())
    assert stat.S_IMODE(store_dir.stat().st_mode) == 0o700
    fs = FileStore(str(store_dir / "store"), -1)
    fs.set("mleagle/failed", "a stranger says the engine failed")
    keys = fs.list_keys()  # the namespaced keys are in plain sight here: forge a value under each
    ns = {k.split("/", 1)[0] for k in keys if k.endswith("mleagle/config")}
    assert len(ns) == 1, keys
    fs.set(f"{ns.pop()}/mleagle/failed", "x" * 32 + "a stranger says the engine failed")
    for k in keys:
        fs.set(k, "garbage")
    assert KEY.encode() not in (store_dir / "store").read_bytes()  # the API key is not in the store either
    time.sleep(4 * 0.5 + 1)
    st, health = tp_srv.get("/health")
    assert st == 200 and health["restarts"] == 0, health
    assert generate(tp_srv) == tp_srv.ref  # steered nowhere: the same tokens as before
    assert "going down" not in tp_srv.log()


async def test_a_dead_rank_ends_streams_with_engine_dead(tp_srv: ServerProc) -> None:
    d = tp_srv.engine()
    follower = children(d["pid"])[0]
    store_dirs = {str(Path(f).parent) for f in open_files([d["pid"]]) if "/mleagle-tp-" in f}
    firsts = [asyncio.Event() for _ in range(3)]
    async with aiohttp.ClientSession(headers=tp_srv.headers) as s:
        jobs = [asyncio.create_task(gen_stream(s, tp_srv.url, 1000, f)) for f in firsts]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)  # every stream under way
        os.kill(follower, signal.SIGKILL)
        res = await asyncio.wait_for(asyncio.gather(*jobs), 60)
    for r in res:
        assert r["status"] == 200 and r["done"] and r["error"] is not None, r
        assert r["error"]["code"] == "engine_dead", r["error"]
        assert r["error"]["type"] == "service_unavailable_error", r["error"]
    tp_srv.wait_restart(60, 120)
    d2 = tp_srv.engine()
    assert d2["restarts"] == 1 and d2["pid"] != d["pid"] and len(children(d2["pid"])) == 1
    assert generate(tp_srv) == tp_srv.ref
    assert store_dirs and not any(Path(p).exists() for p in store_dirs)  # the dead engine's store is gone


def test_a_shape_that_does_not_divide_is_refused_with_the_fix(tmp_path: Path) -> None:
    cfg = tmp_path / "heads3.toml"
    cfg.write_text((Path(__file__).resolve().parents[2] / "configs" / "tiny-dummy.toml").read_text()
                   .replace("hidden_size = 64", "hidden_size = 48").replace("num_attention_heads = 4",
                                                                            "num_attention_heads = 3")
                   .replace("num_key_value_heads = 2", "num_key_value_heads = 1")
                   .replace("intermediate_size = 128", "intermediate_size = 96"))
    s = ServerProc("--config", str(cfg), "--tp", "2", "--threads", "1", "--no-restart-engine")
    try:
        assert s.proc.wait(120) == 1
    finally:
        s.kill()
    time.sleep(0.2)
    log = s.log()
    assert "num_attention_heads=3 is not divisible by tp_size=2" in log, log
    assert "use --tp 1 or 3" in log, log  # the fix: the sizes this model divides into


def test_signed_store_and_secret_file(tmp_path: Path) -> None:
    """The pieces under the above: values tagged and checked, keys namespaced, counters signed; a
    secret file others can read, or too short to be a secret, is refused with the fix."""
    from torch.distributed import FileStore

    from mleagle.engine.service.ranks import SignedStore, StoreTampered, read_secret_file

    raw = FileStore(str(tmp_path / "store"), -1)
    a, b = SignedStore(raw, b"s" * 32), SignedStore(raw, b"t" * 32)
    a.set("mleagle/config", "{}")
    assert a.get("mleagle/config") == b"{}" and a.check(["mleagle/config"])
    assert not raw.check(["mleagle/config"]) and not b.check(["mleagle/config"])  # under a's namespace only
    raw.set(a.ns + "mleagle/failed", b"\0" * 32 + b"forged")
    with pytest.raises(StoreTampered):
        a.get("mleagle/failed")
    raw.set(a.ns + "moved", raw.get(a.ns + "mleagle/config"))  # a valid value under another key
    with pytest.raises(StoreTampered):
        a.get("moved")
    assert a.add("n", 2) == 2 and a.add("n", 3) == 5 and a.get("n") == b"5"
    f = tmp_path / "secret"
    f.write_text("x" * 64)
    f.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_secret_file(str(f))
    f.chmod(0o600)
    assert read_secret_file(str(f)) == b"x" * 64
    f.write_text("short")
    with pytest.raises(ValueError, match="at least 32"):
        read_secret_file(str(f))
