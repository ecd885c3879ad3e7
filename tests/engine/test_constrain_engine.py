"""Structured output in the engine, on small built models (CPU, float32): greedy constrained output
with a draft equals constrained target-only token for token (mixed batches with free and biased
requests, chunked prefill, the prefix cache), every output obeys its grammar, the finish reasons of a
grammar that completes or dead-ends, free batches never touch the grammar path, and constrained
sampling with a draft keeps the masked target distribution (a chi-square test against the exact
table, which a broken verify mask fails).

The models have no tokenizer, so the grammar runtime gets a raw vocabulary (`use_vocab`): token i is
a short string over an alphabet with JSON's punctuation, so masks cut across multi-character tokens.
"""

from __future__ import annotations

import re

import pytest
import torch

from mleagle.engine.constrain.runtime import ConstrainRuntime
from mleagle.engine.contract.sampling_params import SamplingParams, StructuredOutputs
from mleagle.engine.core.engine import Engine
from mleagle.engine.sampling.processor import probs_from_logits, rows_from_params
from tests.engine.test_spec_sampling import PROMPT, V, _chi2_pvalue, _engine, _raw
from tests.spec_helpers import tiny_engine

ALPHA = 'abcdefghij0123456789{}":, '
STOP = 255


def vocab256() -> list[str]:
    return [ALPHA[i % len(ALPHA)] * (1 + i // len(ALPHA)) for i in range(STOP)] + [""]


def text(ids: list[int], strings: list[str]) -> str:
    return "".join(strings[t] for t in ids if t != STOP)


def constrained(e: Engine) -> Engine:
    e.worker.constrain.use_vocab(vocab256(), [STOP])
    return e


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "b": {"enum": ["ab", "cd"]}}, "required": ["a", "b"]}
CASES: list[tuple[list[int], dict]] = [
    ([1, 2, 3], {"regex": "[a-e]{3,12}"}),
    (list(range(5, 16)), {"regex": "(ab|cd|ee)+f"}),
    ([100], {"choice": ["abc", "aab", "bbbb", "jj"]}),
    ([7, 7, 7, 7, 7], {"json": SCHEMA}),
    (list(range(30, 47)), {"grammar": 'root ::= ("a" | "bb")+ "," [0-9]+'}),
    ([200, 3, 9, 41, 5, 6, 77, 8, 90], {"json_object": True}),
    ([12, 13], {}),  # free, in the same batch
]
PATTERNS = ["[a-e]{3,12}", "(ab|cd|ee)+f", "abc|aab|bbbb|jj", None, '(a|bb)+,[0-9]+', None, None]


def _params(n: int = 24) -> list[SamplingParams]:
    ps = []
    # A logit bias, logprobs and a repetition penalty beside the grammars: each takes its own path in
    # the sampler and the accept step, and the masks must compose with all of them.
    extras: dict[int, dict] = {2: {"logit_bias": {"3": 5.0, "40": -3.0}}, 1: {"logprobs": 2},
                               4: {"repetition_penalty": 1.3}}
    for i, (_, so) in enumerate(CASES):
        extra = extras.get(i, {})
        ps.append(SamplingParams(temperature=0, max_new_tokens=n, structured_outputs=StructuredOutputs(**so) if so else None,
                                 **extra))
    return ps


def _run(draft: str, **kw: object) -> tuple[list[list[int]], list[str | None], Engine]:
    e = constrained(tiny_engine(draft, **kw))
    out = e.generate([p for p, _ in CASES], _params())
    return [c.token_ids for c in out], [c.finish_reason for c in out], e


@pytest.mark.parametrize("chunk", [0, 4])
@pytest.mark.parametrize("draft", ["random:1", "random:2:1", "random:3:2:nochain"])
def test_greedy_constrained_equals_target_only(draft: str, chunk: int) -> None:
    ref, ref_fin, _ = _run("none", chunked_prefill_size=chunk)
    got, fin, e = _run(draft, chunked_prefill_size=chunk)
    assert got == ref and fin == ref_fin
    st = e.worker.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens  # both the accept and the reject paths ran
    strings = vocab256()
    for ids, f, pat, (_, so) in zip(ref, ref_fin, PATTERNS, CASES):
        if pat is not None and f == "stop":
            assert re.fullmatch(pat, text(ids, strings)), (text(ids, strings), pat)
        if "json" in so and f == "stop":
            import json

            obj = json.loads(text(ids, strings))
            assert isinstance(obj, dict)
            if so.get("json"):
                assert set(obj) == {"a", "b"} and 0 <= obj["a"] <= 999 and obj["b"] in ("ab", "cd")
    assert any(f == "stop" for f in ref_fin[:-1])  # some grammar completed


def test_prefix_cache_hits_keep_output() -> None:
    """The same constrained requests again, now starting at cached prefixes: the same tokens."""
    e = constrained(tiny_engine("random:2:1"))
    first = [c.token_ids for c in e.generate([p for p, _ in CASES], _params())]
    again = e.generate([p for p, _ in CASES], _params())
    assert [c.token_ids for c in again] == first
    assert e.scheduler.prefix_hits > 0


def test_finish_reasons() -> None:
    """A grammar that completes ends with "stop" at its stop token (here not one of the model's EOS
    ids, so the grammar ends it); one that reaches a state no token can continue ends
    "constraint_unsatisfiable" after the tokens it accepted."""
    strings = vocab256()
    for draft in ("none", "random:2:1"):
        e = constrained(tiny_engine(draft))
        done, dead = e.generate([[1, 2], [3, 4]], [
            SamplingParams(temperature=0, max_new_tokens=10, structured_outputs=StructuredOutputs(regex="ab")),
            # "x" is in no token: after "a" nothing can follow.
            SamplingParams(temperature=0, max_new_tokens=10, structured_outputs=StructuredOutputs(regex="ax"))])
        assert (text(done.token_ids, strings), done.token_ids[-1], done.finish_reason) == ("ab", STOP, "stop")
        assert (done.token_ids[:-1], dead.token_ids, dead.finish_reason) == ([0, 1], [0], "constraint_unsatisfiable")


def test_free_batches_never_take_the_grammar_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for name in ("mask", "commit", "draft_logits", "draft_accept"):
        orig = getattr(ConstrainRuntime, name)
        monkeypatch.setattr(ConstrainRuntime, name, lambda self, *a, _o=orig, _n=name: (calls.append(_n), _o(self, *a))[1])
    e = constrained(tiny_engine("random:2:1"))
    e.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_new_tokens=8))
    assert calls == [] and e.worker.constrain._cache is None  # xgrammar not even loaded
    e.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=8, structured_outputs=StructuredOutputs(regex="a+")))
    assert {"mask", "commit", "draft_logits", "draft_accept"} <= set(calls)


def test_bad_constraints_are_input_errors() -> None:
    from mleagle.engine.core.engine import EngineInputError

    e = constrained(tiny_engine())
    for so, param in ((StructuredOutputs(regex="a("), "structured_outputs.regex"),
                      (StructuredOutputs(json={"type": "nope"}), "structured_outputs.json"),
                      (StructuredOutputs(grammar="root ::= x"), "structured_outputs.grammar")):
        with pytest.raises(EngineInputError) as ei:
            e.add_request("r", [1, 2], SamplingParams(structured_outputs=so))
        assert ei.value.param == param
    with pytest.raises(EngineInputError) as ei:
        e.add_request("r", [1, 2], SamplingParams(logit_bias={999: 1.0}))
    assert ei.value.param == "logit_bias"


# --- sampling keeps the masked target distribution --------------------------------------------------
# 12 tokens "a".."k" and a stop token; o0 in a..h, o1 depends on o0, o2 in a..f: the masks change per
# prefix, so verify row j must use the mask after its own drafts.
LETTERS = [chr(ord("a") + i) for i in range(V - 1)] + [""]
REGEX = "(a[a-d]|b[e-h]|[c-h][c-j])[a-f]"


def _mask1(o0: int) -> list[int]:
    return list(range(0, 4)) if o0 == 0 else list(range(4, 8)) if o0 == 1 else list(range(2, 10))


def _expected(sp: SamplingParams) -> torch.Tensor:
    """The exact joint distribution of (o1, o2) under the grammar's masks, temperature and filters."""
    r0, r1, r2 = _raw()

    def probs(x: torch.Tensor, allowed: list[int]) -> torch.Tensor:
        m = torch.full_like(x, float("-inf"))
        m[:, allowed] = 0
        n = x.shape[0]
        return probs_from_logits(x + m, rows_from_params([sp] * n, [0] * n, [0] * n, V))

    p0 = probs(r0.view(1, V), list(range(8)))[0]
    joint = torch.zeros(V, V)
    for a in range(8):
        p1 = probs(r1[a].view(1, V), _mask1(a))[0]
        p2 = probs(r2[a], list(range(6)))  # [o1, o2]
        joint += p0[a] * p1.view(V, 1) * p2
    return joint


def _sample(draft: str, sp: SamplingParams, n: int = 2000) -> tuple[torch.Tensor, int, Engine]:
    e = _engine(draft)
    e.worker.constrain.use_vocab(LETTERS, [V - 1])
    so = StructuredOutputs(regex=REGEX)
    params = [sp.model_copy(update={"seed": 5000 + i, "max_new_tokens": 3, "structured_outputs": so}) for i in range(n)]
    out = e.generate([PROMPT] * n, params)
    counts = torch.zeros(V, V, dtype=torch.int64)
    bad = 0
    for c in out:
        s = "".join(LETTERS[t] for t in c.token_ids)
        if len(c.token_ids) != 3 or not re.fullmatch(REGEX, s):
            bad += 1
            continue
        counts[c.token_ids[1], c.token_ids[2]] += 1
    return counts, bad, e


SAMPLED = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)]


# Target-only once (it checks the expected table itself), speculation at both settings.
@pytest.mark.parametrize("draft,sp", [("random:2:4", SAMPLED[0]), ("random:2:4", SAMPLED[1]), ("none", SAMPLED[0])],
                         ids=["spec-t1", "spec-t0.7-p0.9", "target-t1"])
def test_constrained_sampling_keeps_masked_distribution(draft: str, sp: SamplingParams) -> None:
    counts, bad, e = _sample(draft, sp)
    assert bad == 0
    if draft != "none":
        st = e.worker.stats
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert _chi2_pvalue(counts, _expected(sp)) > 1e-3


def test_verify_rows_without_their_own_masks_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plausible bug, every verify row masked as its first (the committed state's mask): the
    samples must then break the grammar or the distribution."""
    orig = ConstrainRuntime.mask

    def first_row_only(self: ConstrainRuntime, x: torch.Tensor) -> torch.Tensor:
        for c in self.batch:
            if c is not None and c.verify_masks is not None:
                c.verify_masks[1:] = c.verify_masks[0]
        return orig(self, x)

    monkeypatch.setattr(ConstrainRuntime, "mask", first_row_only)
    counts, bad, _ = _sample("random:2:4", SAMPLED[0], n=1000)
    assert bad > 0 or _chi2_pvalue(counts, _expected(SAMPLED[0])) < 1e-6


@pytest.mark.parametrize("draft", ["none", "random:2:1"])
def test_overlap_is_off_while_a_constrained_request_runs(draft: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Overlap forced on (as on the GPU): constrained requests still get the synchronous schedule's
    tokens, because no step is launched before the one in flight has advanced the matchers; free
    requests alone still overlap."""
    sync = _run(draft)[0]
    e = constrained(tiny_engine(draft))
    e.scheduler.overlap = True
    launched_inflight: list[bool] = []
    orig = type(e.worker).launch

    def spy(self, reqs, plan=None):  # type: ignore[no-untyped-def]
        # Launched over a step in flight: fine for free requests alone, never with a constrained one.
        over = e.scheduler.inflight is not None
        launched_inflight.append(over)
        assert not (over and any(r.constraint is not None for r in reqs))
        return orig(self, reqs, plan)

    monkeypatch.setattr(type(e.worker), "launch", spy)
    out = e.generate([p for p, _ in CASES], _params())
    assert [c.token_ids for c in out] == sync
    launched_inflight.clear()
    e.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_new_tokens=12))
    assert any(launched_inflight)  # free batches keep overlapping


@pytest.mark.parametrize("draft", ["none", "random:2:1"])
def test_preempted_constrained_requests_resume_exactly(draft: str) -> None:
    """A pool too small for the load preempts requests mid-structure; each resumes with its matcher
    where it was (the matcher holds exactly the committed output), so outputs equal a roomy pool's."""
    prompts = [list(range(3 + i, 20 + i)) for i in range(12)]
    params = [p for _ in range(2) for p in _params(28)][:12]
    roomy = constrained(tiny_engine(draft))
    tight = constrained(tiny_engine(draft, max_total_tokens=256, max_running_requests=8))
    ref = [c.token_ids for c in roomy.generate(prompts, params)]
    got = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [c.token_ids for c in got] == ref


def _masked_replays(e: Engine) -> dict[int, int]:
    return {d: m.replays for d, m in e.worker.masked_graphs.items()}


@pytest.mark.parametrize(("draft", "policy"), [("none", "always"), ("random:2:1", "auto"), ("random:2:1", "always"),
                                               ("random:3:2:nochain", "cycle")])
def test_grammar_batches_replay_the_masked_graph_exactly(draft: str, policy: str) -> None:
    """Greedy iterations whose constraints are grammars only replay the grammar-masked graphs at every
    depth the policy runs (emulated: the forward half, the static mask buffer filled from the matchers
    (walked over the drafts at a drafting depth), then the masked half; the matchers fed from the
    results): the output equals constrained target-only's token for token, and the iterations count as
    replays. A batch with a logit bias, logprobs or penalties stays on the eager path, by reason."""
    gram = [(p, so) for p, so in CASES if so]
    params = [SamplingParams(temperature=0, max_new_tokens=20, structured_outputs=StructuredOutputs(**so)) for _, so in gram]
    ref = constrained(tiny_engine("none"))
    want = [c.token_ids for c in ref.generate([p for p, _ in gram], params)]
    e = constrained(tiny_engine(draft, graph_emulate=True, spec_policy=policy))
    # A constrained batch runs depth 0 or S (`cycle` too), so those are the masked graphs' depths.
    assert set(e.worker.masked_graphs) == {0, e.worker.full_depth} & set(e.worker.graph_depths()), e.graph_report
    misses: list[str | None] = []
    e.observers.append(lambda outs, rep: misses.append(rep.finished.iteration_miss) if rep.finished else None)
    got = [c.token_ids for c in e.generate([p for p, _ in gram], params)]
    assert got == want
    replays = _masked_replays(e)
    assert None in misses and sum(replays.values()) > 0
    if policy != "auto":  # a constrained batch runs the full depth (under `cycle` too)
        assert replays[e.worker.full_depth] > 0, replays
    if draft != "none":
        st = e.worker.stats
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens  # both the accept and the reject paths ran
    # A logit bias or logprobs beside the grammars: the eager path, with its reason.
    misses.clear()
    mixed = [*params[:2], SamplingParams(temperature=0, max_new_tokens=20, logit_bias={"3": 5.0}, logprobs=1)]
    got = [c.token_ids for c in e.generate([p for p, _ in gram[:3]], mixed)]
    assert got == [c.token_ids for c in ref.generate([p for p, _ in gram[:3]], mixed)]
    if draft == "none":
        assert "logit bias" in misses and None not in misses[: misses.index("logit bias") + 1]


@pytest.mark.parametrize(("draft", "policy"), [("none", "always"), ("random:2:1", "auto"), ("random:2:1", "always")])
def test_masked_steps_overlap_their_forward_with_the_grammar_work(draft: str, policy: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Overlap forced on with (emulated) graphs: a grammar-masked decode step launches its forward half
    while the step in flight finishes, and its masks are filled once the matchers have that step's
    tokens; the output equals the synchronous engine's token for token, and nothing is left held."""
    from tests.spec_helpers import all_free

    gram = [(p, so) for p, so in CASES if so]
    params = [SamplingParams(temperature=0, max_new_tokens=20, structured_outputs=StructuredOutputs(**so)) for _, so in gram]
    want = [c.token_ids for c in constrained(tiny_engine("none")).generate([p for p, _ in gram], params)]
    e = constrained(tiny_engine(draft, graph_emulate=True, spec_policy=policy))
    e.scheduler.overlap = True
    splits: list[int] = []
    orig = type(e.worker).launch_split

    def spy(self, reqs, plan=None):  # type: ignore[no-untyped-def]
        s = orig(self, reqs, plan)
        splits.append(int(s is not None))
        return s

    monkeypatch.setattr(type(e.worker), "launch_split", spy)
    got = [c.token_ids for c in e.generate([p for p, _ in gram], params)]
    assert got == want
    assert sum(splits) >= 5 and sum(_masked_replays(e).values()) >= sum(splits)
    assert e.scheduler.inflight is None and all_free(e)
