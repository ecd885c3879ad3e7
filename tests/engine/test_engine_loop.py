"""The engine process's loop (`EngineLoop`) in this process, over a real engine channel (a Unix socket)
and a real CPU engine (tiny-dummy): after its last step it polls without sleeping for its spin window,
takes a request that arrives inside that window, and then blocks again (its spin count stops growing);
an arrival is stepped before the idle telemetry runs; when the daemon's end of the channel closes, the
loop ends."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from mleagle.engine.contract.channel import EngineChannel, FrameBuffer, frame
from mleagle.engine.contract.config import load_config
from mleagle.engine.contract.protocol import AddRequest, Outputs, Shutdown, decode_engine_msg, encode
from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.service.process import EngineLoop, build_engine


class _Daemon:
    """The daemon's end of the channel, blocking: a listening socket that takes the loop's connection."""

    def __init__(self, path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.sock: socket.socket | None = None
        self.buf = FrameBuffer()
        self.frames: list[bytes] = []

    def accept(self) -> None:
        self.sock, _ = self.listener.accept()
        self.sock.settimeout(20)

    def send(self, data: bytes) -> None:
        assert self.sock is not None
        self.sock.sendall(frame(data))

    def recv(self) -> bytes:
        assert self.sock is not None
        while not self.frames:
            data = self.sock.recv(1 << 16)
            assert data, "the engine loop closed the channel"
            self.frames += self.buf.feed(data)
        return self.frames.pop(0)


def test_the_loop_spins_after_work_then_blocks(tmp_path: Path) -> None:
    engine = build_engine(load_config("tiny-dummy"))
    daemon = _Daemon(tmp_path / "chan.sock")
    chan = EngineChannel(str(tmp_path / "chan.sock"))
    daemon.accept()
    loop = EngineLoop(engine, chan, spin_s=0.2)
    done: list[int] = []
    th = threading.Thread(target=lambda: done.append(loop.run()), daemon=True)
    th.start()
    try:

        def run_one(rid: str) -> None:
            sp = SamplingParams(temperature=0, max_new_tokens=3)
            daemon.send(encode(AddRequest(rid=rid, prompt_ids=[1, 2, 3], params=sp)))
            got = 0
            while True:
                msg = decode_engine_msg(daemon.recv())
                if isinstance(msg, Outputs):
                    got += sum(len(t[1]) for t in msg.tokens) + sum(len(o.token_ids) for o in msg.outputs)
                    if any(o.finished for o in msg.outputs):
                        assert got == 3
                        return

        run_one("a")
        s0 = loop.spins
        time.sleep(0.05)  # inside the window: the loop is polling, not sleeping
        assert loop.spins > s0
        run_one("b")  # taken while it spins
        time.sleep(0.5)  # past the window: the loop blocks in its poll and stops counting
        s1 = loop.spins
        time.sleep(0.2)
        assert loop.spins == s1
    finally:
        daemon.send(encode(Shutdown()))
        th.join(30)
        chan.close()
    assert done == [0]


def test_an_arrival_is_stepped_before_the_idle_telemetry(tmp_path: Path) -> None:
    """While the loop spins after a request, the last step's sampled-out state events wait; the next
    arrival goes to the engine's step at once, and the idle telemetry runs only once nothing is left."""
    from mleagle.engine.contract.event_bus import ZmqEventPublisher
    from mleagle.engine.service.process import EventPump

    engine = build_engine(load_config("tiny-dummy"))
    daemon = _Daemon(tmp_path / "chan.sock")
    chan = EngineChannel(str(tmp_path / "chan.sock"))
    daemon.accept()
    pump = EventPump(ZmqEventPublisher(f"ipc://{tmp_path}/events"))
    pump.attach(engine)  # sampled, as serve starts it: a step left out waits for the idle telemetry
    loop = EngineLoop(engine, chan, pump, spin_s=5.0)
    seen: list[str] = []
    assert loop.telemetry is not None
    idle, step, handle = loop.telemetry.idle, loop.step, loop.handle
    loop.telemetry.idle = lambda: (seen.append("idle"), idle())[1]  # type: ignore[method-assign]
    loop.step = lambda: (seen.append("step"), step())[1]  # type: ignore[method-assign]
    loop.handle = lambda data: (seen.append("message"), handle(data))[1]  # type: ignore[method-assign]
    done: list[int] = []
    th = threading.Thread(target=lambda: done.append(loop.run()), daemon=True)
    th.start()
    try:
        for rid in ("a", "b"):
            sp = SamplingParams(temperature=0, max_new_tokens=3)
            daemon.send(encode(AddRequest(rid=rid, prompt_ids=[1, 2, 3], params=sp)))
            while not any(isinstance(m, Outputs) and any(o.finished for o in m.outputs)
                          for m in [decode_engine_msg(daemon.recv())]):
                pass
            time.sleep(0.05)  # the loop spins: no idle telemetry meanwhile
        arrivals = [i for i, x in enumerate(seen) if x == "message"]
        assert len(arrivals) == 2 and all(seen[i + 1] == "step" for i in arrivals), seen
    finally:
        daemon.send(encode(Shutdown()))
        th.join(30)
        chan.close()
        pump.close()
    assert done == [0]


def test_the_loop_ends_when_the_daemon_closes_the_channel(tmp_path: Path) -> None:
    engine = build_engine(load_config("tiny-dummy"))
    daemon = _Daemon(tmp_path / "chan.sock")
    chan = EngineChannel(str(tmp_path / "chan.sock"))
    daemon.accept()
    loop = EngineLoop(engine, chan)
    done: list[int] = []
    th = threading.Thread(target=lambda: done.append(loop.run()), daemon=True)
    th.start()
    sp = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
    daemon.send(encode(AddRequest(rid="a", prompt_ids=[1, 2, 3], params=sp)))
    assert isinstance(decode_engine_msg(daemon.recv()), Outputs)  # it runs: the request is in flight
    assert daemon.sock is not None
    daemon.sock.close()  # a daemon killed mid-request: the loop sees the end of the stream
    th.join(30)
    chan.close()
    assert done == [0]
