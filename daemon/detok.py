"""Streaming text assembly for one choice: token ids in, text deltas out.

`TextAssembler` chains the engine package's `IncrementalDetokenizer` (never emits half a multi-byte
UTF-8 character; a few prompt tokens of left context keep leading spaces right) and `StopMatcher`
(holds back any tail that could still begin a stop string, cuts at the first stop string, so a stop
string split across tokens never leaks). The engine stops generation at the token that completed the
stop string; the daemon only shapes the text. Streamed and non-streamed requests both run this class
over the same deltas, so the streamed pieces concatenate to exactly the non-streamed text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mleagle.engine.contract.detokenizer import IncrementalDetokenizer, StopMatcher


class TextAssembler:
    def __init__(self, tok: Any, prompt_ids: Sequence[int], stops: Sequence[str], skip_special_tokens: bool = True) -> None:
        self.detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens)
        self.stop = StopMatcher(stops)
        self.parts: list[str] = []

    @property
    def stopped(self) -> bool:
        return self.stop.matched is not None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def _out(self, s: str) -> str:
        if s:
            self.parts.append(s)
        return s

    def push(self, ids: Sequence[int]) -> str:
        """New token ids in; the text that became final out."""
        if self.stopped:
            return ""
        out, _ = self.stop.push(self.detok.push(ids))
        return self._out(out)

    def finish(self) -> str:
        """The request ended: emit what was held back (a dangling broken character as U+FFFD)."""
        if self.stopped:
            return ""
        out, matched = self.stop.push(self.detok.flush())
        if matched is None:
            out += self.stop.flush()
        return self._out(out)
