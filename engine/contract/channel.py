"""The daemon-engine channel: length-prefixed frames over one Unix stream socket, both directions.

Requests (`AddRequest`, `AbortRequest`, `Ping`, `Shutdown`) go from the daemon to the engine and the
engine's messages (`Ready`, one `Outputs` per step, `Pong`, errors) come back on the same connection.
It replaced a zmq PUSH/PULL pair: zmq moves every message through an I/O thread on each side, and both
must wake, where a Unix socket wakes its reader directly (`scripts/ipc_round_trip.py`: a 220-269 µs
round trip against 50-110 µs on a 2-core VM). The state events stay on zmq PUB/SUB, which may drop.

A frame is a 4-byte little-endian length and the payload (`protocol.encode`'s bytes), so a message of
any size (a long prompt's `AddRequest`) crosses whole. The daemon listens on a path inside its 0700 run
dir (`DaemonChannel`) and takes one connection: the engine process it spawned, its pid checked against
the peer's credentials where the kernel gives them (SO_PEERCRED); any other is closed at once. The
engine connects only after reading its configuration, which the daemon writes after it knows the pid.
End of file is the other side gone: the engine exits, the daemon fails the engine's requests.

The engine side (`EngineChannel`) is a blocking socket the engine loop polls between steps; its sends
block at most `send_timeout_s` (a daemon that stops reading for that long is gone). The daemon side is
an asyncio protocol: reads hand every whole frame of one wake-up to one callback, writes never block
the event loop (asyncio buffers them; `DaemonChannel.send` refuses once `max_buffer` bytes wait unread,
an engine that stopped reading, which the daemon's watchdog then kills).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import select
import socket
import struct
import time
from collections.abc import Callable

log = logging.getLogger("mleagle.channel")
HEADER = struct.Struct("<I")
MAX_FRAME = 1 << 30  # a longer length is a corrupt stream, not a message
READ_SIZE = 1 << 18


def frame(data: bytes) -> bytes:
    return HEADER.pack(len(data)) + data


class FrameBuffer:
    """Bytes in, whole frames out, in order; a partial frame waits for the rest."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        # Parsed where the bytes lie: a read holding whole frames (the common case) is never copied
        # into the buffer; only a partial frame left at its end is kept.
        src: bytes | bytearray = data
        if self.buf:
            self.buf += data
            src = self.buf
        out: list[bytes] = []
        pos, end = 0, len(src)
        with memoryview(src) as mv:  # released before the buffer changes size
            while end - pos >= 4:
                (size,) = HEADER.unpack_from(mv, pos)
                if size > MAX_FRAME:
                    raise ValueError(f"frame of {size} bytes: the stream is corrupt")
                if end - pos - 4 < size:
                    break
                out.append(bytes(mv[pos + 4 : pos + 4 + size]))
                pos += 4 + size
        if src is self.buf:
            del self.buf[:pos]
        elif pos < end:
            self.buf = bytearray(data[pos:])
        return out


class EngineChannel:
    """The engine's end: connect to the daemon's path, send frames, poll for and take whole frames."""

    def __init__(self, path: str, send_timeout_s: float = 60.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        # With a timeout Python keeps the socket non-blocking underneath: `sendall` waits for room at
        # most this long (then raises TimeoutError), and a `recv` after a readable poll never waits.
        self.sock.settimeout(send_timeout_s)
        self.frames: collections.deque[bytes] = collections.deque()
        self.buf = FrameBuffer()
        self.poller = select.poll()
        self.poller.register(self.sock.fileno(), select.POLLIN)
        self.eof = False

    def send(self, data: bytes) -> None:
        self.sock.sendall(frame(data))

    def poll(self, timeout_ms: int) -> bool:
        """A frame (or the end of the stream) is waiting, waiting up to `timeout_ms` for one."""
        end = time.monotonic() + timeout_ms / 1e3
        while not (self.frames or self.eof):
            # A read may bring part of a frame only: wait on for the rest, within the timeout.
            if not self.poller.poll(max(0, round((end - time.monotonic()) * 1e3))):
                return False
            self._read()
        return True

    def _read(self) -> None:
        try:
            data = self.sock.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset by a daemon that died
            self.eof = True
            return
        if not data:
            self.eof = True
            return
        self.frames.extend(self.buf.feed(data))

    def recv(self) -> bytes | None:
        """The next frame, or None at the end of the stream (the daemon is gone)."""
        return self.frames.popleft() if self.frames else None

    def close(self) -> None:
        self.sock.close()


class _Protocol(asyncio.Protocol):
    def __init__(self, chan: DaemonChannel) -> None:
        self.chan = chan
        self.buf = FrameBuffer()
        self.transport: asyncio.Transport | None = None
        self.accepted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        t: asyncio.Transport = transport  # type: ignore[assignment]  # asyncio's or uvloop's stream transport
        self.transport = t
        why = self.chan._admit(self, t)
        if why is not None:
            log.error("closed a connection to the engine channel: %s", why)
            t.abort()
            return
        self.accepted = True

    def data_received(self, data: bytes) -> None:
        if not self.accepted:
            return
        try:
            frames = self.buf.feed(data)
        except ValueError as e:
            log.error("engine channel: %s; closing it", e)
            assert self.transport is not None
            self.transport.abort()
            return
        if frames:
            self.chan.on_batch(frames)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.accepted:
            self.chan._lost(exc)


def peer_pid(transport: asyncio.BaseTransport) -> int | None:
    """The connecting process's pid, where the kernel says (Linux SO_PEERCRED); None elsewhere."""
    sock = transport.get_extra_info("socket")
    opt = getattr(socket, "SO_PEERCRED", None)
    if sock is None or opt is None:
        return None
    # A duplicate of the fd: uvloop hands out a pseudo-socket that need not implement getsockopt.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(sock.fileno())) as s:
        pid, _, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i")))
    return int(pid)


class DaemonChannel:
    """The daemon's end: listen on `path`, accept the one engine process, read frames into `on_batch`."""

    def __init__(self, path: str, on_batch: Callable[[list[bytes]], None], on_lost: Callable[[str], None],
                 max_buffer: int = 256 << 20) -> None:
        self.path = path
        self.on_batch = on_batch
        self.on_lost = on_lost
        self.max_buffer = max_buffer
        self.expected_pid: int | None = None  # set once the engine is spawned, before it can connect
        self.server: asyncio.AbstractServer | None = None
        self.proto: _Protocol | None = None
        self.closed = False

    async def listen(self) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_unix_server(lambda: _Protocol(self), self.path)
        os.chmod(self.path, 0o600)

    def _admit(self, proto: _Protocol, transport: asyncio.BaseTransport) -> str | None:
        if self.closed:
            return "the channel is closed"
        if self.proto is not None:
            return "the engine is already connected"
        if self.expected_pid is None:
            return "no engine process is expected yet"
        pid = peer_pid(transport)
        if pid is not None and pid != self.expected_pid:
            return f"peer pid {pid} is not the engine's ({self.expected_pid})"
        self.proto = proto
        return None

    def _lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.on_lost(f"the engine closed its channel{f' ({exc})' if exc else ''}")

    @property
    def connected(self) -> bool:
        return self.proto is not None and self.proto.transport is not None and not self.proto.transport.is_closing()

    def send(self, data: bytes) -> None:
        """Queue one frame for the engine; raises ConnectionError when it cannot go."""
        if not self.connected:
            raise ConnectionError("the engine is not connected")
        assert self.proto is not None and self.proto.transport is not None
        t = self.proto.transport
        if t.get_write_buffer_size() > self.max_buffer:
            raise ConnectionError(f"the engine has not read {t.get_write_buffer_size()} bytes sent to it")
        t.write(frame(data))

    def close(self) -> None:
        self.closed = True
        if self.proto is not None and self.proto.transport is not None:
            self.proto.transport.abort()
        if self.server is not None:
            self.server.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
