"""Record a real session of state events for the TUI tests: `tests/data/events_real.jsonl`.

Starts `mleagle serve` (SmolLM2-135M on the CPU with its shipped 3-layer draft), subscribes to `/v1/events`
with the TUI's own `LiveSource`, sends a handful of chat requests (a few at a time, with logprobs and
top alternatives), waits until every pool is free again, and writes what the source received as a
recording (the same format as `mleagle-tui --record`). Run from the repository root:
`.venv/bin/python scripts/record_events_real.py [OUT]`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

from mleagle.engine.contract.events import Event, RecordingWriter
from mleagle.tui.model import Dashboard
from mleagle.tui.source import LiveSource, Status

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.daemon_helpers import ServerProc

DRAFT = "drafts/smollm2-135m-mtp3"  # the trained draft: the acceptance panel shows real acceptance
PROMPTS = ["Name three colors.", "What is 2+2?", "Write a haiku about the sea.", "Say hello in French.",
           "List two planets.", "What is the capital of Italy?"]


class Rec:
    def __init__(self, path: Path, url: str) -> None:
        self.w = RecordingWriter(path, source=url, meta={"model": "smollm2-135m", "draft": DRAFT,
                                                        "device": "cpu", "script": "scripts/record_events_real.py"})
        self.m = Dashboard()

    def sink_raw(self, text: str) -> None:
        e = self.m.apply_raw(text)
        if e is not None:
            self.w.write(e)

    def sink_event(self, e: Event) -> None:
        self.m.apply(e)
        self.w.write(e)

    def sink_status(self, s: Status) -> None:
        pass


async def chat(s: aiohttp.ClientSession, url: str, q: str, i: int) -> None:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": q}], "max_tokens": 12 + 4 * (i % 3),
            "temperature": 0, "logprobs": True, "top_logprobs": 3}
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        await r.json()


async def until(task: asyncio.Task[None], cond: Callable[[], bool], timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if task.done():
            task.result()  # the source died: raise its error
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.05)


async def main(out: Path) -> None:
    # --events-include-text: the recording shows each request's tokens and logprobs in the drill-down
    srv = ServerProc("--config", "smollm2-135m", "--draft", DRAFT, "--max-total-tokens", "4096",
                     "--max-running-requests", "4", "--events-include-text")
    try:
        srv.wait_healthy(120)
        async with aiohttp.ClientSession() as s:
            # warm the relay's subscription first (events published before it joined are lost)
            await chat(s, srv.url, "Hi", 0)
            await asyncio.sleep(1.0)
            rec = Rec(out, srv.url)
            task = asyncio.create_task(LiveSource(srv.url).run(rec))
            await until(task, lambda: rec.m.events > 0)
            await asyncio.sleep(1.2)  # one engine status tick while idle
            t0 = time.monotonic()
            for k in range(0, len(PROMPTS), 3):
                await asyncio.gather(*(chat(s, srv.url, q, k + i) for i, q in enumerate(PROMPTS[k:k + 3])))
            await until(task, lambda: bool(rec.m.tracker.pools) and all(
                p.kv_used == 0 and p.req_used == 0 for p in rec.m.tracker.pools.values()))
            await asyncio.sleep(1.2)  # a final status tick with everything idle
            task.cancel()
            rec.w.close()
            print(f"recorded {rec.w.count} events in {time.monotonic() - t0:.1f}s to {out} "
                  f"({out.stat().st_size / 1024:.0f} KiB): {dict(rec.m.by_type)}")
    finally:
        srv.terminate()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/data/events_real.jsonl")))
