"""The engine channel (`engine/contract/channel.py`) over real Unix sockets: frames of any size cross
whole and in order in both directions however the bytes are split, a corrupt length closes the
stream, the daemon's end admits only the expected process and only once, and either end sees the other
go as the end of the stream."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from pathlib import Path

import pytest

from mleagle.engine.contract.channel import (
    HEADER,
    MAX_FRAME,
    DaemonChannel,
    EngineChannel,
    FrameBuffer,
    frame,
)


def test_frames_cross_whole_however_the_bytes_are_split() -> None:
    msgs = [b"", b"a", os.urandom(1000), os.urandom(300_000), b"end"]
    stream = b"".join(frame(m) for m in msgs)
    for cut in (1, 3, 4, 5, 7, 4096, len(stream)):
        buf, got = FrameBuffer(), []
        for i in range(0, len(stream), cut):
            got += buf.feed(stream[i : i + cut])
        assert got == msgs, cut
        assert not buf.buf


def test_a_corrupt_length_is_refused() -> None:
    with pytest.raises(ValueError, match="corrupt"):
        FrameBuffer().feed(HEADER.pack(MAX_FRAME + 1) + b"x")


async def _with_daemon(tmp_path: Path, expected_pid: int | None) -> tuple[DaemonChannel, list[bytes], list[str]]:
    got: list[bytes] = []
    lost: list[str] = []
    chan = DaemonChannel(str(tmp_path / "g1.sock"), got.extend, lost.append)
    await chan.listen()
    chan.expected_pid = expected_pid
    return chan, got, lost


async def _until(cond: object, timeout: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.01)


async def test_both_directions_in_order_and_the_end_of_the_stream(tmp_path: Path) -> None:
    chan, got, lost = await _with_daemon(tmp_path, os.getpid())
    assert oct(os.stat(chan.path).st_mode & 0o777) == "0o600"
    eng = await asyncio.to_thread(EngineChannel, chan.path)
    await _until(lambda: chan.connected)
    big = os.urandom(2_000_000)  # larger than any socket buffer: the daemon's write is buffered, not blocked
    for m in (b"one", big, b"three"):
        chan.send(m)

    def engine_side() -> list[bytes]:
        out = []
        while len(out) < 3:
            assert eng.poll(10_000)
            data = eng.recv()
            assert data is not None
            out.append(data)
        for i in range(200):
            eng.send(str(i).encode())
        return out

    assert await asyncio.to_thread(engine_side) == [b"one", big, b"three"]
    await _until(lambda: len(got) == 200)
    assert got == [str(i).encode() for i in range(200)]
    eng.close()  # the engine exits: the daemon is told once
    await _until(lambda: lost)
    assert lost == ["the engine closed its channel"]
    chan.close()
    assert not os.path.exists(chan.path)


async def test_the_engine_sees_the_daemon_go(tmp_path: Path) -> None:
    chan, _, lost = await _with_daemon(tmp_path, os.getpid())
    eng = await asyncio.to_thread(EngineChannel, chan.path)
    await _until(lambda: chan.connected)
    chan.close()  # the daemon's own close is no loss to report
    assert await asyncio.to_thread(eng.poll, 10_000)
    assert eng.recv() is None and eng.eof
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        for _ in range(100):  # the first send may still land in the buffer of a closing socket
            eng.send(b"x" * 65536)
    assert lost == []
    eng.close()


@pytest.mark.skipif(not hasattr(socket, "SO_PEERCRED"), reason="peer credentials are Linux's")
async def test_only_the_spawned_process_is_admitted_and_only_once(tmp_path: Path) -> None:
    chan, got, lost = await _with_daemon(tmp_path, os.getpid() + 1_000_000)  # not us
    stranger = await asyncio.to_thread(EngineChannel, chan.path)
    assert await asyncio.to_thread(stranger.poll, 10_000)
    assert stranger.recv() is None  # closed at once, before a byte was read
    assert not chan.connected
    stranger.close()
    chan.close()

    chan, got, lost = await _with_daemon(tmp_path, os.getpid())
    first = await asyncio.to_thread(EngineChannel, chan.path)
    await _until(lambda: chan.connected)
    second = await asyncio.to_thread(EngineChannel, chan.path)
    assert await asyncio.to_thread(second.poll, 10_000)
    assert second.recv() is None  # the engine is already connected: a second connection is refused
    first.send(b"still here")
    await _until(lambda: got)
    assert got == [b"still here"] and lost == []
    for c in (first, second):
        c.close()
    chan.close()


async def test_no_connection_is_admitted_before_the_engine_is_spawned(tmp_path: Path) -> None:
    chan, _, _ = await _with_daemon(tmp_path, None)
    early = await asyncio.to_thread(EngineChannel, chan.path)
    assert await asyncio.to_thread(early.poll, 10_000)
    assert early.recv() is None
    early.close()
    chan.close()


def test_a_daemon_that_stops_reading_times_the_engine_out(tmp_path: Path) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s.sock"))
    listener.listen(1)
    eng = EngineChannel(str(tmp_path / "s.sock"), send_timeout_s=0.3)
    conn, _ = listener.accept()  # accepted, never read
    err: list[BaseException] = []

    def flood() -> None:
        try:
            for _ in range(10_000):
                eng.send(b"x" * 65536)
        except BaseException as e:
            err.append(e)

    th = threading.Thread(target=flood)
    th.start()
    th.join(30)
    assert err and isinstance(err[0], TimeoutError)
    for s in (eng, conn, listener):
        s.close()
