"""Read a plain zmq socket from the asyncio event loop, a callback per wake-up instead of a Future per message.

The engine publishes its state events on a zmq PUB socket (its outputs travel on the engine channel,
`engine/contract/channel.py`): a message per step or more, hundreds of steps a second. `zmq.asyncio` pays for each `recv` with a Future, an event
registration and a poller pass, and a relay waiting with `poll(timeout)` adds a timer per step as well:
on the dev VM that machinery cost the daemon about as much per step as streaming the step's tokens. A
`ZmqReader` registers the socket's notification fd with `loop.add_reader` and, on each wake-up, takes
everything waiting with NOBLOCK receives (up to `max_batch`, then it reschedules itself so a flood still
yields to the HTTP handlers) and hands the batch to one callback. A zmq socket's fd signals a change of
state, not readability: it must be drained until `Again` after every wake-up, which is what `_drain`
does, and a start schedules one drain for messages that arrived before the fd was registered. An
exception in the callback is logged and does not stop the reader.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("mleagle.daemon.zmq")


class ZmqReader:
    def __init__(self, sock: zmq.Socket, on_batch: Callable[[list[Any]], None], *, multipart: bool = False,
                 max_batch: int = 1024) -> None:
        self.sock = sock
        self.on_batch = on_batch
        self.multipart = multipart
        self.max_batch = max_batch
        self.fd: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.received = 0

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        fd = self.sock.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        self.fd = fd
        self.loop.add_reader(fd, self._drain)
        self.loop.call_soon(self._drain)

    def close(self) -> None:
        """Unregister the fd; call before the socket is closed (a closed fd must not stay in the poller)."""
        if self.loop is not None and self.fd is not None:
            self.loop.remove_reader(self.fd)
        self.fd = None

    def _drain(self) -> None:
        if self.fd is None:
            return
        recv = self.sock.recv_multipart if self.multipart else self.sock.recv
        batch: list[Any] = []
        more = True
        try:
            while len(batch) < self.max_batch:
                batch.append(recv(zmq.NOBLOCK))
        except zmq.Again:
            more = False
        except zmq.ZMQError as e:  # the socket was closed under us: stop reading it
            log.debug("zmq reader stopped: %s", e)
            self.close()
            more = False
        if batch:
            self.received += len(batch)
            try:
                self.on_batch(batch)
            except Exception:
                log.exception("zmq reader callback failed")
        if more and self.loop is not None:
            self.loop.call_soon(self._drain)  # more may be waiting, and the fd will not signal it again
