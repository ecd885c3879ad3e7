"""Incremental detokenization and stop strings on the real SmolLM2 tokenizer: one token at a time
(and in speculative-decoding sized chunks) over text whose multi-byte characters are split across
tokens, never a U+FFFD, the pieces concatenate to the full decode, stop strings are caught across
tokens without leaking, and the token cut lands on the token that completed the stop."""

from __future__ import annotations

import random

import pytest

from mleagle.engine.contract.config import smollm2_gguf_path
from mleagle.engine.contract.detokenizer import (
    IncrementalDetokenizer,
    StopChecker,
    StopMatcher,
    find_stop_cut,
)
from mleagle.engine.contract.tokenizer import Tokenizer

TEXTS = [
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 heart ❤️ done",
    "日本語のテキストと中文文本，还有한국어 텍스트. 𝄞 𠜎𠜱",
    "Café naïve Ångström — “quotes” … end",
    "def f(x):\n\treturn x ** 2  # ok\n",
    "<|im_start|>assistant\nHi 🌍!<|im_end|>",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf_path())


def test_texts_split_characters(tok: Tokenizer) -> None:
    """The test texts really contain tokens that end mid-character (else the tests prove nothing)."""
    ids = tok.encode(TEXTS[0] + TEXTS[1])
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [False, True])
def test_stream_one_token_at_a_time(tok: Tokenizer, text: str, skip: bool) -> None:
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, tok.encode("Say something:"), skip_special_tokens=skip)
    pieces = [d.push([i]) for i in ids]
    pieces.append(d.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip) == d.text
    assert d.output_ids == ids
    assert sum(1 for p in pieces if p) > len(ids) // 3  # it streams, not one blob at the end


def test_stream_random_chunks(tok: Tokenizer) -> None:
    rng = random.Random(0)
    ids = tok.encode(" ".join(TEXTS))
    for _ in range(20):
        d = IncrementalDetokenizer(tok, [])
        out, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 5)
            out.append(d.push(ids[i : i + n]))
            i += n
        out.append(d.flush())
        assert all("\ufffd" not in p for p in out)
        assert "".join(out) == tok.decode(ids)


def test_flush_emits_broken_tail(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")
    partial = next(k for k in range(len(ids), 0, -1) if tok.decode(ids[:k]).endswith("\ufffd"))
    d = IncrementalDetokenizer(tok, [])
    text = "".join(d.push([i]) for i in ids[:partial])
    assert "\ufffd" not in text
    assert text + d.flush() == tok.decode(ids[:partial])  # the stream ended mid-character: say so
    assert d.flush() == ""


def test_push_empty(tok: Tokenizer) -> None:
    d = IncrementalDetokenizer(tok, [1, 2, 3])
    assert d.push([]) == "" and d.flush() == ""


# ---- StopMatcher --------------------------------------------------------------------------------

def _feed(m: StopMatcher, chunks: list[str]) -> tuple[str, str | None]:
    out = []
    for c in chunks:
        o, matched = m.push(c)
        out.append(o)
        if matched:
            return "".join(out), matched
    return "".join(out) + m.flush(), None


def test_stop_spanning_pushes_never_leaks() -> None:
    m = StopMatcher(["STOP", "\n\n"])
    outs = [m.push(c) for c in ["Hello S", "TO", "X and ST", "O", "P tail"]]
    assert outs == [("Hello ", None), ("", None), ("STOX and ", None), ("", None), ("", "STOP")]
    assert m.matched == "STOP" and m.cut == len("Hello STOX and ")


def test_stop_holdback_and_release() -> None:
    m = StopMatcher(["</answer>"])
    assert m.push("result </ans") == ("result ", None)  # the tail could still become the stop
    assert m.push("wer is no tag") == ("</answer is no tag", None)
    assert m.push("x </") == ("x ", None)
    assert m.flush() == "</"  # end of stream: the held tail was plain text


def test_stop_earliest_wins_and_flush() -> None:
    assert _feed(StopMatcher(["cd", "b"]), ["ab", "cd"]) == ("a", "b")
    assert _feed(StopMatcher(["abcd", "bc"]), ["a", "b", "c", "d"]) == ("a", "bc")
    assert _feed(StopMatcher(["xyz"]), ["ab", "xy"]) == ("abxy", None)
    assert _feed(StopMatcher([]), ["ab", "cd"]) == ("abcd", None)
    m = StopMatcher(["x"])
    assert m.push("axb") == ("a", "x") and m.push("more") == ("", "x") and m.flush() == ""


@pytest.mark.parametrize("stops", [["STOP"], ["\n\n"], ["😀"], ["文本"], ["\tret"], ["b>", "STOP"]])
def test_stop_random_chunking(stops: list[str]) -> None:
    text = "ab><c \n x STO\tretur 文 文本 😀 done\n\n STOP end"
    first = min((text.find(s), s) for s in stops if s in text)
    rng = random.Random(1)
    for _ in range(50):
        chunks, i = [], 0
        while i < len(text):
            n = rng.randint(1, 4)
            chunks.append(text[i : i + n])
            i += n
        assert _feed(StopMatcher(stops), chunks) == (text[: first[0]], first[1])


# ---- token cut ---------------------------------------------------------------------------------

def _brute(tok: Tokenizer, ids: list[int], stop: str) -> tuple[int, str, str] | None:
    for k in range(1, len(ids) + 1):
        s = tok.decode(ids[:k])
        if stop in s:
            return k, s[: s.index(stop)], stop
    return None


@pytest.mark.parametrize("stop", ["Paris", "is P", "😀", "\n\n", "文本", "<|im_end|>", "absent", "ris."])
def test_find_stop_cut_exact(tok: Tokenizer, stop: str) -> None:
    ids = tok.encode("The capital of France is Paris. 😀 emoji\n\nthen 中文文本<|im_end|> tail")
    want = _brute(tok, ids, stop)
    assert find_stop_cut(tok, ids, [stop]) == want
    if want is not None:
        assert want[0] >= 1 and stop not in want[1]
    # per-step use with speculative chunks of 1..4 tokens gives the same cut
    for chunk in (1, 2, 3, 4):
        c = StopChecker(tok, [stop])
        got = None
        for i in range(0, len(ids), chunk):
            got = c.update(ids[i : i + chunk])
            if got is not None:
                break
        assert (None if got is None else (got.keep, got.text, got.matched)) == want


def test_stop_checker_text_is_stream_text(tok: Tokenizer) -> None:
    ids = tok.encode("one two 😀 three STOP four")
    c = StopChecker(tok, ["STOP"], prompt_ids=tok.encode("count:"))
    r = None
    for i in ids:
        r = c.update([i])
        if r:
            break
    assert r is not None and r.text == "one two 😀 three " and r.matched == "STOP"
    assert tok.decode(ids[: r.keep]).endswith("STOP")
    assert c.update([5, 6]) is r  # sticky once stopped
    assert StopChecker(tok, []).update(ids) is None
