"""Draft checkpoints: mleagle's own format round-trips, and MiMo / DeepSeek MTP namings import."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine, EngineInputError
from mleagle.engine.spec.checkpoint import layer_state, parse_spec, save_draft
from tests.spec_helpers import tiny_cfg

PROMPTS = [[3, 9, 27, 81, 5], [7, 1, 4]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


def _layers(e: Engine) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().clone() for k, v in layer_state(e.draft_stack, k).items()} for k in range(len(e.draft_stack))]


def _hf_names(w: dict[str, torch.Tensor], final_norm: str) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in w.items():
        if k == "norm.weight":
            out[final_norm] = v
        else:
            out[k.removeprefix("block.")] = v
    return out


@pytest.mark.parametrize("style", ["own", "mimo", "deepseek"])
def test_checkpoint_loads_the_same_weights(tmp_path: Path, style: str) -> None:
    src = Engine(tiny_cfg(), draft="random:2:7")
    want = _layers(src)
    d = tmp_path / style
    if style == "own":
        save_draft(src.draft_stack, d)
    else:
        d.mkdir()
        n = src.arch.num_hidden_layers
        flat = {}
        for k, w in enumerate(want):
            if style == "mimo":
                flat.update({f"model.mtp.layers.{k}.{name}": t for name, t in _hf_names(w, "final_layernorm.weight").items()})
            else:
                flat.update({f"model.layers.{n + k}.{name}": t for name, t in _hf_names(w, "shared_head.norm.weight").items()})
        flat["model.embed_tokens.weight"] = torch.zeros(1)  # target tensors beside the MTP ones are ignored
        save_file({k: v.contiguous() for k, v in flat.items()}, str(d / "model.safetensors"))
    e = Engine(tiny_cfg(), draft=str(d))
    got = _layers(e)
    assert len(got) == 2
    for a, b in zip(want, got):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [c.token_ids for c in e.generate(PROMPTS, GREEDY)] == [c.token_ids for c in Engine(tiny_cfg()).generate(PROMPTS, GREEDY)]


def test_bad_drafts_are_clear_errors(tmp_path: Path) -> None:
    for spec in ("random:0", "random:x", "random:2:1:sideways"):
        with pytest.raises(ValueError):
            parse_spec(spec)
    with pytest.raises(EngineInputError, match="not a folder"):
        Engine(tiny_cfg(), draft=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineInputError, match="no MTP layers"):
        Engine(tiny_cfg(), draft=str(tmp_path / "empty"))
    with pytest.raises(EngineInputError, match="exceeds"):
        Engine(tiny_cfg(), draft="random:2", spec_steps=3)
