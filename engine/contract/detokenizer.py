"""Incremental detokenization and stop strings for streaming (torch-free).

`IncrementalDetokenizer` turns a growing list of output token ids into newly *stable* text: it
decodes a small window (the last few tokens already emitted plus the new ones) and emits only the
text past the window's stable prefix, holding back text that ends in U+FFFD (a byte-level BPE token
that ends mid-character) until the character completes. Each push costs O(new tokens + a few).
Decoding with a few tokens of left context also keeps the leading space of a token that decoders
such as sentencepiece's strip at the start of a decode. For byte-level BPE the concatenation of all
pushes and `flush()` equals `tokenizer.decode(output_ids)`.

`StopMatcher` runs over that text stream: it finds the first occurrence of any stop string (also
one spanning pushes), never emits any part of a stop string (it holds back a tail that could still
become one), and reports the cut. `StopChecker` combines both per request for the scheduler: fed
the tokens a step produced (several with speculative decoding), it says how many output tokens to
keep so the cut lands on the token that completed the stop string; `find_stop_cut` is the one-shot
form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

_FFFD = "\ufffd"
_CONTEXT = 5  # prompt tokens of left context (what vLLM uses)


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Streams output tokens to text; `push` returns only newly stable text, `flush` the rest."""

    def __init__(self, tokenizer: _Decoder, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        ctx = list(prompt_ids[-_CONTEXT:]) if prompt_ids else []
        self.ids: list[int] = ctx  # left context + output ids (context tokens are never emitted)
        self.n_ctx = len(ctx)
        # ids[prefix:read] decode to text already emitted; ids[read:] are pending
        self.prefix = 0
        self.read = len(ctx)
        self._prefix_text = self._decode(0, self.read)
        self.text = ""  # everything emitted so far

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self.n_ctx :]

    def _decode(self, a: int, b: int) -> str:
        return self.tokenizer.decode(self.ids[a:b], skip_special_tokens=self.skip) if b > a else ""

    def _step(self, final: bool) -> str:
        full = self._decode(self.prefix, len(self.ids))
        if not final and (full.endswith(_FFFD) or len(full) <= len(self._prefix_text)):
            return ""  # incomplete character (or nothing new yet): hold until more tokens come
        # (if a decoder ever rewrote the window's earlier text, emitted text is not taken back)
        new = full[len(self._prefix_text) :]
        self.prefix, self.read = self.read, len(self.ids)
        self._prefix_text = self._decode(self.prefix, self.read)
        self.text += new
        return new

    def push(self, new_ids: Sequence[int]) -> str:
        if not new_ids:
            return ""
        self.ids.extend(new_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """At the end of the stream: emit what was held back (a trailing broken character as U+FFFD)."""
        if self.read == len(self.ids):
            return ""
        return self._step(final=True)


class StopMatcher:
    """Finds the first stop string in a text stream and holds back any tail that may start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.pending = ""  # text received but not yet emitted (may be the start of a stop string)
        self.emitted = 0  # characters emitted so far
        self.matched: str | None = None
        self.cut: int | None = None  # position in the full stream where the matched stop begins

    def push(self, text: str) -> tuple[str, str | None]:
        """Feed text; returns (text safe to emit, matched stop or None). After a match, ignores input."""
        if self.matched is not None:
            return "", self.matched
        if not self.stops:
            self.emitted += len(text)
            return text, None
        buf = self.pending + text
        # Earliest match wins; among stops starting at the same place, the one that ends first.
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i, i + len(s)) < best[:2]):
                best = (i, i + len(s), s)
        if best is not None:
            out = buf[: best[0]]
            self.matched, self.cut = best[2], self.emitted + best[0]
            self.emitted += len(out)
            self.pending = ""
            return out, self.matched
        hold = self._held_tail(buf)
        out = buf[: len(buf) - hold]
        self.pending = buf[len(buf) - hold :]
        self.emitted += len(out)
        return out, None

    def _held_tail(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for n in range(min(len(buf), self.max_len - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        """End of stream without a match: the held tail is plain text after all."""
        out, self.pending = self.pending, ""
        self.emitted += len(out)
        return out if self.matched is None else ""


@dataclass
class StopCut:
    keep: int  # output tokens to keep: up to and including the token that completed the stop
    text: str  # output text before the stop string
    matched: str


class StopChecker:
    """Per-request stop-string state for the scheduler: feed each step's new output tokens."""

    def __init__(
        self,
        tokenizer: _Decoder,
        stops: Sequence[str],
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = False,
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.matcher = StopMatcher(stops)
        self.n = 0  # output tokens seen
        self.text = ""  # emitted (stop-free) text so far
        self.result: StopCut | None = None

    def update(self, new_ids: Sequence[int]) -> StopCut | None:
        """Returns the cut once a stop string completes (and from then on); None while none has."""
        if self.result is not None:
            return self.result
        if not self.matcher.stops:
            self.n += len(new_ids)
            return None
        for t in new_ids:  # one token at a time, so the completing token is known exactly
            self.n += 1
            out, matched = self.matcher.push(self.detok.push([t]))
            self.text += out
            if matched is not None:
                self.result = StopCut(self.n, self.text, matched)
                return self.result
        return None


def find_stop_cut(
    tokenizer: _Decoder,
    output_ids: Sequence[int],
    stops: Sequence[str],
    prompt_ids: Sequence[int] = (),
    skip_special_tokens: bool = False,
) -> tuple[int, str, str] | None:
    """One-shot: (num_tokens_to_keep, text_before_stop, matched stop) or None. O(len(output_ids));
    per-step callers should hold a `StopChecker` instead."""
    r = StopChecker(tokenizer, stops, prompt_ids, skip_special_tokens).update(output_ids)
    return None if r is None else (r.keep, r.text, r.matched)
