"""Streaming text assembly for one choice: token ids in, text deltas out.

`TextAssembler` chains the engine package's `IncrementalDetokenizer` (never emits half a multi-byte
UTF-8 character; a few prompt tokens of left context keep leading spaces right) and `StopMatcher`
(holds back any tail that could still begin a stop string, cuts at the first stop string, so a stop
string split across tokens never leaks). The engine stops generation at the token that completed the
stop string; the daemon only shapes the text. Streamed and non-streamed requests both run this class
over the same deltas, so the streamed pieces concatenate to exactly the non-streamed text.

A byte-level BPE tokenizer (a `decoders.ByteLevel` decoder: SmolLM2, Llama 3, Qwen2) gets `ByteLevelText`
instead of the `IncrementalDetokenizer`: there a token is a fixed byte string and the text is the UTF-8
of the bytes joined, so a token whose bytes are whole characters is one memoized piece, and only a run
that splits a character is decoded (held until it ends on a whole one). The same text, never half a
character, and per token a dict lookup instead of two decodes of a window (0.65 against 3 us a token:
the daemon's loop pays this per token of every stream); it differs only in sending a push's whole
characters before a later token of the same push that splits one, where the other holds the push.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from tokenizers import decoders

from mleagle.engine.contract.detokenizer import IncrementalDetokenizer, StopMatcher

# Per tokenizer and skip_special_tokens: token id -> its text, or None where its bytes split a character.
_PIECES: weakref.WeakKeyDictionary[Any, tuple[dict[int, str | None], dict[int, str | None]]] = \
    weakref.WeakKeyDictionary()


def byte_level(tok: Any) -> bool:
    return isinstance(getattr(getattr(tok, "tok", None), "decoder", None), decoders.ByteLevel)


class ByteLevelText:
    """`IncrementalDetokenizer`'s `push`/`flush` for a byte-level tokenizer (see the module docstring)."""

    def __init__(self, tok: Any, skip_special_tokens: bool) -> None:
        self.tok, self.skip = tok, skip_special_tokens
        self.pieces = _PIECES.setdefault(tok, ({}, {}))[skip_special_tokens]
        self.held: list[int] = []  # tokens whose bytes do not end on a whole character yet

    def _piece(self, i: int) -> str | None:
        try:
            return self.pieces[i]
        except KeyError:
            p = self.tok.decode([i], skip_special_tokens=self.skip)
            p = self.pieces[i] = None if "\ufffd" in p else p
            return p

    def push(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            p = None if self.held else self._piece(i)
            if p is not None:
                out.append(p)
                continue
            self.held.append(i)
            s = self.tok.decode(self.held, skip_special_tokens=self.skip)
            if not s.endswith("\ufffd"):  # as IncrementalDetokenizer: whole up to its last character
                out.append(s)
                self.held = []
        return "".join(out)

    def flush(self) -> str:
        """At the end of the stream: what was held (a trailing broken character as U+FFFD)."""
        s = self.tok.decode(self.held, skip_special_tokens=self.skip) if self.held else ""
        self.held = []
        return s


class TextAssembler:
    def __init__(self, tok: Any, prompt_ids: Sequence[int], stops: Sequence[str], skip_special_tokens: bool = True) -> None:
        self.detok: ByteLevelText | IncrementalDetokenizer = ByteLevelText(tok, skip_special_tokens) if byte_level(tok) \
            else IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens)
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
