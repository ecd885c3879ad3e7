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


def test_sharded_bf16_checkpoint_round_trips(tmp_path: Path) -> None:
    """Size-capped shards (each under the cap, listed in the config), bf16 storage, stale shards removed,
    a missing shard a clear error; v1 folders (one draft.safetensors, no `files`) still load."""
    import json

    from safetensors.torch import load_file

    src = Engine(tiny_cfg(), draft="random:3:4")
    d = tmp_path / "sharded"
    files = save_draft(src.draft_stack, d, torch.float32, max_shard_bytes=1)  # one tensor per file
    assert len(files) > 3
    files = save_draft(src.draft_stack, d, torch.bfloat16, max_shard_bytes=64 * 1024)
    cfg = json.loads((d / "draft_config.json").read_text())
    assert cfg["version"] == 3 and cfg["dtype"] == "bfloat16" and cfg["files"] == [f.name for f in files]
    assert sorted(p.name for p in d.glob("*.safetensors")) == sorted(cfg["files"])  # the float32 shards are gone
    assert all(f.stat().st_size <= 64 * 1024 + 2048 for f in files)
    assert all(t.dtype == torch.bfloat16 for f in files for t in load_file(str(f)).values())
    e = Engine(tiny_cfg(), draft=str(d))
    for a, b in zip(_layers(src), _layers(e)):
        assert all(torch.equal(a[k].to(torch.bfloat16).float(), b[k]) for k in a)
    assert [c.token_ids for c in e.generate(PROMPTS, GREEDY)] == [c.token_ids for c in Engine(tiny_cfg()).generate(PROMPTS, GREEDY)]
    (d / files[1].name).unlink()
    with pytest.raises(EngineInputError, match="missing"):
        Engine(tiny_cfg(), draft=str(d))
    # version 1: what earlier mleagle versions wrote
    v1 = tmp_path / "v1"
    save_draft(src.draft_stack, v1)
    cfg = json.loads((v1 / "draft_config.json").read_text())
    for k in ("files", "dtype", "draft_vocab_size"):
        cfg.pop(k)
    cfg["version"] = 1
    (v1 / "draft_config.json").write_text(json.dumps(cfg))
    assert _layers(Engine(tiny_cfg(), draft=str(v1))) and len(_layers(Engine(tiny_cfg(), draft=str(v1)))) == 3


def test_reduced_vocabulary_checkpoint_serves_exactly(tmp_path: Path) -> None:
    """vocab_ids travel with the checkpoint; greedy and seeded sampled outputs equal target-only ones
    (rejection sampling with q scattered back to the target's vocabulary); bad ids are clear errors."""
    import json

    from safetensors.torch import load_file, save_file

    src = Engine(tiny_cfg(), draft="random:2:3")
    src.draft_stack.set_vocab(torch.arange(1, 256, 3))
    d = tmp_path / "small"
    save_draft(src.draft_stack, d, torch.bfloat16)
    e = Engine(tiny_cfg(), draft=str(d))
    assert torch.equal(e.draft_stack.vocab_ids, torch.arange(1, 256, 3))
    assert e.draft_stack.layers[0].compute_logits(torch.randn(2, 64)).shape == (2, 85)
    ref = Engine(tiny_cfg())
    assert [c.token_ids for c in e.generate(PROMPTS, GREEDY)] == [c.token_ids for c in ref.generate(PROMPTS, GREEDY)]
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3)
    out = [c.token_ids for c in e.generate(PROMPTS, sampled)]
    assert out == [c.token_ids for c in e.generate(PROMPTS, sampled)]  # seeded: reproducible
    assert e.worker.stats.num_verify > 0
    w = load_file(str(d / "draft.safetensors"))
    w["vocab_ids"] = torch.tensor([1, 1, 2])
    save_file(w, str(d / "draft.safetensors"))
    with pytest.raises(EngineInputError, match="config says 85"):
        Engine(tiny_cfg(), draft=str(d))
    cfg = json.loads((d / "draft_config.json").read_text())
    (d / "draft_config.json").write_text(json.dumps(cfg | {"draft_vocab_size": 3}))
    with pytest.raises(EngineInputError, match="must not repeat"):
        Engine(tiny_cfg(), draft=str(d))


def test_default_draft_of_the_model(tmp_path: Path) -> None:
    """`[model] default_draft` is used when no draft is given; `--draft none` turns it off; a missing
    default folder is a clear error; a relative default is relative to the package root."""
    from mleagle.engine.contract.config import REPO_ROOT, resolve_draft
    from mleagle.engine.executor.worker import TargetWorker
    from mleagle.engine.spec.worker import SpecWorker

    d = tmp_path / "shipped"
    save_draft(Engine(tiny_cfg(), draft="random:2:9").draft_stack, d, torch.bfloat16)
    cfg = tiny_cfg()
    cfg.model.default_draft = str(d)
    e = Engine(cfg)
    assert isinstance(e.worker, SpecWorker) and e.draft_is_default and e.cfg.engine.draft == str(d)
    assert [c.token_ids for c in e.generate(PROMPTS, GREEDY)] == [c.token_ids for c in Engine(tiny_cfg()).generate(PROMPTS, GREEDY)]
    off = Engine(cfg, draft="none")
    assert type(off.worker) is TargetWorker and not off.draft_is_default
    assert isinstance(Engine(cfg, draft="random:1").worker, SpecWorker)
    cfg.model.default_draft = "drafts/no-such-draft"
    assert resolve_draft(cfg) == (str(REPO_ROOT / "drafts" / "no-such-draft"), True)
    with pytest.raises(EngineInputError, match=r"default draft of t .*drafts/no-such-draft.*--draft none"):
        Engine(cfg)
    assert type(Engine(cfg, draft="none").worker) is TargetWorker


def test_default_draft_loads_only_on_its_devices(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`default_draft_devices` keeps the default draft off where it does not pay (and says so at start-up);
    an explicit draft loads anywhere. The SmolLM2 config ships its draft for every device (the
    speculation policy decides per iteration whether it runs)."""
    from mleagle.engine.contract.config import REPO_ROOT, load_config, resolve_draft
    from mleagle.engine.executor.worker import TargetWorker
    from mleagle.engine.spec.worker import SpecWorker

    d = tmp_path / "shipped"
    save_draft(Engine(tiny_cfg(), draft="random:2:9").draft_stack, d, torch.bfloat16)
    cfg = tiny_cfg()
    cfg.model.default_draft = str(d)
    cfg.model.default_draft_devices = ["cuda"]
    assert resolve_draft(cfg, "cuda") == (str(d), True) and resolve_draft(cfg, "cpu") == ("none", True)
    with caplog.at_level("INFO", logger="mleagle.engine"):
        e = Engine(cfg, device="cpu")
    assert type(e.worker) is TargetWorker and e.draft_is_default
    assert f"default draft {d} not loaded on cpu (it pays on: cuda); --draft {d}" in caplog.text
    assert isinstance(Engine(cfg, device="cpu", draft=str(d)).worker, SpecWorker)
    smol = load_config("smollm2-135m")
    shipped = REPO_ROOT / "drafts" / "smollm2-135m-mtp5"
    assert resolve_draft(smol, "cuda") == resolve_draft(smol, "cpu") == (str(shipped), True)
    assert smol.engine.spec_policy == "auto"
    assert (shipped / "draft_config.json").is_file()


def test_reduced_vocabulary_sampling_keeps_the_target_distribution() -> None:
    """Rejection sampling with a draft that proposes only half the vocabulary (q scattered back, zero
    elsewhere): the samples still follow the target's distribution (the chi-square check of
    test_spec_sampling), with both accepted and rejected drafts."""
    from tests.engine.test_spec_sampling import CASES, PROMPT, N, V, _chi2_pvalue, _engine, _expected

    sp = CASES[1]
    e = _engine("random:2:4")
    e.draft_stack.set_vocab(torch.tensor([0, 2, 3, 5, 7, 8, 11]))
    out = e.generate([PROMPT] * N, [sp.model_copy(update={"seed": 1000 + i, "max_new_tokens": 3}) for i in range(N)])
    counts = torch.zeros(V, V, dtype=torch.int64)
    for c in out:
        counts[c.token_ids[1], c.token_ids[2]] += 1
    st = e.worker.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert _chi2_pvalue(counts, _expected(sp)) > 1e-3


def test_a_drafts_own_auto_depths_are_the_policys_choices_unless_the_engine_names_some(tmp_path: Path) -> None:
    """`auto_depths` in draft_config.json are the depths `auto` chooses between for that draft; the
    engine's `spec_depths` override them, a shortened `spec_steps` drops those past it, other policies
    ignore them, and a malformed list is refused when the draft loads."""
    import json

    d = tmp_path / "deep"
    save_draft(Engine(tiny_cfg(), draft="random:4:3").draft_stack, d)
    cfg = json.loads((d / "draft_config.json").read_text())
    (d / "draft_config.json").write_text(json.dumps(cfg | {"auto_depths": [0, 2, 4]}))

    def choices(**over: object) -> list[int]:
        return list(Engine(tiny_cfg(), draft=str(d), **over).worker.policy.choices)  # type: ignore[attr-defined]

    assert choices(spec_policy="auto") == [0, 2, 4]
    assert choices(spec_policy="auto", spec_depths=[3]) == [0, 3, 4]
    assert choices(spec_policy="auto", spec_steps=3) == [0, 2, 3]
    assert choices(spec_policy="always") == [0, 4]  # unused by `always`, which runs S every iteration
    e = Engine(tiny_cfg(), draft=str(d), spec_policy="auto")
    want = [c.token_ids for c in Engine(tiny_cfg()).generate(PROMPTS, GREEDY)]
    assert [c.token_ids for c in e.generate(PROMPTS, GREEDY)] == want
    # A device type of its own: the CPU engine takes its list, another device's leaves it alone.
    (d / "draft_config.json").write_text(json.dumps(cfg | {"auto_depths": [0, 2, 4],
                                                           "auto_depths_by_device": {"cpu": [0, 1, 4], "cuda": [0, 4]}}))
    assert choices(spec_policy="auto") == [0, 1, 4]
    (d / "draft_config.json").write_text(json.dumps(cfg | {"auto_depths": [0, 2, 4], "auto_depths_by_device": {"cuda": [0, 4]}}))
    assert choices(spec_policy="auto") == [0, 2, 4]
    (d / "draft_config.json").write_text(json.dumps(cfg | {"auto_depths": [0, 7]}))
    with pytest.raises(EngineInputError, match="auto_depths"):
        Engine(tiny_cfg(), draft=str(d), spec_policy="auto")
    (d / "draft_config.json").write_text(json.dumps(cfg | {"auto_depths_by_device": {"cuda": [0, 9]}}))
    with pytest.raises(EngineInputError, match="auto_depths_by_device"):
        Engine(tiny_cfg(), draft=str(d), spec_policy="auto")
