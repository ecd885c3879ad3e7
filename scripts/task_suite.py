"""A held-out evaluation suite by task type: code, math, retrieval-grounded answers, translation, QA, summaries.

MT-Bench and GSM8K say little about how a draft accepts when the answer is built from a long given
text. This script writes one JSONL per task type (`code`, `math`, `grounded`, `translation`, `qa`,
`summarisation`; 80 prompts each by default) in the format `mleagle bench --dataset FILE.jsonl` and
`mleagle train-draft eval --eval-datasets FILE.jsonl,...` read (rows with `prompt`, a `category` the
evaluation breaks its figures down by, and `task`, `docs`, `tokens`; math rows add the `reference`
answer). Code prompts ask for the body of a documented standard-library function from its signature
and docstring; math prompts are multi-step word problems from templates, numbers drawn per seed; the
rest wrap passages as scripts/long_input_prompts.py does, in other words (its templates are not used).

Held out three ways: the passages and functions come only from the documents that
`long_input_prompts.split_of` puts in the evaluation share (so no document is in both); a prompt
sharing an 8-word sequence with any training prompt is dropped (the shared prompts.jsonl, the prose
prompts a default scripts/prose_prompts.py run writes, the text of every training-share document,
which is all a long-input training prompt quotes, and any `--train` file); and long_input_prompts.py
drops its own prompts that share one with this suite (build the suite first). Drops are counted in
the summary line on stderr. Every prompt fits `--max-prompt-tokens` templated. Deterministic for a
seed on one Python and one set of installed packages and catalogues.

    python scripts/task_suite.py --out-dir suite [--n 80] [--train long.jsonl] [--data-dir ../shared/data]
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import long_input_prompts as L
import prose_prompts

TASKS = ("code", "math", "grounded", "translation", "qa", "summarisation")
SUMMARISE = ["Provide a concise summary of the text.", "Summarize the following passage.",
             "Write a brief overview of the main ideas here.", "Give the gist of this document in a few sentences.",
             "Sum up the passage in one paragraph.", "Produce a summary of this text suitable for a newsletter.",
             "In three or four sentences, what does this document say?", "Briefly summarise the article."]
WRAP = ["{i}\n\n{t}", "Article:\n{t}\n\n{i}", "{i}\n\n[BEGIN]\n{t}\n[END]", "{t}\n\n---\n{i}", "Document:\n\n{t}\n\nTask: {i}"]
TO_LANG = ["Translate to {l}:", "Give a {l} version of the passage below.", "Could you put this into {l}?",
           "{l} translation, please:", "Translate the passage into {l} and keep its structure."]
FROM_LANG = ["Translate to English:", "Give an English version of this {l} passage.", "English translation, please:",
             "Could you put this {l} text into English?"]
RAG = ["Search results:\n\n{docs}\n\nUsing the search results above, answer the user's question. Question: {q}",
       "{docs}\n\nThe passages above were retrieved for this query: {q}\nWrite an answer grounded in them.",
       "Answer with reference to the retrieved passages.\n\nQuery: {q}\n\n{docs}"]
QUESTIONS = [
    "What information do the results give on {k}?", "Based on the retrieved text, explain {k}.",
    "Cite the line that discusses {k}.", "What is said about {title}?", "Summarise what is known about {k} here.",
    "Give the exact wording used about {k}.", 'Which passage contains "{s}", and how does that sentence end?',
    "Is it true that {S}? Support your answer with a quotation.",
]
QA_MODULE = ["What is the Python standard library module {m} for?", "When would I use Python's {m} module?"]
QA_CLASS = ["What is the {m}.{f} class in Python?", "What does the class {m}.{f} represent?"]
QA_FUNC = ["What does the Python function {m}.{f}() do?", "In Python, what is {m}.{f}() used for?",
           "How would you use {m}.{f}() in Python?"]
QA_TOPIC = ["Explain {t} in Python, with an example.", "What should a Python programmer know about {t}?",
            "Give an overview of {t} in Python."]
QA_PKG = ["What is the Python package {p} used for?", "What does {p} do, and why would I install it?"]
CODE = ["Complete the following Python function.\n\n```python\n{c}\n```",
        "Implement this function from the {m} module, given only its signature and docstring:\n\n```python\n{c}\n```",
        "Write the body of this Python function:\n\n{c}",
        "Fill in the implementation.\n\n```python\n{c}\n    ...\n```"]


# --- code and math ------------------------------------------------------------------------------------
def code_prompts(docs: Sequence[L.Doc], rng: random.Random) -> list[tuple[str, str, tuple[str, ...]]]:
    """(prompt, category, docs): documented public module-level functions of the evaluation share's
    standard-library modules, signature and docstring given, the body asked for."""
    mods = {d.id.split(":", 1)[1] for d in docs if d.id.startswith("stdlib:") and L.split_of(d.id) == "eval"}
    out = []
    for d in L.stdlib_defs(sorted(mods))[1]:
        if not d.top or not d.header.startswith(("def", "async")) or len(d.doc.split()) < 10:
            continue
        try:
            ast.parse(d.header + ":\n    pass")
        except SyntaxError:
            continue
        doc = "\n".join(d.doc.split("\n")[:25]).replace('"""', "'''")
        body = '    """' + doc.replace("\n", "\n    ").replace("\n    \n", "\n\n") + '\n    """'
        out.append((rng.choice(CODE).format(c=f"{d.header}:\n{body}", m=d.module), d.module, (f"stdlib:{d.module}",)))
    return out


NAMES = ["Amara", "Bilal", "Chiara", "Dmitri", "Esi", "Farah", "Goran", "Hana", "Ines", "Jomo", "Keiko", "Lars",
         "Mei", "Nikhil", "Olu", "Priya", "Quentin", "Rosa", "Sven", "Tala", "Umar", "Vera", "Wren", "Yusuf", "Zofia"]


def math_problem(rng: random.Random) -> tuple[str, str, str]:
    """(problem, template name, answer): a multi-step word problem, numbers drawn from rng."""
    n = rng.choice(NAMES)
    k = rng.randrange(12)
    if k == 0:
        a, p, b, q = rng.randint(3, 9), rng.randint(2, 6), rng.randint(2, 8), rng.randint(1, 4)
        bill = ((a * p + b * q) // 10 + 1 + rng.randint(0, 2)) * 10
        return (f"{n} buys {a} notebooks at ${p} each and {b} pens at ${q} each, and pays with a ${bill} note. "
                f"How much change should {n} get back?", "change", str(bill - a * p - b * q))
    if k == 1:
        v1, t1, v2, t2 = rng.randint(4, 9) * 10, rng.randint(2, 4), rng.randint(4, 9) * 10, rng.randint(1, 3)
        return (f"A freight train runs at {v1} km/h for {t1} hours, stops for half an hour, then runs at {v2} km/h "
                f"for {t2} hours. How many kilometres does it cover in total, and how long does the journey take "
                f"including the stop?", "distance", f"{v1 * t1 + v2 * t2} km, {t1 + t2}.5 hours")
    if k == 2:
        c, f, r, m = rng.randint(20, 60) * 10, rng.choice([40, 50, 60, 75, 80]), rng.randint(2, 6), rng.randint(5, 20)
        left = c * f // 100 - r * m
        if left < 0:
            return math_problem(rng)
        return (f"A water tank holds {c} litres and is {f}% full. A pump drains {r} litres a minute for {m} minutes. "
                f"How many litres are left in the tank?", "tank", str(left))
    if k == 3:
        s, w, x = rng.randint(4, 12) * 3, rng.randint(5, 15), rng.randint(5, 20)
        tot = s * w
        if tot // 3 + x >= tot:
            return math_problem(rng)
        return (f"{n} puts aside ${s} every week for {w} weeks, then spends a third of the savings on a bicycle "
                f"and ${x} on a lock. How much money does {n} have left?", "savings", str(tot - tot // 3 - x))
    if k == 4:
        rows, per, kg, pct, price = rng.randint(4, 12), rng.randint(6, 15), rng.randint(10, 30), rng.choice([50, 60, 75, 80]), rng.randint(2, 5)
        sold = rows * per * kg * pct // 100
        return (f"An orchard has {rows} rows of {per} pear trees. Each tree yields {kg} kg of pears, and {pct}% of the "
                f"harvest is sold at ${price} per kilogram. How much does the orchard earn?", "orchard", str(sold * price))
    if k == 5:
        g, c, want, bag = rng.randint(2, 5) * 50, rng.choice([12, 16, 20, 24]), rng.choice([36, 48, 60, 72, 96]), rng.choice([500, 1000])
        need = g * want / c
        return (f"A biscuit recipe uses {g} g of flour for {c} biscuits. A café wants to bake {want} biscuits. How much "
                f"flour does it need, and how many {bag} g bags must it open?", "recipe",
                f"{need:g} g, {-(-int(need) // bag)} bags")
    if k == 6:
        st, pct = rng.randint(20, 60) * 20, rng.choice([10, 15, 20, 25, 30])
        choir = st * pct // 100
        return (f"A school has {st} pupils. {pct}% of them sing in the choir, and a quarter of the choir also plays in the "
                f"orchestra. How many choir members do not play in the orchestra?", "choir", str(choir - choir // 4))
    if k == 7:
        a, b, tot = rng.randint(15, 40), rng.randint(3, 10), rng.randint(25, 50) * 10
        read = a + 2 * a + (2 * a - b)
        if read >= tot:
            return math_problem(rng)
        return (f"{n} reads {a} pages of a novel on Friday, twice as many on Saturday, and {b} fewer on Sunday than on "
                f"Saturday. The novel has {tot} pages. How many pages remain?", "pages", str(tot - read))
    if k == 8:
        p, d, t = rng.randint(4, 20) * 10, rng.choice([10, 20, 25, 30]), rng.choice([5, 8, 10])
        final = p * (100 - d) * (100 + t) / 10000
        return (f"A coat costs ${p}. The shop takes {d}% off, then adds {t}% sales tax to the reduced price. What does "
                f"the coat cost in the end?", "discount", f"{final:.2f}")
    if k == 9:
        ln, wd, path = rng.randint(8, 20), rng.randint(5, 12), rng.choice([1, 2])
        area = (ln + 2 * path) * (wd + 2 * path) - ln * wd
        return (f"A rectangular lawn is {ln} m long and {wd} m wide. A gravel path {path} m wide runs all the way round "
                f"it. What is the area of the path?", "path", f"{area} m²")
    if k == 10:
        ad, ch, grp = rng.randint(8, 15), rng.randint(3, 7), rng.randint(8, 20)
        kids = rng.randint(1, grp - 1)
        total = ad * (grp - kids) + ch * kids
        return (f"Museum tickets cost ${ad} for adults and ${ch} for children. A group of {grp} people paid ${total} in "
                f"all. How many children were in the group?", "tickets", str(kids))
    h, w, cost = rng.randint(3, 6), rng.randint(2, 4), rng.randint(3, 9)
    boxes = rng.randint(20, 60)
    return (f"A warehouse packs {boxes} boxes an hour on each of {w} lines, {h} hours a day, and shipping costs ${cost} "
            f"per box. What is the shipping bill for five days of packing?", "warehouse", str(boxes * w * h * 5 * cost))


# --- text tasks ---------------------------------------------------------------------------------------
def rag(p: L.Passage, rng: random.Random, pool: Sequence[L.Passage], max_words: int) -> L.Built:
    q = L.question(p, rng, QUESTIONS)
    ds = L.retrieved(p, rng, pool, rng.choice([0, 1, 2]), max_words)
    docs = "\n\n".join(f"({j + 1}) {d.doc.title}\n{d.text}" for j, d in enumerate(ds))
    return L.Built(rng.choice(RAG).format(docs=docs, q=q), "retrieval" if len(ds) > 1 else "passage",
                   sum(d.words for d in ds), tuple(d.doc.id for d in ds))


def summary(p: L.Passage, rng: random.Random) -> L.Built:
    return L.Built(rng.choice(WRAP).format(i=rng.choice(SUMMARISE), t=p.text), p.doc.id.split(":")[0], p.words,
                   (p.doc.id,))


def translation(p: L.Passage, rng: random.Random) -> L.Built:
    if p.doc.lang != "en":
        i = rng.choice(FROM_LANG).format(l=L.LANGS[p.doc.lang])
        return L.Built(rng.choice(WRAP[:3]).format(i=i, t=p.text), f"{p.doc.lang}-en", p.words, (p.doc.id,))
    lang = rng.choice(sorted(L.LANGS))
    i = rng.choice(TO_LANG).format(l=L.LANGS[lang])
    return L.Built(rng.choice(WRAP[:3]).format(i=i, t=p.text), f"en-{lang}", p.words, (p.doc.id,))


def qa_prompts(docs: Sequence[L.Doc], rng: random.Random) -> list[tuple[str, str, tuple[str, ...]]]:
    """(prompt, category, docs): short closed-book questions on what the evaluation share's documents
    are about: the language reference's topics, the standard-library modules and their module-level
    functions and classes, the packages."""
    out = []
    ev = [d for d in docs if L.split_of(d.id) == "eval" and d.lang == "en"]
    for d in ev:
        kind, name = d.id.split(":", 1)
        if kind == "pydoc":
            t = d.title[0].lower() + d.title[1:] if d.title[1:2].islower() else d.title
            out.append((rng.choice(QA_TOPIC).format(t=t), "topic", (d.id,)))
        elif kind == "pkg":
            out.append((rng.choice(QA_PKG).format(p=d.title.removeprefix("the ").removesuffix(" package")), "package",
                        (d.id,)))
        elif kind == "stdlib":
            out.append((rng.choice(QA_MODULE).format(m=name), "module", (d.id,)))
    mods = sorted({d.id.split(":", 1)[1] for d in ev if d.id.startswith("stdlib:")})
    for f in L.stdlib_defs(mods)[1]:
        if f.top and not f.path.split(".")[-1].startswith("_"):
            fn = f.header.startswith(("def", "async"))
            out.append((rng.choice(QA_FUNC if fn else QA_CLASS).format(m=f.path, f=f.name), "function" if fn else "class",
                        (f"stdlib:{f.module}",)))
    return out


def banned_for_suite(ddir: Path, train_files: Sequence[Path], docs: Sequence[L.Doc]) -> dict[str, set[str]]:
    """8-grams no suite prompt may share, by where they come from."""
    out = {"prompts_jsonl": L.prompt_ngrams([ddir / "prompts.jsonl"]),
           "prose": {g for p in prose_prompts.make(30000, 0, set())[0] for g in L.grams(p)},
           "train_docs": {g for d in docs if L.split_of(d.id) == "train" for p in d.paras for g in L.grams(p)}}
    if train_files:
        out["train_files"] = L.prompt_ngrams(train_files)
    return out


def grounded_bounds(lo: int, hi: int) -> tuple[int, int]:
    """Words of a grounded prompt's own passage (the eval share is small: shorter passages, more of
    them); with the retrieved distractors all its texts keep to hi."""
    return max(60, lo * 2 // 3), max(120, hi * 2 // 3)


def interleave(items: Sequence[Any], key: Callable[[Any], str], rng: random.Random) -> list[Any]:
    """Items shuffled within their groups, then taken one group after another in turn (balanced groups)."""
    groups: dict[str, list[Any]] = {}
    for it in items:
        groups.setdefault(key(it), []).append(it)
    for g in groups.values():
        rng.shuffle(g)
    order = sorted(groups)
    rng.shuffle(order)
    return [g[i] for i in range(max(map(len, groups.values()), default=0)) for g in (groups[k] for k in order) if i < len(g)]


def make(n: int, seed: int, banned: dict[str, set[str]], docs: Sequence[L.Doc], fitter: L.Fitter, *,
         min_words: int = 150, max_words: int = 400,
         tasks: Sequence[str] = TASKS) -> tuple[dict[str, list[dict[str, Any]]], dict[str, int]]:
    """n prompts per task (fewer where the evaluation share runs out), groups taken in turn (modules,
    templates, kinds of document, question kinds), and the drop counts. A quarter of the translations
    (at most) are into English."""
    rng = random.Random(seed)
    en = L.pool("eval", seed, min_words, max_words, docs).get("en", [])
    tlo, thi = L.translation_bounds(min_words, max_words)
    tr = L.pool("eval", seed, tlo, thi, docs)
    stats = {f"dropped_{k}": 0 for k in banned} | {"too_long": 0}
    out: dict[str, list[dict[str, Any]]] = {}
    kind_of: Callable[[Any], str] = lambda it: it[0].doc.id.split(":")[0]  # noqa: E731
    for task in tasks:
        # (items, quota): fixed prompts (prompt, category, docs, reference) or (passage, builder, min words)
        plan: list[tuple[list[Any], int]]
        if task == "code":
            plan = [(interleave([(*x, None) for x in code_prompts(docs, rng)], lambda it: it[1], rng), n)]
        elif task == "math":
            plan = [(interleave([(q, c, (), a) for q, c, a in (math_problem(rng) for _ in range(20 * n))],
                                lambda it: it[1], rng), n)]
        elif task == "qa":
            plan = [(interleave([(*x, None) for x in qa_prompts(docs, rng)], lambda it: it[1], rng), n)]
        elif task == "summarisation":
            plan = [(interleave([(p, summary, min_words) for p in en], kind_of, rng), n)]
        elif task == "grounded":  # shorter passages (more of them): a retrieval prompt holds up to three
            glo, ghi = grounded_bounds(min_words, max_words)
            ps = L.pool("eval", seed, glo, ghi, docs).get("en", [])
            plan = [(interleave([(p, lambda x, r, ps=ps: rag(x, r, ps, max_words), glo) for p in ps], kind_of, rng), n)]
        else:
            foreign = [(p, translation, tlo) for lang in sorted(tr) if lang != "en" for p in tr[lang]]
            plan = [(interleave(foreign, lambda it: it[0].doc.lang, rng), n // 4),
                    (interleave([(p, translation, tlo) for p in tr.get("en", [])], kind_of, rng), n)]
        rows: list[dict[str, Any]] = []
        seen: set[str] = set()
        for items, quota in plan:
            for it in items:
                if len(rows) >= quota:
                    break
                ref = None
                if isinstance(it[0], str):
                    b, ref = L.Built(it[0], it[1], 0, it[2]), it[3]
                    ntok = fitter.count(b.prompt)
                    if ntok > fitter.max:
                        stats["too_long"] += 1
                        continue
                else:
                    p, fn, lo = it
                    bseed = rng.random()
                    fit = fitter.fit(lambda x, s=bseed, fn=fn: fn(x, random.Random(s)), p, lo)
                    if fit is None:
                        stats["too_long"] += 1
                        continue
                    b, ntok = fit
                if b.prompt in seen:
                    continue
                seen.add(b.prompt)
                g = L.grams(b.prompt)
                hit = next((k for k, ban in banned.items() if g & ban), None)
                if hit:
                    stats[f"dropped_{hit}"] += 1
                    continue
                row: dict[str, Any] = {"prompt": b.prompt, "category": b.category, "task": task,
                                       "docs": list(b.docs), "words": b.words, "tokens": ntok}
                if ref is not None:
                    row["reference"] = [ref]
                rows.append(row)
        out[task] = rows
    return out, stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", required=True, help="folder for TASK.jsonl files ({prompt, category, task, docs, ...})")
    ap.add_argument("--n", type=int, default=80, help="prompts per task type")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", action="append", default=[], help="more training prompt JSONL files to hold out from")
    ap.add_argument("--min-input-words", type=int, default=150, help="shortest given text (translation: half)")
    ap.add_argument("--max-input-words", type=int, default=400, help="longest given text (translation: half)")
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="templated prompt tokens at most")
    ap.add_argument("--model", default="smollm2-135m", help="whose tokenizer and chat template count the tokens")
    ap.add_argument("--locale-dir", default="/usr/share/locale", help="gettext catalogues (LANG/LC_MESSAGES/*.mo)")
    ap.add_argument("--data-dir", default=None, help="the shared prompts.jsonl to hold out from "
                    "(default: $MLEAGLE_DATA_DIR or ../shared/data)")
    a = ap.parse_args(argv)
    from mleagle.engine.contract.config import data_dir

    ddir = Path(a.data_dir) if a.data_dir else data_dir()
    if not (ddir / "prompts.jsonl").is_file():
        L.log(f"error: no prompts.jsonl under {ddir} to hold the suite out from")
        return 2
    docs = L.documents(locale_dir=a.locale_dir)
    banned = banned_for_suite(ddir, [Path(x) for x in a.train], docs)
    suite, stats = make(a.n, a.seed, banned, docs, L.Fitter(L.tokenizer(a.model), a.max_prompt_tokens),
                        min_words=a.min_input_words, max_words=a.max_input_words)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for task, rows in suite.items():
        (out / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    short = [t for t, rows in suite.items() if len(rows) < a.n]
    toks = {t: statistics.median(r["tokens"] for r in rows) if rows else 0 for t, rows in suite.items()}
    L.log(f"{sum(map(len, suite.values()))} prompts -> {out}/: by task { {t: len(r) for t, r in suite.items()} }, "
          f"median templated tokens {toks}; " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in stats.items())
          + " (dropped: an 8-gram shared with that training set)"
          + (f"; short of {a.n}: {short}" if short else "")
          + "\n  evaluate: --eval-datasets " + ",".join(str(out / f"{t}.jsonl") for t in suite))
    return 0 if not short else 1


if __name__ == "__main__":
    sys.exit(main())
