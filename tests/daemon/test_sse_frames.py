"""The per-token SSE frame built from bytes fixed once per stream (`_Format.content_frame`) carries the
same JSON as the chunk built as a dict, for every kind of text and both endpoints."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from mleagle.daemon.openai_api import ChatRequest, CompletionRequest
from mleagle.daemon.server import SSE, _chat_format, _completion_format

TEXTS = ["", " hello", 'quote " and \\ backslash', "line\nbreak\ttab", "\x00\x1f control", "é ü 中文 🙂",
         "\u2028\u2029 separators", "\x00mleagle-text\x00"]


def _fmt(kind: str, stream_options: dict[str, Any] | None) -> Any:
    srv = SimpleNamespace(model="smollm2-135m")
    gen = SimpleNamespace(id="chatcmpl-0123abcd", choices=[], prompt_tokens=3, completion_tokens=0, cached_tokens=0)
    if kind == "chat":
        req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                          "stream_options": stream_options})
        return _chat_format(srv, gen, req)  # type: ignore[arg-type]
    req = CompletionRequest.model_validate({"prompt": "hi", "stream": True, "stream_options": stream_options})
    return _completion_format(srv, gen, req)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("opts", [None, {"include_usage": True}], ids=["plain", "usage-at-end"])
def test_the_fixed_frame_equals_the_dict_frame(kind: str, opts: dict[str, Any] | None) -> None:
    f = _fmt(kind, opts)
    key = "content" if kind == "chat" else "text"
    for index in (0, 1):
        for text in TEXTS:
            choice: dict[str, Any] = {"index": index, **({"delta": {"content": text}} if kind == "chat" else {"text": text}),
                      "logprobs": None, "finish_reason": None}
            want = SSE.frame(f.chunk(choice))
            got = f.content_frame(index, key, text)
            assert got.startswith(b"data: ") and got.endswith(b"\n\n")
            assert json.loads(got[6:-2]) == json.loads(want[6:-2])
            assert list(json.loads(got[6:-2])) == list(json.loads(want[6:-2]))  # same key order too


@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("opts", [None, {"include_usage": True}], ids=["plain", "usage-at-end"])
def test_a_running_deltas_text_frame_is_its_chunks(kind: str, opts: dict[str, Any] | None) -> None:
    """What the engine client's callback writes for a running delta (`text_frame`) is what the route's
    task would (`chunks`), once the stream is under way (chat's role chunk went first)."""
    from mleagle.daemon.generation import Delta

    f = _fmt(kind, opts)
    c = SimpleNamespace(index=0)
    if kind == "chat":
        assert f.chunks(Delta(c, "", [], [], False))  # the role chunk
    for text in TEXTS:
        d = Delta(c, text, [1], [], False)  # type: ignore[arg-type]
        assert b"".join(f.chunks(d)) == f.text_frame(d)  # type: ignore[arg-type]
