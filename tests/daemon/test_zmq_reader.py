"""`ZmqReader` over a real ZMQ PUSH/PULL pair: every message reaches the callback once and in order, and
`max_batch` bounds what one callback takes: at 1, whatever else the loop has to run (an HTTP arrival's
handler) runs between two messages; at the default, after the whole backlog. (The daemon drains its
engine's outputs whole: one step per callback measured no better on the H200, run 8 of
`results/gpu/ttft_split/`.)"""

from __future__ import annotations

import asyncio

import zmq

from mleagle.daemon.zmq_reader import ZmqReader


async def _run(max_batch: int) -> tuple[list[bytes], int]:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://reader")
    push.connect("inproc://reader")
    msgs = [b"step-%d" % i for i in range(50)]
    for m in msgs:
        push.send(m)
    loop = asyncio.get_running_loop()
    got: list[bytes] = []
    seen_at_mark: list[int] = []

    def on_batch(batch: list[bytes]) -> None:
        if not got:  # while the first message is handled, something else becomes ready to run
            loop.call_soon(lambda: seen_at_mark.append(len(got)))
        got.extend(batch)

    reader = ZmqReader(pull, on_batch, max_batch=max_batch)
    reader.start()
    try:
        for _ in range(500):
            if len(got) == len(msgs):
                break
            await asyncio.sleep(0.002)
    finally:
        reader.close()
        ctx.destroy(linger=0)
    assert got == msgs
    return got, seen_at_mark[0]


async def test_one_message_per_callback_lets_the_loop_run_between_messages() -> None:
    _, at_mark = await _run(1)
    assert at_mark <= 2  # the other callback ran before the backlog was worked through
    _, at_mark = await _run(1024)
    assert at_mark == 50  # a whole backlog in one callback: it waited for all of it
