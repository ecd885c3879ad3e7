"""The constrained path of a step: which rows are constrained, their masks, and the matchers' advance.

A worker owns one `ConstrainRuntime` and calls it at a few delimited points (each a line or two, so
they move with the worker's code): `begin(reqs, flags)` when it builds a batch's flags (a batch with
no constrained request gets its flags back unchanged and the fast paths run untouched; otherwise
`RowFlags.constrained` takes it off the plain-greedy paths); `mask(x)` on the logits a batch samples or
verifies from; `commit(emitted, n_emit)` once a step's tokens are known, which reads them to the host
(the host-synchronised part) and advances each matcher; and under speculation `draft_logits` /
`draft_accept` around every draft step. A greedy iteration whose constraints are grammars only runs
on graphs instead (`TargetWorker._capture_masked`): the host writes the masks into static device
buffers between the graphs' pieces (`fill_static`: a decode step's rows, or a verify's rows from the
masks its drafting kept; `fill_draft_static`: a draft step's), `mask` inside a graph reads them
(`static`), and the worker commits the tokens to the matchers from the results on the host
(`commit_rows`).

Masks: a decode or first-token row gets the mask of the matcher as it is. Draft step k (proposing
d_{k+1}) gets the mask after the committed tokens and d_1..d_k, which the matcher accepted
tentatively; that is exactly the mask verify row k needs, so each is kept, with one more after d_S
for the bonus row, and the matcher rolls the S drafts back. Verify rows then use those masks: greedy
acceptance compares drafts with the masked argmax and rejection sampling uses the masked target
distribution (and the masked draft distribution the drafts were drawn from), so constrained
speculation emits what constrained target-only decoding does (greedy) or its distribution
(sampling). A draft the grammar refuses (possible only where a draft step had nothing allowed in the
draft's vocabulary) is rejected by its verify row, whose mask excludes it. A row with nothing allowed
is left unmasked (softmax over nothing is NaN): a grammar that has terminated (its stop token
accepted) or reached a dead end then refuses the token at the commit, whose cut (how many of the
step's tokens the grammar took, and why the request ends: "stop" or "constraint_unsatisfiable")
travels with that step's result to `settle`. `logit_bias` rides the same path as an additive row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mleagle.engine.constrain.bitmask import DeviceMask, apply_bitmask
from mleagle.engine.sampling.processor import RowFlags

FULL = -1  # an int32 word with every bit set: all 32 tokens allowed
Cut = tuple[int, str] | None  # of a step's tokens for one request: (how many the grammar took, why it ends)


@dataclass(eq=False)
class RequestConstraint:
    """One request's constraint state: its matcher (None for a logit bias alone) and bias."""

    matcher: Any = None
    bias: torch.Tensor | None = None  # [V] float32 on the device, 0 where no bias
    verify_masks: np.ndarray | None = None  # [S+1, words] int32: the next verify's rows (kept by its drafting)
    tentative: int = 0  # draft tokens the matcher accepted tentatively (rolled back after drafting)
    alive: bool = True  # drafting: the matcher accepted every draft so far
    finish: str | None = None  # why the request ends (once a commit cut it): "stop" or "constraint_unsatisfiable"


class ConstrainRuntime:
    def __init__(self, vocab: int, device: torch.device, steps: int = 0) -> None:
        self.vocab, self.device, self.steps = vocab, device, steps
        self.words = (vocab + 31) // 32
        self.dmask = DeviceMask(vocab, device)
        self._tokenizer: Any = None
        self._strings: list[str] | None = None
        self._stop_ids: list[int] = []
        self._cache: Any = None  # GrammarCache, built at the first constraint (it imports xgrammar)
        self.batch: list[RequestConstraint | None] = []
        self.cuts: list[Cut] | None = None  # the last eager commit's (`take_cuts`)
        self._host = torch.empty(0, self.words, dtype=torch.int32)
        # Host time spent on grammar work (mask fills, accepts, rollbacks), and the steps it covered.
        self.host_s = 0.0
        self.host_steps = 0
        # The masked graphs' static mask buffer [rows, words] (`init_graph`), and whether the step being
        # built (or captured) reads its masks from there instead of filling them per call.
        self.gmask: torch.Tensor | None = None
        self._vstage = self._dstage = _Staging(0, self.words, self.device)
        self.static = False

    # --- set-up ------------------------------------------------------------------------------
    def bind(self, tokenizer: Any, stop_ids: Sequence[int]) -> None:
        """The engine's tokenizer and stop ids (a grammar's end is one of its stop tokens)."""
        self._tokenizer, self._stop_ids, self._cache = tokenizer, sorted(stop_ids), None

    def use_vocab(self, token_strings: Sequence[str], stop_ids: Sequence[int]) -> None:
        """A raw vocabulary instead (token i is that text): models without a tokenizer, and tests."""
        self._strings, self._stop_ids, self._cache = list(token_strings), sorted(stop_ids), None

    @property
    def grammars(self) -> Any:
        if self._cache is None:
            from mleagle.engine.constrain.compiler import GrammarCache

            self._cache = GrammarCache(self.vocab, tokenizer=self._tokenizer, token_strings=self._strings,
                                       stop_ids=self._stop_ids)
        return self._cache

    # --- per request -------------------------------------------------------------------------
    def check(self, params: Any) -> None:
        """Compile (or find cached) the request's grammar; `ConstraintError` names what is wrong."""
        from mleagle.engine.constrain.compiler import ConstraintError

        if params.logit_bias:
            bad = [t for t in params.logit_bias if t >= self.vocab]
            if bad:
                raise ConstraintError(f"logit_bias token ids must be below {self.vocab}: {bad[:5]}", "logit_bias")
        if params.structured_outputs is not None:
            if params.min_new_tokens > 0:
                # The grammar may need its stop token before min_tokens, which would then be banned.
                raise ConstraintError("cannot be combined with structured output", "min_new_tokens")
            self.grammars.get(params.structured_outputs)

    def new_state(self, params: Any) -> RequestConstraint | None:
        if not params.constrained:
            return None
        c = RequestConstraint()
        if params.structured_outputs is not None:
            c.matcher = self.grammars.matcher(self.grammars.get(params.structured_outputs))
        if params.logit_bias:
            b = torch.zeros(self.vocab, dtype=torch.float32)
            ids = torch.tensor(list(params.logit_bias.keys()), dtype=torch.int64)
            b[ids] = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
            c.bias = b.to(self.device)
        return c

    # --- per batch ---------------------------------------------------------------------------
    def begin(self, reqs: Sequence[Any], flags: RowFlags) -> RowFlags:
        """The batch a step is about to run; its flags, marked constrained when any request is."""
        cons = [r.constraint for r in reqs]
        if all(c is None for c in cons):
            self.batch = []
            return flags
        self.batch = cons
        return dataclasses.replace(flags, constrained=True)

    def _buf(self, rows: int) -> torch.Tensor:
        if self._host.shape[0] < rows:
            n = max(rows, 2 * self._host.shape[0])
            self._host = torch.empty(n, self.words, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        h = self._host[:rows]
        h.fill_(FULL)
        return h

    def _fill(self, c: RequestConstraint, out: torch.Tensor, row: int, view: np.ndarray | None = None) -> None:
        """The matcher's next-token mask into out[row] (a host tensor; `view`, its numpy view, when the
        caller has it); left all-allowed when the matcher has terminated or allows nothing (see the
        module docstring: the commit then ends the request). The checks go through numpy: a torch op
        on one row costs several times the matcher's own fill."""
        m = c.matcher
        if m is None or m.is_terminated():
            return
        m.fill_next_token_bitmask(out, row)
        a = out.numpy() if view is None else view
        if not a[row].any():
            a[row] = FULL

    # --- the masked graphs (greedy iterations whose constraints are grammars only) ---------------
    def init_graph(self, rows: int) -> None:
        """The static mask buffer the masked graphs read, `rows` logit rows (allocated once, before capture)."""
        self.gmask = torch.full((rows, self.words), FULL, dtype=torch.int32, device=self.device)
        self._vstage = _Staging(rows, self.words, self.device)
        self._dstage = _Staging(rows, self.words, self.device)

    def graphable(self) -> bool:
        """Can this batch's decode step replay the masked graph: grammars only (a logit bias is a
        per-request tensor the graph does not hold)?"""
        return self.gmask is not None and not any(c is not None and c.bias is not None for c in self.batch)

    @contextlib.contextmanager
    def static_masks(self) -> Iterator[None]:
        """Within it, `mask` reads the static buffer and `commit` is left to the worker: a masked graph's
        capture, and its replay (which, emulated, runs the body)."""
        self.static = True
        try:
            yield
        finally:
            self.static = False

    def fill_static(self, bs: int, width: int = 1) -> None:
        """Every row's mask into the static buffer before a masked replay: a decode step's row per request
        (the matcher's next-token mask), or a verify's `width` rows per request, the masks its drafting
        kept (`draft_masks`; `verify_masks`). Pad rows keep whatever they held: their tokens are never
        committed."""
        assert self.gmask is not None
        t0 = time.perf_counter()
        h = self._vstage.take(bs * width)
        hv = h.numpy()
        for i, c in enumerate(self.batch[:bs]):
            if c is None:
                continue
            if width == 1:
                self._fill(c, h, i, hv)
            elif c.matcher is not None:
                assert c.verify_masks is not None and c.verify_masks.shape[0] == width, "verify without drafted masks"
                hv[i * width : (i + 1) * width] = c.verify_masks
        self._vstage.put(self.gmask)
        self._tick(t0)

    def fill_draft_static(self, k: int, bs: int, out: torch.Tensor) -> None:
        """Draft step k's masks (`draft_masks`) into a static device buffer `out` [rows, words], for a
        masked draft step's graph."""
        t0 = time.perf_counter()
        self._draft_rows(k, self._dstage.take(bs))
        self._dstage.put(out)
        self._tick(t0)

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        """x [bs·w, V] (w = 1: decode or first token; w = S+1: verify rows) → masked and biased. In a
        masked graph (`static`) the rows' masks are the static buffer's, filled before the replay."""
        if self.static:
            assert self.gmask is not None
            return apply_bitmask(x, self.dmask.expand(self.gmask[: x.shape[0]]))
        bs = len(self.batch)
        rows = x.shape[0]
        w = rows // bs
        t0 = time.perf_counter()
        h = self._buf(rows)
        hv = h.numpy()
        for i, c in enumerate(self.batch):
            if c is None or c.matcher is None:
                continue
            if w == 1:
                self._fill(c, h, i, hv)
            else:
                assert c.verify_masks is not None and c.verify_masks.shape[0] == w, "verify without drafted masks"
                hv[i * w : (i + 1) * w] = c.verify_masks
        self._tick(t0)
        x = apply_bitmask(x, self.dmask.allowed(h))
        return self._bias(x, w)

    def _bias(self, x: torch.Tensor, w: int, vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
        if not any(c is not None and c.bias is not None for c in self.batch):
            return x
        zero = torch.zeros(self.vocab, dtype=torch.float32, device=x.device)
        b = torch.stack([c.bias if c is not None and c.bias is not None else zero for c in self.batch])
        if vocab_ids is not None:
            b = b[:, vocab_ids]
        if w > 1:
            b = b.repeat_interleave(w, 0)
        return x + b.to(x.dtype)

    def commit(self, emitted: torch.Tensor, n_emit: torch.Tensor) -> None:
        """The step's tokens, emitted [bs, W] (the first n_emit[b] valid), into each matcher; the cuts
        wait in `cuts` for the worker to attach to the step's results (`take_cuts`)."""
        if self.static:  # a masked graph: the worker commits the tokens once they are on the host
            return
        em, ne = emitted.tolist(), n_emit.view(-1).tolist()
        self.cuts = self.commit_rows([row[: int(n)] for row, n in zip(em, ne)])

    def take_cuts(self) -> list[Cut] | None:
        """The last `commit`'s cuts (once): they belong to the step being sent back."""
        cuts, self.cuts = self.cuts, None
        return cuts

    def commit_rows(self, rows: Sequence[Sequence[int]],
                    batch: Sequence[RequestConstraint | None] | None = None) -> list[Cut]:
        """`commit` from host lists: each batch row's new tokens (`batch`: the constraint states of an
        earlier launch; default the current batch's). Returns each row's cut: None when the grammar took
        every token, else (how many it took, why the request ends): a token it refuses, or any token
        after it terminated. The cut travels with that step's result to `settle` (a later step's
        commit may run before the scheduler applies this one). A request whose grammar has ended takes
        nothing more."""
        t0 = time.perf_counter()
        cuts: list[Cut] = []
        for i, c in enumerate(self.batch if batch is None else batch):
            cut: Cut = None
            if c is not None and c.matcher is not None:
                m = c.matcher
                if c.finish is not None:
                    cut = (0, c.finish)
                else:
                    for j, t in enumerate(rows[i]):
                        if m.is_terminated():
                            cut = (j, "stop")
                        elif not m.accept_token(int(t)):
                            cut = (j, "constraint_unsatisfiable")
                        if cut is not None:
                            c.finish = cut[1]
                            break
            cuts.append(cut)
        self._tick(t0)
        self.host_steps += 1
        return cuts

    # --- draft steps -------------------------------------------------------------------------
    def draft_logits(self, logits: torch.Tensor, k: int, vocab_ids: torch.Tensor | None) -> torch.Tensor:
        """Draft step k's logits [bs, Vd] (a reduced draft vocabulary maps through `vocab_ids`), masked
        to what the grammar allows after the committed tokens and drafts d_1..d_k. The target-vocabulary
        mask is kept as verify row k's."""
        t0 = time.perf_counter()
        h = self._buf(len(self.batch))
        self._draft_rows(k, h)
        self._tick(t0)
        allowed = self.dmask.allowed(h)
        if vocab_ids is not None:
            allowed = allowed[:, vocab_ids]
        # A row with nothing allowed in the draft's vocabulary drafts unmasked (its verify row rejects it).
        allowed = allowed | ~allowed.any(-1, keepdim=True)
        return self._bias(apply_bitmask(logits, allowed), 1, vocab_ids)

    def _draft_rows(self, k: int, h: torch.Tensor) -> None:
        """Draft step k's masks into h [bs, words] (all-allowed rows left as they are): the grammar
        after the committed tokens and d1..dk; each is kept as the next verify's row k."""
        hv = h.numpy()
        for i, c in enumerate(self.batch[: h.shape[0]]):
            if c is None or c.matcher is None:
                continue
            if k == 0:
                c.tentative, c.alive = 0, True
                if c.verify_masks is None:
                    c.verify_masks = np.empty((self.steps + 1, self.words), dtype=np.int32)
                c.verify_masks.fill(FULL)
            if c.alive:
                self._fill(c, h, i, hv)
                assert c.verify_masks is not None
                c.verify_masks[k] = hv[i]

    def draft_accept(self, drafts: torch.Tensor | Sequence[int], k: int,
                     batch: Sequence[RequestConstraint | None] | None = None) -> None:
        """Draft step k's tokens [bs] into the matchers, tentatively; after the last step, the bonus
        row's mask, then the drafts rolled back (`batch`: the constraint states of an earlier launch)."""
        t0 = time.perf_counter()
        d = drafts.view(-1).tolist() if isinstance(drafts, torch.Tensor) else list(drafts)
        last = k == self.steps - 1
        for i, c in enumerate(self.batch if batch is None else batch):
            if c is None or c.matcher is None:
                continue
            m = c.matcher
            if c.alive:
                if not m.is_terminated() and m.accept_token(int(d[i])):
                    c.tentative += 1
                else:
                    c.alive = False
            if last:
                if c.alive:
                    assert c.verify_masks is not None
                    self._fill(c, torch.from_numpy(c.verify_masks), self.steps, c.verify_masks)
                if c.tentative:
                    m.rollback(c.tentative)
                c.tentative = 0
        self._tick(t0)

    def _tick(self, t0: float) -> None:
        self.host_s += time.perf_counter() - t0


class _Staging:
    """A pinned host buffer for masks on their way to a static device buffer: the copy does not wait for
    the work queued ahead of it on the stream (a forward the masks were filled beside), and its event
    says when the host buffer may be refilled."""

    def __init__(self, rows: int, words: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.full((rows, words), FULL, dtype=torch.int32, pin_memory=self.cuda and rows > 0)
        self.copied: torch.cuda.Event | None = None
        self.rows = 0

    def take(self, rows: int) -> torch.Tensor:
        """The first `rows` rows, all-allowed, once the last copy has read them."""
        if self.copied is not None:
            self.copied.synchronize()
        self.rows = rows
        h = self.host[:rows]
        h.fill_(FULL)
        return h

    def put(self, dev: torch.Tensor) -> None:
        dev[: self.rows].copy_(self.host[: self.rows], non_blocking=self.cuda)
        if self.cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()


def settle(req: Any, res: Any) -> str | None:
    """After a step, for the scheduler: drop the tokens the request's grammar refused from `res` (its
    cut, `res.grammar_cut`), and say why the request must end (None: it goes on)."""
    cut = res.grammar_cut
    if req.constraint is None or cut is None:
        return None
    n, why = cut
    if n < len(res.tokens):
        del res.tokens[n:]
        if res.logprobs is not None:
            del res.logprobs[n:]
    return why
