"""Compiling constraints with xgrammar for one tokenizer, behind an LRU cache.

A `GrammarCache` holds the tokenizer's xgrammar `TokenizerInfo` (built once from the vocabulary in its
encoded form, byte-level or byte-fallback detected from the `tokenizers` JSON as xgrammar's own HF path
does, padded to the model's logit width) and compiles `StructuredOutputs` into `CompiledGrammar`s. The
cache is ours, not xgrammar's (whose cache is unbounded by default): the last `capacity` distinct
constraints stay compiled, keyed by (kind, text), so a schema sent with every request compiles once.
A constraint xgrammar cannot compile raises `ConstraintError` with the field at fault and xgrammar's
message without its source location. JSON schemas compile with `any_whitespace=False`: the output
is formatted as `json.dumps` does (", " and ": " separators, one line), which keeps small models from
spending their token budget on whitespace, a known failure mode of free-whitespace JSON grammars.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from mleagle.engine.contract.sampling_params import StructuredOutputs


class ConstraintError(ValueError):
    """A constraint that cannot be compiled; `field` names it within `structured_outputs`."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


_SRC = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _clean(e: BaseException) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _SRC.sub("", msg)[:500]


def _regex_escape(s: str) -> str:
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}/" else c for c in s)


class GrammarCache:
    def __init__(self, vocab_size: int, *, tokenizer: Any = None, token_strings: Sequence[str] | None = None,
                 stop_ids: Sequence[int] = (), capacity: int = 256, threads: int = 1) -> None:
        """`tokenizer` is the engine's `Tokenizer` (a `tokenizers` vocabulary); `token_strings` a raw
        vocabulary instead (token i is that text, for models without a tokenizer). `vocab_size` is
        the logit width, which may exceed the tokenizer's vocabulary (padded ids are never allowed)."""
        import xgrammar as xgr  # the engine imports xgrammar only when a constraint first appears

        self.xgr = xgr
        self.vocab_size = vocab_size
        if token_strings is not None:
            enc: list[str] = list(token_strings)
            vtype, prefix = xgr.VocabType.RAW, False
        elif tokenizer is not None:
            vocab = tokenizer.tok.get_vocab(with_added_tokens=True)
            enc = [""] * max(len(vocab), max(vocab.values(), default=-1) + 1)
            for s, i in vocab.items():
                enc[i] = s
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.tok.to_str())
            vtype, prefix = meta["vocab_type"], bool(meta["add_prefix_space"])
        else:
            raise ConstraintError("structured output needs a tokenizer and this model has none", "structured_outputs")
        if len(enc) > vocab_size:
            raise ConstraintError(f"the tokenizer has {len(enc)} tokens, more than the model's {vocab_size} logits",
                                  "structured_outputs")
        self.info = xgr.TokenizerInfo(enc, vtype, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids),
                                      add_prefix_space=prefix)
        self.stop_ids = sorted(stop_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.capacity = capacity
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.compile_s = 0.0  # total time spent compiling (misses)

    def get(self, so: StructuredOutputs) -> Any:
        """The compiled grammar of `so`, from the cache or compiled now (and cached)."""
        key = (so.kind, so.text)
        with self._lock:
            g = self._cache.get(key)
            if g is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return g
        t0 = time.perf_counter()
        g = self._compile(so)
        with self._lock:
            self.misses += 1
            self.compile_s += time.perf_counter() - t0
            self._cache[key] = g
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return g

    def __len__(self) -> int:
        return len(self._cache)

    def _compile(self, so: StructuredOutputs) -> Any:
        c, kind = self.compiler, so.kind
        try:
            if kind == "json":
                schema = so.json_
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except ValueError as e:
                        raise ConstraintError(f"the JSON schema is not valid JSON: {e}", "json") from None
                if not isinstance(schema, dict):
                    raise ConstraintError("a JSON schema must be a JSON object", "json")
                return c.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                # Any JSON object (OpenAI's json_object mode), in the same one-line format as schemas.
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return c.compile_regex(so.regex or "")
            if kind == "choice":
                return c.compile_regex("|".join("(" + _regex_escape(x) + ")" for x in so.choice or []))
            return c.compile_grammar(so.grammar or "")
        except ConstraintError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            what = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex", "choice": "choice",
                    "grammar": "grammar"}[kind]
            raise ConstraintError(f"invalid {what}: {_clean(e)}", kind) from None

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)
