"""Draft-training prompts with a long given input: summarise, translate, answer from a passage, rewrite, follow up.

The shipped draft accepts least where the answer is built from a long text in the prompt (summaries
2.18, translation 2.42 / 1.77 at T 0.7, retrieval-grounded answers 2.51, QA 2.30), and its training
prompts are short instructions. This script writes prompts that hand the target a passage of a few
hundred words and ask it to summarise, translate it (English to French, Spanish or German mostly, and
back), answer a question from it (quoting it), rewrite, shorten or list it, or follow up on it as if it
had been quoted earlier in a conversation (one user turn: `train_data.read_prompt_file` takes a row's
first turn only, so a chat is written out inside the turn). The passages are text this machine has:
the Python language reference (`pydoc_data.topics`), docstrings of the standard library, the READMEs
and licences of the installed distributions, and the French, Spanish and German message catalogues
under `--locale-dir`; cleaned (markup stripped, code-like paragraphs dropped, paragraphs mostly seen in
another document dropped) and cut at sentence ends. `mleagle train-draft generate --extra-prompts FILE
--sources long_input` then has the target answer them; every prompt fits `--max-prompt-tokens`
templated with the target's chat template (the generate phase's default, 512, so it skips none).

A stable hash of each document's name puts it in the training or the evaluation share (`split_of`):
scripts/task_suite.py builds its held-out suite from the other share only. Every prompt sharing an
8-word sequence with an MT-Bench turn, a GSM8K test question, an AlpacaEval instruction or a prompt of
the suite (`--suite`) is dropped, counted in the summary line on stderr. Deterministic for a seed on
one Python and one set of installed packages and catalogues (another machine's may differ).

    python scripts/long_input_prompts.py --out long.jsonl --suite suite [--n 6000] [--data-dir ../shared/data]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import inspect
import json
import os
import random
import re
import statistics
import struct
import sys
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

SOURCE = "long_input"
SOURCES = ("pydoc", "stdlib", "packages", "locale")
EVAL_PERMILLE = 200  # share of documents (by name hash) held out for the evaluation suite
LANGS = {"fr": "French", "es": "Spanish", "de": "German"}
# Standard-library trees that are tests, GUIs, vendored wheels or build files, not documentation.
STDLIB_SKIP = {"test", "tests", "idlelib", "tkinter", "turtledemo", "site-packages", "__pycache__", "lib2to3",
               "ensurepip", "lib-dynload", "pydoc_data", "antigravity.py", "this.py", "turtle.py"}
C_MODULES = ("builtins", "math", "cmath", "itertools", "time", "array", "binascii", "zlib", "unicodedata", "gc")
SKIP_DISTS = {"mleagle"}  # this project's own README is not source text
LICENSE_FILE = re.compile(r"(LICEN[CS]E|COPYING|NOTICE)", re.I)
STOP = {"en": " the and is of to that in it for ", "fr": " le la les des est une que pour dans pas ",
        "es": " el la los las es una que para del por ", "de": " der die das und ist nicht den ein eine mit "}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- source documents ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Doc:
    id: str  # "pydoc:assert", "stdlib:json", "pkg:numpy", "license:numpy/LICENSE.txt", "locale:fr:bash"
    title: str  # what the text is about, for instructions: "the assert statement", "the json module"
    lang: str
    paras: tuple[str, ...]  # cleaned prose paragraphs


def split_of(doc_id: str) -> str:
    """'eval' or 'train' for a document, from a stable hash of its name (never of its position)."""
    h = int.from_bytes(hashlib.sha256(b"mleagle-long-input\0" + doc_id.encode()).digest()[:8], "big")
    return "eval" if h % 1000 < EVAL_PERMILLE else "train"


def grams(text: str, n: int = 8) -> set[str]:
    """The word 8-grams of prose_prompts.ngrams (lower case, [a-z0-9']+ words), joined by spaces."""
    w = re.findall(r"[a-z0-9']+", text.lower())
    return {" ".join(w[i : i + n]) for i in range(len(w) - n + 1)}


def demarkup(text: str) -> str:
    """Markdown / reST / HTML to plain lines: code blocks, directives, images, tables and badges out,
    links and emphasis down to their text, heading underlines removed."""
    t = text.replace("\r\n", "\n").replace("\t", "    ")
    t = re.sub(r"(?ms)^\s*(```|~~~).*?^\s*\1[^\n]*$", "\n", t)  # fenced code
    t = re.sub(r"(?s)<!--.*?-->", " ", t)
    t = re.sub(r"(?m)^\.\. [^\n]*(\n(?:[ \t]+[^\n]*|[ \t]*)(?=\n))*", "\n", t)  # reST directives + bodies
    t = re.sub(r"!\[[^\]]*\]\([^)]*\)", " ", t)  # images
    t = re.sub(r"\[!\[[^\]]*\]\([^)]*\)\]\([^)]*\)", " ", t)  # badges
    t = re.sub(r"\[([^\]]+)\]\((?:[^()]|\([^)]*\))*\)", r"\1", t)  # [text](url)
    t = re.sub(r"\[([^\]]+)\]\[[^\]]*\]", r"\1", t)  # [text][ref]
    t = re.sub(r"`([^`<]+?)\s*<[^>]+>`_{1,2}", r"\1", t)  # `text <url>`_
    t = re.sub(r":[\w:-]+:`([^`]+)`", r"\1", t)  # :role:`text`
    t = re.sub(r"`{1,2}([^`\n]+)`{1,2}_{0,2}", r"\1", t)
    t = re.sub(r"<[^>\n]+>", " ", t)  # HTML tags
    t = re.sub(r"https?://\S+", " ", t)
    t = re.sub(r"\*\*(?=\S)(.+?)(?<=\S)\*\*", r"\1", t)
    t = re.sub(r"(?<!\w)__([^_\n]+ [^_\n]+)__(?!\w)", r"\1", t)  # bold, not a __dunder__
    t = re.sub(r"(?<![\w*])\*(?=\S)([^*\n]+?)(?<=\S)\*(?![\w*])", r"\1", t)
    t = re.sub(r"(?m)^[ \t]*([=\-~^*#+`]{3,}|-\[ .* \]-)[ \t]*$", "", t)  # underlines, rules, footnote heads
    t = re.sub(r"(?m)^[ \t]*#{1,6}[ \t]+[^\n]*$", "", t)  # markdown headings
    t = re.sub(r"(?m)^[ \t]*(\||\+[-=+]+).*$", "", t)  # tables
    return t


def prose_ok(p: str, lang: str = "en") -> bool:
    """Mostly letters and spaces, few symbols, no long tokens (paths, hashes), ends like a sentence, and
    looks like `lang` (its common words outnumber the other languages')."""
    if len(p.split()) < 8 or not p.rstrip("\"')”»").endswith((".", "!", "?")):  # not "...:" (its code is gone)
        return False
    n = len(p)
    if sum(c.isalpha() or c == " " for c in p) < 0.85 * n:
        return False
    if sum(not (c.isalnum() or c.isspace() or c in ".,;:'\"!?()-–—’‘“”«»¿¡") for c in p) > 0.03 * n:
        return False
    if max(len(w) for w in p.split()) > 28 or re.search(r"::|=>|->|\$ |>>>|\bdef |\{|\}", p):
        return False
    low = f" {p.lower()} "
    hits = {k: sum(low.count(f" {w} ") for w in v.split()) for k, v in STOP.items()}
    return hits[lang] >= (1 if lang == "en" else 2) and hits[lang] >= max(v for k, v in hits.items() if k != lang)


def paragraphs(text: str, lang: str = "en") -> list[str]:
    """Prose paragraphs of a text: blank-line separated blocks (list items each their own) not indented
    like code, whitespace collapsed, kept where `prose_ok`."""
    out = []
    for block in re.split(r"\n[ \t]*\n", demarkup(text)):
        lines = [ln for ln in block.split("\n") if ln.strip()]
        if not lines or len(lines[0]) - len(lines[0].lstrip()) >= 3:  # code / literal block
            continue
        items: list[list[str]] = [[]]
        for ln in lines:
            if re.match(r"\s*([-*+•]|\d+[.)]|\[\d+\])\s+", ln) and items[-1]:
                items.append([])
            items[-1].append(ln)
        for it in items:
            p = re.sub(r"^([-*+•]|\d+[.)]|\[\d+\])\s+", "", " ".join(" ".join(it).split()))
            if prose_ok(p, lang):
                out.append(p)
    return out


def pydoc_docs() -> list[Doc]:
    """One document per topic of the language reference that `help()` shows (`pydoc_data.topics`)."""
    import pydoc_data.topics as topics

    out = []
    for key in sorted(topics.topics):
        text = topics.topics[key]
        first = text.split("\n", 1)[0].strip()
        title = re.sub(r'"([^"]+)"', r"\1", first) or key
        out.append(Doc(f"pydoc:{key}", title[0].lower() + title[1:] if title[:4] == "The " else title, "en",
                       tuple(paragraphs(text.split("\n", 2)[-1]))))
    return out


BAL = r"\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)"  # balanced parentheses, two levels deep, across lines
DEF = re.compile(rf'^([ \t]*)((?:async[ \t]+)?def[ \t]+(\w+)[ \t]*{BAL}[^\n]*?|class[ \t]+(\w+)[ \t]*(?:{BAL})?)'
                 rf'[ \t]*:[ \t]*(?:#[^\n]*)?\n[ \t]*[rRuU]?("""|\'\'\')(.*?)\5', re.M | re.S)
MODULE_DOC = re.compile(r'\A(?:[ \t]*(?:#[^\n]*)?\n)*[ \t]*[rRuU]?("""|\'\'\')(.*?)\1', re.S)


@dataclass(frozen=True)
class Def:
    module: str  # top-level module
    path: str  # dotted name of the module it is in ("email.utils")
    name: str
    header: str  # "def name(args) -> ret" / "class Name(Base)", as written
    top: bool  # at module level (not a method or nested)
    doc: str  # cleaned docstring


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(modules: Iterable[str] | None = None) -> list[tuple[str, Path]]:
    """(top-level module, file) for the standard library's .py files, sorted; `modules` limits the names."""
    root = stdlib_root()
    tops = sorted(modules) if modules is not None else sorted(p.name.removesuffix(".py") for p in root.iterdir())
    out = []
    for top in tops:
        if top.startswith("_") or top in STDLIB_SKIP or f"{top}.py" in STDLIB_SKIP or top.startswith("config-"):
            continue
        if (root / f"{top}.py").is_file():
            out.append((top, root / f"{top}.py"))
        for dirpath, dirs, files in os.walk(root / top) if (root / top).is_dir() else []:
            dirs[:] = [d for d in dirs if d not in STDLIB_SKIP]
            out += [(top, Path(dirpath) / f) for f in sorted(files) if f.endswith(".py")]
    return sorted(out)


def stdlib_defs(modules: Iterable[str] | None = None) -> tuple[dict[str, list[str]], list[Def]]:
    """Module docstrings (by top-level module) and the documented public classes and functions of the
    standard library's .py files, in file order. Found by a pattern, not parsed: the whole library
    parses in seconds, this takes a fraction of one."""
    mods: dict[str, list[str]] = {}
    defs = []
    root = stdlib_root()
    for top, f in stdlib_files(modules):
        src = f.read_text(encoding="utf-8", errors="replace")
        mods.setdefault(top, []).extend(inspect.cleandoc(m.group(2)) for m in [MODULE_DOC.match(src)] if m)
        path = ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for m in DEF.finditer(src):
            name = m.group(3) or m.group(4)
            if not name.startswith("_"):
                defs.append(Def(top, path, name, m.group(2).strip(), m.group(1) == "", inspect.cleandoc(m.group(6))))
    return mods, defs


def stdlib_docs(modules: Iterable[str] | None = None) -> list[Doc]:
    """One document per top-level standard-library module: its module docstring, then each public
    class's and function's docstring led by its name ("dumps(): Serialize obj ..."), plus a few C
    modules' docstrings through `inspect`."""
    mods, defs = stdlib_defs(modules)
    paras: dict[str, list[str]] = {m: [p for d in docs for p in paragraphs(d)] for m, docs in mods.items()}
    for d in defs:
        ps = paragraphs(d.doc)
        if ps:
            paras.setdefault(d.module, []).extend([f"{d.name}{'()' if d.header[0] != 'c' else ''}: {ps[0]}", *ps[1:]])
    for name in C_MODULES:
        if modules is not None and name not in modules:
            continue
        mod = __import__(name)
        ps = paragraphs(inspect.getdoc(mod) or "")
        for k in sorted(dir(mod)):
            o = getattr(mod, k)
            if not k.startswith("_") and (d := inspect.getdoc(o)) and (ps_o := paragraphs(d)):
                ps += [f"{k}{'()' if callable(o) and not isinstance(o, type) else ''}: {ps_o[0]}", *ps_o[1:]]
        paras.setdefault(name, []).extend(ps)
    return [Doc(f"stdlib:{m}", f"the {m} module", "en", tuple(ps)) for m, ps in sorted(paras.items())]


def package_docs() -> list[Doc]:
    """The long description (README) of every installed distribution, and its licence files, one
    document each."""
    out = []
    seen = set()
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        name = re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "").lower())
        if not name or name in seen or name in SKIP_DISTS:
            continue
        seen.add(name)
        body = dist.metadata.get_payload() or re.sub(r"(?m)^ {7}\|", "", dist.metadata.get("Description") or "")
        out.append(Doc(f"pkg:{name}", f"the {dist.metadata['Name']} package", "en", tuple(paragraphs(str(body)))))
        for f in sorted(dist.files or [], key=str):
            if LICENSE_FILE.search(f.name):
                try:
                    text = Path(str(dist.locate_file(f))).read_text(encoding="utf-8", errors="replace")
                except OSError:
                    continue
                rel = str(f).split(".dist-info/", 1)[-1]
                out.append(Doc(f"license:{name}/{rel}", f"the licence of {dist.metadata['Name']}", "en",
                               tuple(paragraphs(text))))
    return out


def mo_messages(path: Path) -> list[tuple[str, str]]:
    """(msgid, msgstr) pairs of a gettext .mo catalogue, singular messages without context only."""
    data = path.read_bytes()
    if len(data) < 28:
        return []
    magic = struct.unpack("<I", data[:4])[0]
    end = "<" if magic == 0x950412DE else ">" if magic == 0xDE120495 else None
    if end is None:
        return []
    _, n, o_id, o_str = struct.unpack(end + "4I", data[4:20])
    raw = []
    for i in range(n):
        ln, off = struct.unpack(end + "2I", data[o_id + 8 * i : o_id + 8 * i + 8])
        ls, offs = struct.unpack(end + "2I", data[o_str + 8 * i : o_str + 8 * i + 8])
        raw.append((data[off : off + ln], data[offs : offs + ls]))
    cs = "utf-8"
    for k, v in raw:
        if not k:
            m = re.search(rb"charset=([\w-]+)", v)
            cs = m.group(1).decode() if m else cs
    out = []
    for k, v in raw:
        if not k or b"\x00" in k or b"\x04" in k:
            continue
        try:
            out.append((k.decode(cs), v.decode(cs)))
        except (UnicodeDecodeError, LookupError):
            continue
    return out


def locale_docs(locale_dir: str | Path) -> list[Doc]:
    """One document per (language, catalogue): its long translated messages that read as prose (the
    option tables, format strings and untranslated ones left out)."""
    out = []
    for lang in sorted(LANGS):
        d = Path(locale_dir) / lang / "LC_MESSAGES"
        for f in sorted(d.glob("*.mo")) if d.is_dir() else []:
            paras = []
            for msgid, msgstr in sorted(mo_messages(f)):
                if msgstr == msgid or re.search(r"%|\{|<|\\|\t|\$|--", msgstr):
                    continue
                lines = [ln for ln in msgstr.split("\n") if ln.strip() and not ln.lstrip().startswith("-")]
                p = " ".join(" ".join(lines).split())
                if len(p.split()) >= 12 and prose_ok(p, lang):
                    paras.append(p)
            out.append(Doc(f"locale:{lang}:{f.stem}", f"the {f.stem} messages", lang, tuple(paras)))
    return out


@lru_cache(maxsize=8)
def documents(sources: tuple[str, ...] = SOURCES, locale_dir: str = "/usr/share/locale",
              modules: tuple[str, ...] | None = None) -> tuple[Doc, ...]:
    """Every source document, sorted by name, each paragraph kept by the first document (in name
    order) that has it: a paragraph whose 8-grams are mostly in an earlier one is dropped (licences
    repeat across packages; numbers do not count), so that a text is in one document and so on one side
    of the split."""
    docs: list[Doc] = []
    if "pydoc" in sources:
        docs += pydoc_docs()
    if "stdlib" in sources:
        docs += stdlib_docs(modules)
    if "packages" in sources:
        docs += package_docs()
    if "locale" in sources:
        docs += locale_docs(locale_dir)
    seen: set[str] = set()
    out = []
    for d in sorted(docs, key=lambda d: d.id):
        keep = []
        for p in d.paras:
            g = grams(re.sub(r"\d+", "0", p))  # changelog lines that differ in a number are the same
            if len(g & seen) * 2 < len(g):
                keep.append(p)
                seen |= g
        if keep:
            out.append(Doc(d.id, d.title, d.lang, tuple(keep)))
    return tuple(out)


# --- passages -----------------------------------------------------------------------------------------
ABBREV = re.compile(r"\b(e\.g|i\.e|etc|vs|cf|Mr|Mrs|Dr|St|No|Fig|approx|resp|z\.B|d\.h|bzw|p\.ej|c\.-à-d)\.$")


def sentences(p: str) -> list[str]:
    """A paragraph's sentences (split after . ! ? before a capital or quote; common abbreviations kept)."""
    out: list[str] = []
    for piece in re.split(r"(?<=[.!?])\s+(?=[A-ZÀ-Ý\"'“«¿¡(])", p):
        if out and ABBREV.search(out[-1]):
            out[-1] += " " + piece
        else:
            out.append(piece)
    return out


@dataclass(frozen=True)
class Passage:
    doc: Doc
    paras: tuple[tuple[str, ...], ...]  # sentences, by paragraph

    @property
    def text(self) -> str:
        return "\n\n".join(" ".join(s) for s in self.paras)

    @property
    def words(self) -> int:
        return sum(len(s.split()) for p in self.paras for s in p)

    def sents(self) -> list[str]:
        return [s for p in self.paras for s in p]

    def cut(self, words: int) -> Passage:
        """The passage's first sentences up to `words` (none if the first is longer)."""
        paras: list[tuple[str, ...]] = []
        n = 0
        for p in self.paras:
            keep: list[str] = []
            for s in p:
                if n + len(s.split()) > words:
                    break
                keep.append(s)
                n += len(s.split())
            if keep:
                paras.append(tuple(keep))
            if len(keep) < len(p):
                break
        return Passage(self.doc, tuple(paras))


def passages(doc: Doc, lo: int, hi: int, seed: int) -> list[Passage]:
    """A document cut into consecutive passages of lo..hi words at sentence ends, each ending at a
    paragraph's end once past a target length drawn from (seed, document), or mid-paragraph where the
    next sentence would pass hi (a rest under lo is dropped)."""
    rng = random.Random(f"{seed}:{lo}:{hi}:{doc.id}")
    out: list[Passage] = []
    cur: list[list[str]] = []
    n, target = 0, rng.randint(lo, hi)

    def emit() -> None:
        nonlocal cur, n, target
        if n >= lo:
            out.append(Passage(doc, tuple(tuple(x) for x in cur if x)))
        cur, n, target = [[]], 0, rng.randint(lo, hi)
    for p in doc.paras:
        cur.append([])
        for s in sentences(p):
            w = len(s.split())
            if n + w > hi:
                emit()  # too short to keep if under lo: a passage never passes hi
            if w <= hi:
                cur[-1].append(s)
                n += w
        if n >= target:
            emit()
    return out


# --- instructions ---------------------------------------------------------------------------------------
WRAP = ["{i}\n\n{t}", '{i}\n\n"""\n{t}\n"""', "{t}\n\n{i}", "Text:\n{t}\n\n{i}", "<document>\n{t}\n</document>\n\n{i}",
        "{i}\n\n---\n{t}\n---"]
SUMMARISE = [
    "Summarise the following text in {k} sentences.", "Write a short summary of the text below.",
    "Summarize this document for a busy reader.", "What are the main points of this text? Answer with a short bulleted list.",
    "Give a one-paragraph summary of this passage.", "Read the text and summarise it in plain English.",
    "Write an abstract of about {w} words for this document.", "Condense this text into a few key sentences.",
    "TL;DR:", "Summarise the document, then list its three most important details.",
    "Explain in a few sentences what this text is about.", "Write a headline and a two-sentence summary for this text.",
    "Summarise this for someone who is new to the subject.", "Sum up the key ideas of this passage in {k} bullet points.",
]
REWRITE = [
    "Rewrite the following text in simpler language.", "Shorten this text to about half its length without losing the key facts.",
    "Convert the following text into bullet points.", "Turn this passage into a numbered list of its main points.",
    "Rewrite this text as a friendly email to a colleague.", "Paraphrase the following text.", "Make this text more concise.",
    "Rewrite the text for a beginner, explaining any technical terms.", "Rewrite this passage in a more formal tone.",
    "Rewrite the following as a short FAQ with questions and answers.", "Turn this text into study notes with headings.",
    "Extract the key terms from this text and define each one in a sentence.", "Rewrite this text in the second person.",
    "Shorten this passage to three sentences.", "Rewrite this text as a checklist.",
]
TO_LANG = ["Translate the following text into {l}.", "Please translate this passage to {l}:",
           "Translate into {l}, keeping the meaning and the technical terms accurate:", "Render the text below in {l}.",
           "I need this text in {l}. Translate it for me.", "Translate from English to {l}:",
           "Translate this into {l}. Keep the paragraph breaks."]
FROM_LANG = ["Translate the following {l} text into English.", "What does this {l} text say? Translate it into English.",
             "Translate from {l} to English:", "Please give an English translation of this text."]
FROM_NATIVE = {"fr": "Traduisez le texte suivant en anglais :", "es": "Traduce el siguiente texto al inglés:",
               "de": "Übersetze den folgenden Text ins Englische:"}
GROUNDED = ["Answer the question using only the passage below.\n\nPassage:\n{t}\n\nQuestion: {q}",
            "Read the text and answer: {q}\n\n{t}", "Context:\n{t}\n\nBased on the context above, answer this question: {q}",
            "{t}\n\nAccording to the text above: {q}", "Here is a passage.\n\n{t}\n\n{q} Answer from the passage only.",
            "{q}\n\nUse this text to answer:\n\n{t}"]
RAG = "Use the documents below to answer the question, and say which document the answer comes from.\n\n{docs}\n\nQuestion: {q}"
QUESTIONS = [
    "What does the passage say about {k}?", "Quote the sentence that mentions {k}.",
    "Which sentence explains {k}? Quote it exactly.", "How is {k} described in the text? Quote the relevant part.",
    'The text contains a sentence that begins "{s}". Complete that sentence exactly as it appears in the text.',
    'Does the text say this: "{S}"? Answer yes or no, and quote the sentence that supports your answer.',
    "What is the main topic of the passage, and what are its key points?", "What does the text tell us about {title}?",
    "Answer two questions: what does the text say about {k}, and what does it say about {k2}?",
    "Find the part of the text about {k} and explain it in your own words.", "Why does the text mention {k}?",
]
FOLLOWUP = [
    'Earlier you wrote this:\n\n"{t}"\n\nCan you explain the part about {k} in more detail?',
    "Here is the text from my previous message:\n\n{t}\n\nNow, what does it say about {k}?",
    "Below is our conversation so far.\n\nUser: Please read this text.\n\n{t}\n\nAssistant: I have read it. "
    "What would you like to know?\n\nUser: {q}",
    "A colleague sent me this earlier today:\n\n{t}\n\nI still don't understand it. Explain it to me as if I were new to the subject.",
    "You told me the following earlier:\n\n{t}\n\nGive me three quiz questions about it, with answers.",
    "Going back to the document I shared before:\n\n{t}\n\nWhich parts are the most important, and why?",
    "Yesterday I read this passage:\n\n{t}\n\nCould you write a short explanation of it with one example?",
    "In my last message I pasted this:\n\n{t}\n\nYou summarised it already. Now list what it says about {k}.",
    "We were discussing this text:\n\n{t}\n\nIs there anything in it that a beginner might misunderstand?",
]
KINDS = {"summarise": 0.24, "translate": 0.2, "grounded": 0.24, "rewrite": 0.16, "followup": 0.16}
COMMON = set("""a an the and or but if then else when while of to in on at by for with from into onto over under
about as is are was were be been being it its this that these those there here which who whom whose what
not no can could may might must shall should will would do does did done has have had any all each every
some such other than also only more most less very so too just one two three first second new used use
using uses value values object objects function functions method methods argument arguments return returns
string strings list lists file files name names default true false none type types number class classes""".split())


NOUNISH = ("tion", "sion", "ment", "ness", "ity", "ance", "ence", "ism", "ure", "age", "ship", "ory", "ist", "ics",
           "ing", "er", "or")


def key_terms(sent: str, passage: str, rng: random.Random, n: int = 1) -> list[str]:
    """Up to n terms of a sentence to ask about, best kinds first: a short quoted phrase, a name
    (call(), CamelCase, dotted.name, a run of capitalised words past the sentence's start), else an
    uncommon noun-like word of 7+ letters that the passage uses at most twice."""
    quoted = [q for q in re.findall(r'"([^"]{3,40})"|“([^”]{3,40})”', sent) for q in q if q and len(q.split()) <= 4]
    names = re.findall(r"\b[A-Za-z_][\w.]*\(\)|\b[A-Z][a-z]+[A-Z]\w*|\b[a-z_]\w*\.[a-z_]\w*\b", sent)
    names += re.findall(r"(?<=[a-z,;] )[A-Z][a-z]+(?: [A-Z][a-z]+)+", sent)
    low = passage.lower()
    words = [w for w in re.findall(r"\b[a-z]{7,}\b", sent) if w not in COMMON and w.endswith(NOUNISH)
             and low.count(w) <= 2]
    out: list[str] = []
    for group in ([f'"{q}"' for q in quoted] + names, words):
        group = list(dict.fromkeys(g for g in group if g not in out))
        rng.shuffle(group)
        out += group
    return out[:n]


def question(p: Passage, rng: random.Random, templates: Sequence[str]) -> str:
    """A question the passage answers, from `templates` (slots: k, k2 key terms; s a sentence's first
    words; S a sentence; title the document's subject)."""
    sents = [s for s in p.sents() if len(s.split()) >= 6]
    for _ in range(8):
        tpl = rng.choice(templates)
        s = rng.choice(sents or p.sents())
        ks = key_terms(s, p.text, rng, 1) + key_terms(rng.choice(sents or p.sents()), p.text, rng, 1)
        if ("{k}" in tpl and not ks) or ("{k2}" in tpl and (len(ks) < 2 or ks[0] == ks[1])):
            continue
        ws = s.split()
        return tpl.format(k=ks[0] if ks else "", k2=ks[-1] if ks else "", s=" ".join(ws[: rng.randint(4, 6)]),
                          S=s.rstrip("."), title=p.doc.title)
    return "What is the main topic of the passage, and what are its key points?"


@dataclass(frozen=True)
class Built:
    prompt: str
    category: str
    words: int  # of the given text(s)
    docs: tuple[str, ...]  # the documents they come from


def retrieved(p: Passage, rng: random.Random, pool: Sequence[Passage], k: int, max_words: int) -> list[Passage]:
    """p among up to k distractors (40 to 80 words each, from other documents of `pool`), in a random
    order, p cut so that all together keep to max_words; p alone where it would not keep a sentence."""
    others = {x.doc.id: x for x in rng.sample(list(pool), min(len(pool), k + 2)) if x.doc.id != p.doc.id}
    ds = [c for x in list(others.values())[:k] if (c := x.cut(rng.randint(40, 80))).words]
    main = p if p.words + sum(d.words for d in ds) <= max_words else p.cut(max_words - sum(d.words for d in ds))
    if not main.words:
        return [p]
    ds.append(main)
    rng.shuffle(ds)
    return ds


def build(kind: str, p: Passage, seed: float, pool: Sequence[Passage], max_words: int = 400) -> Built:
    """One prompt of a kind around a passage, its choices drawn from `seed` (the same for a shorter cut
    of the passage); `pool` gives a retrieval prompt its distractor documents, all its texts together
    at most max_words."""
    rng = random.Random(seed)
    t = p.text
    if kind == "summarise":
        i = rng.choice(SUMMARISE).format(k=rng.choice([2, 3, 4, 5]), w=rng.choice([50, 80, 100, 150]))
        return Built(rng.choice(WRAP).format(i=i, t=t), "summarise", p.words, (p.doc.id,))
    if kind == "rewrite":
        return Built(rng.choice(WRAP).format(i=rng.choice(REWRITE), t=t), "rewrite", p.words, (p.doc.id,))
    if kind == "translate":
        if p.doc.lang != "en":
            i = FROM_NATIVE[p.doc.lang] if rng.random() < 0.25 else rng.choice(FROM_LANG).format(l=LANGS[p.doc.lang])
            return Built(rng.choice(WRAP[:4]).format(i=i, t=t), f"{p.doc.lang}-en", p.words, (p.doc.id,))
        lang = rng.choice(sorted(LANGS))
        return Built(rng.choice(WRAP[:4]).format(i=rng.choice(TO_LANG).format(l=LANGS[lang]), t=t), f"en-{lang}", p.words, (p.doc.id,))
    q = question(p, rng, QUESTIONS)
    if kind == "grounded" and rng.random() < 0.3:
        ds = retrieved(p, rng, pool, rng.choice([1, 2]), max_words)
        if len(ds) > 1:
            docs = "\n\n".join(f"[{j + 1}] {d.doc.title[0].upper() + d.doc.title[1:]}\n{d.text}" for j, d in enumerate(ds))
            return Built(RAG.format(docs=docs, q=q), "retrieval", sum(d.words for d in ds), tuple(d.doc.id for d in ds))
    if kind == "grounded":
        return Built(rng.choice(GROUNDED).format(t=t, q=q), "passage", p.words, (p.doc.id,))
    ks = key_terms(rng.choice(p.sents()), t, rng, 1) or [p.doc.title]
    return Built(rng.choice(FOLLOWUP).format(t=t, k=ks[0], q=q), "followup", p.words, (p.doc.id,))


# --- the prompt set ---------------------------------------------------------------------------------------
class Fitter:
    """Token counts of templated prompts (the target's chat template, as `mleagle train-draft generate`
    counts them) and cutting a passage until its prompt fits."""

    def __init__(self, tok: Any, max_tokens: int) -> None:
        self.tok, self.max = tok, max_tokens

    def count(self, prompt: str) -> int:
        return len(self.tok.encode_chat([{"role": "user", "content": prompt}]))

    def fit(self, make: Callable[[Passage], Built], p: Passage, min_words: int) -> tuple[Built, int] | None:
        """The prompt of the longest cut of p that fits, and its tokens; None once under min_words."""
        while True:
            b = make(p)
            if b.words < min_words:
                return None
            n = self.count(b.prompt)
            if n <= self.max:
                return b, n
            q = p.cut(int(p.words * min(0.97, self.max / n)))
            if q.words >= p.words or not q.words:  # no shorter cut, or none at all (a first sentence too long)
                return None
            p = q


def tokenizer(model: str = "smollm2-135m") -> Any:
    from mleagle.engine.contract.config import load_config
    from mleagle.engine.contract.tokenizer import Tokenizer

    return Tokenizer.from_source(load_config(model).model)


def pool(split: str, seed: int, lo: int, hi: int, docs: Sequence[Doc]) -> dict[str, list[Passage]]:
    """The split's passages by language ("en", or a translation source language)."""
    out: dict[str, list[Passage]] = {}
    for d in docs:
        if split_of(d.id) == split:
            out.setdefault(d.lang, []).extend(passages(d, lo, hi, seed))
    return out


def quotas(n: int, shares: dict[str, float]) -> dict[str, int]:
    """n split by shares, largest remainders first, summing to n."""
    raw = {k: n * v / sum(shares.values()) for k, v in shares.items()}
    out = {k: int(v) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: out[k] - raw[k])[: n - sum(out.values())]:
        out[k] += 1
    return out


def translation_bounds(lo: int, hi: int) -> tuple[int, int]:
    """Words of a text to translate: half the others' (its answer is about as long again)."""
    tlo = max(40, lo // 2)
    return tlo, max(tlo + 30, hi // 2)


def parse_kinds(spec: str) -> dict[str, float]:
    """--kinds: `translate=0.6,grounded=0.4` (shares of KINDS' names; normalised; unnamed kinds get none)."""
    out: dict[str, float] = {}
    for part in filter(None, (x.strip() for x in spec.split(","))):
        name, _, share = part.partition("=")
        try:
            v = float(share)
        except ValueError:
            raise ValueError(f"--kinds {spec!r}: expected name=share pairs, e.g. translate=0.6,grounded=0.4") from None
        if name not in KINDS or v < 0:
            raise ValueError(f"--kinds {spec!r}: {name!r} is not one of {', '.join(KINDS)} with a share >= 0")
        out[name] = v
    total = sum(out.values())
    if total <= 0:
        raise ValueError(f"--kinds {spec!r}: the shares add up to nothing")
    return {k: v / total for k, v in out.items()}


def make(n: int, seed: int, banned: dict[str, set[str]], docs: Sequence[Doc], fitter: Fitter, *,
         min_words: int = 150, max_words: int = 400, reuse: int = 4,
         kinds: dict[str, float] | None = None) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Up to n distinct prompts, shares by `kinds` (default KINDS), from the training share of `docs`, in up to `reuse`
    rounds that each cut the documents into passages afresh and give each passage at most one prompt
    per kind. Returns the rows and counts: dropped per
    banned set (name -> 8-grams) and too long (no cut of at least the minimum fits the token limit)."""
    rng = random.Random(seed)
    tlo, thi = translation_bounds(min_words, max_words)
    stats = {f"dropped_{k}": 0 for k in banned} | {"too_long": 0}
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    shares = kinds or KINDS
    want = quotas(n, shares)
    got = dict.fromkeys(shares, 0)
    for rnd in range(reuse):  # each round cuts the documents afresh (other passage ends and lengths)
        en = pool("train", seed * 7919 + rnd, min_words, max_words, docs).get("en", [])
        tr = pool("train", seed * 7919 + rnd, tlo, thi, docs)
        for kind in shares:
            if kind == "translate":  # a quarter (at most) into English, from the other languages' catalogues
                foreign = [p for lang in sorted(tr) if lang != "en" for p in tr[lang]]
                cands = rng.sample(foreign, min(len(foreign), want[kind] // 4))
                cands += rng.sample(tr.get("en", []), min(len(tr.get("en", [])), want[kind] - len(cands)))
            else:
                cands = list(en)
            rng.shuffle(cands)
            for p in cands:
                if got[kind] >= want[kind]:
                    break
                bseed = rng.random()
                fit = fitter.fit(lambda x, s=bseed, k=kind, en=en: build(k, x, s, en, max_words), p,
                                 tlo if kind == "translate" else min_words)
                if fit is None:
                    stats["too_long"] += 1
                    continue
                b, ntok = fit
                if b.prompt in seen:
                    continue
                seen.add(b.prompt)
                g = grams(b.prompt)
                hit = next((k for k, ban in banned.items() if g & ban), None)
                if hit:
                    stats[f"dropped_{hit}"] += 1
                    continue
                rows.append({"prompt": b.prompt, "source": SOURCE, "kind": kind, "category": b.category,
                             "docs": list(b.docs), "words": b.words, "tokens": ntok})
                got[kind] += 1
    rng.shuffle(rows)
    return rows, stats


def eval_ngrams(ddir: Path) -> dict[str, set[str]]:
    """8-grams of every MT-Bench turn, GSM8K test question and AlpacaEval instruction in `ddir`."""
    out: dict[str, set[str]] = {}
    for name in ("mt_bench", "gsm8k_test", "alpaca_eval"):
        f = ddir / f"{name}.jsonl"
        if f.is_file():
            out[name] = {g for line in f.read_text(encoding="utf-8").split("\n") if line.strip()
                         for t in json.loads(line).get("turns", []) for g in grams(t)}
    return out


def prompt_ngrams(files: Iterable[Path]) -> set[str]:
    """8-grams of the prompts (`prompt` or every turn) of JSONL files."""
    out: set[str] = set()
    for f in files:
        for line in f.read_text(encoding="utf-8").split("\n"):
            if line.strip():
                row = json.loads(line)
                for t in [row["prompt"]] if isinstance(row.get("prompt"), str) else row.get("turns", []):
                    out |= grams(t)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSONL file to write ({prompt, source, kind, category, docs, words, tokens} rows)")
    ap.add_argument("--suite", required=True, help="scripts/task_suite.py's output folder: its prompts are held out")
    ap.add_argument("--n", type=int, default=6000, help="number of prompts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=None,
                    help="shares of the prompt kinds, e.g. translate=0.6,grounded=0.4 (default "
                         + ",".join(f"{k}={v}" for k, v in KINDS.items()) + ")")
    ap.add_argument("--min-input-words", type=int, default=150, help="shortest given text (translation: half)")
    ap.add_argument("--max-input-words", type=int, default=400,
                    help="longest given text (translation: half); --max-prompt-tokens usually binds first")
    ap.add_argument("--max-prompt-tokens", type=int, default=512,
                    help="templated prompt tokens (train-draft generate skips longer ones; default: its default)")
    ap.add_argument("--model", default="smollm2-135m", help="whose tokenizer and chat template count the tokens")
    ap.add_argument("--locale-dir", default="/usr/share/locale", help="gettext catalogues (LANG/LC_MESSAGES/*.mo)")
    ap.add_argument("--data-dir", default=None, help="evaluation sets to decontaminate against "
                    "(default: $MLEAGLE_DATA_DIR or ../shared/data)")
    a = ap.parse_args(argv)
    from mleagle.engine.contract.config import data_dir

    try:
        shares = parse_kinds(a.kinds) if a.kinds else None
    except ValueError as e:
        log(f"error: {e}")
        return 2
    ddir = Path(a.data_dir) if a.data_dir else data_dir()
    banned = eval_ngrams(ddir)
    suite = sorted(Path(a.suite).glob("*.jsonl"))
    if not banned or not suite:
        log(f"error: need the evaluation sets under {ddir} and the suite's JSONL files under {a.suite} "
            "(run scripts/task_suite.py first) to decontaminate against")
        return 2
    banned["suite"] = prompt_ngrams(suite)
    docs = documents(locale_dir=a.locale_dir)
    rows, stats = make(a.n, a.seed, banned, docs, Fitter(tokenizer(a.model), a.max_prompt_tokens),
                       min_words=a.min_input_words, max_words=a.max_input_words, kinds=shares)
    Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    kinds = {k: sum(r["kind"] == k for r in rows) for k in KINDS}
    cats = sorted({r["category"] for r in rows})
    log(f"{len(rows)} prompts from {sum(split_of(d.id) == 'train' for d in docs)} training documents -> {a.out}; "
        f"by kind {kinds}; by category { {c: sum(r['category'] == c for r in rows) for c in cats} }; "
        f"median {statistics.median(r['tokens'] for r in rows) if rows else 0} templated tokens; "
        + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in stats.items())
        + " (dropped: an 8-gram shared with that set; too long: no cut fits the token limit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
