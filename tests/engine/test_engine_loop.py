"""The engine process's loop (`EngineLoop`) in this process, over real ZMQ sockets and a real CPU engine
(tiny-dummy): after its last step it polls without sleeping for its spin window, takes a request that
arrives inside that window, and then blocks again (its spin count stops growing)."""

from __future__ import annotations

import threading
import time

import zmq

from mleagle.engine.contract.config import load_config
from mleagle.engine.contract.protocol import AddRequest, Outputs, Shutdown, decode_engine_msg, encode
from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.service.process import EngineLoop, build_engine


def test_the_loop_spins_after_work_then_blocks() -> None:
    engine = build_engine(load_config("tiny-dummy"))
    ctx = zmq.Context()
    to_engine, from_daemon = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_daemon, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_engine.bind("inproc://req")
    from_daemon.connect("inproc://req")
    from_engine.bind("inproc://out")
    to_daemon.connect("inproc://out")
    loop = EngineLoop(engine, from_daemon, to_daemon, spin_s=0.2)
    done: list[int] = []
    th = threading.Thread(target=lambda: done.append(loop.run()), daemon=True)
    th.start()
    try:

        def run_one(rid: str) -> None:
            sp = SamplingParams(temperature=0, max_new_tokens=3)
            to_engine.send(encode(AddRequest(rid=rid, prompt_ids=[1, 2, 3], params=sp)))
            got = 0
            while True:
                assert from_engine.poll(20_000), "no output from the engine loop"
                msg = decode_engine_msg(from_engine.recv())
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
        to_engine.send(encode(Shutdown()))
        th.join(30)
        ctx.destroy(linger=0)
    assert done == [0]
