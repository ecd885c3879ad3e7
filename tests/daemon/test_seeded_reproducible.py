"""A seeded sampled request is reproducible with the draft and the prefix cache on (issue 22, finding 3).

The real server: SmolLM2 on the CPU with the 3-layer trained draft loaded (`--draft drafts/smollm2-135m-mtp3`)
and the prefix cache on. Each prompt is sent twice with the same `temperature` and `seed`: the first is
a cache miss, the second a hit (its prefix, and so the draft layers' KV, comes from the first request).
Before seeded requests drew their tokens from their own (seed, position) tape, rejection sampling's
draws depended on the drafts, and the drafts on the cached draft KV: the pairs differed. Now every pair
is equal, and equal to the same request on a server without the draft."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from tests.daemon_helpers import ROOT, ServerProc  # noqa: E402

PROMPTS = ["Write a haiku about the sea.", "Give me three names for a cat.", "Describe a sunrise in one sentence."]
KW = dict(model="smollm2-135m", max_tokens=16, temperature=0.8, seed=7)


def _server(draft: str) -> ServerProc:
    s = ServerProc("--config", "smollm2-135m", "--draft", draft, "--max-total-tokens", "4096",
                   "--max-running-requests", "4", "--threads", "1")
    s.wait_healthy(90)
    return s


def _texts(s: ServerProc, twice: bool) -> list[list[str]]:
    oai = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
    out = []
    for p in PROMPTS:
        msgs = [{"role": "user", "content": p}]
        runs = [oai.chat.completions.create(messages=msgs, **KW) for _ in range(2 if twice else 1)]  # type: ignore[call-overload]
        out.append([r.choices[0].message.content for r in runs])
    return out


def test_seeded_pairs_equal_across_cache_miss_and_hit_with_the_draft() -> None:
    s = _server(f"{ROOT}/drafts/smollm2-135m-mtp3")
    try:
        pairs = _texts(s, twice=True)
        hits = s.engine()["stats"]["prefix_cache"]["hits"]
    finally:
        assert s.terminate() == 0, s.log()
    assert hits > 0  # the second of each pair really was a cache hit
    assert all(a == b for a, b in pairs), pairs
    ref = _server("none")
    try:
        plain = _texts(ref, twice=False)
    finally:
        assert ref.terminate() == 0, ref.log()
    assert [p[0] for p in pairs] == [p[0] for p in plain]  # and what target-only sampling gives
