"""The MTP draft stack: S layers, each a decoder block fed by the hidden state and the next token.

Layer k at position p combines `hnorm(h_p)` and `enorm(embed(t_{p+k+1}))` through `eh_proj`, runs
its decoder blocks (one by default; `blocks` > 1 gives a step more depth) against its own KV pool
(block i is layer i of that pool), and predicts t_{p+k+2} through its own final norm and the draft
head. In chain mode h is layer k-1's output (the target's hidden for layer 0); in non-chain mode every
layer takes the target's hidden. Each layer is its own module so that each draft runner holds exactly
one layer's weights.

Fused target features (EAGLE-3's idea, `aux_layers`): the target's last hidden state is shaped for
predicting the next token, and drops context the token after it needs. A chain draft may also read
the residual streams after some earlier target layers: the target then returns [T, H·(1+A)] (its last
stream, then the A others; `LlamaForCausalLM.aux_layers`), and layer 0 adds
`aux_proj(anorm_i(aux_i) ...)` to its `eh_proj` input. `aux_proj` starts at zero in training, so a
draft grown from one without these features starts exactly where that one was.

The draft head is the target's LM head, or its rows for a reduced draft vocabulary (`vocab_ids`,
the target ids the draft can propose, stored with the checkpoint): the head is most of a draft
step's cost at a small hidden size (SmolLM2: 49152×576 against ~4.2M weights in the layer), so a
draft that only proposes frequent tokens is cheaper per step. `compute_logits` then returns [R, Vd]
logits over the draft vocabulary; `DraftHead.to_target_ids` maps the chosen indices back to target
ids and `DraftHead.scatter_probs` puts draft probabilities back in the target's vocabulary (zero
outside the draft vocabulary, which keeps rejection sampling exact: the draft never proposes those).

Under tensor parallelism the block is sharded like the target's layers (same layout: all-reduce, or
token-scattered with its own reduce-scatters and gathers), or replicated whole on every rank
(`replicate`, for heads that do not divide): then only the shared embedding and head communicate and
the draft runs in the all-reduce layout. `eh_proj` is replicated either way. The full-vocabulary draft
head is the target's vocab-parallel head (its logit rows gathered like the target's); a reduced head
is replicated: its rows are collected once from every rank's vocabulary shard, and every rank computes
the same [R, Vd] logits from the same hidden states with no communication.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mleagle.engine.contract.config import ModelArch
from mleagle.engine.distributed import LOCAL, Comm, TPGroup, comm_for
from mleagle.engine.executor.forward_batch import ForwardBatch
from mleagle.engine.kernels import fused_layers_on
from mleagle.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding, vocab_shard
from mleagle.engine.layers.linear import linear
from mleagle.engine.layers.module_list import ModuleListOf
from mleagle.engine.layers.norm import RMSNorm
from mleagle.engine.layers.rope import RotaryEmbedding
from mleagle.engine.models.llama import DecoderLayer


class DraftHead(nn.Module):
    """The draft's LM head: the target's own (`vocab_ids` None) or a gathered copy of its rows.

    One instance is shared by every layer of a stack. With `vocab_ids`, `weight` is [Vd, H], a copy made
    from the target head at construction (a per-step gather would cost what the subset saves): code that
    edits the target head afterwards calls `refresh()` (on every rank: under tensor parallelism the copy
    is collected from every rank's vocabulary shard).
    """

    vocab_ids: torch.Tensor | None
    weight: torch.Tensor | None

    def __init__(self, lm_head: ParallelLMHead, vocab_ids: torch.Tensor | None = None):
        super().__init__()
        self._target = (lm_head,)  # by reference, not registered: the target owns it
        self.target_vocab_size = lm_head.vocab_size
        if vocab_ids is None:
            self.register_buffer("vocab_ids", None, persistent=False)
            self.register_buffer("weight", None, persistent=False)
            return
        ids = torch.as_tensor(vocab_ids, dtype=torch.int64).flatten()
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= lm_head.vocab_size:
            raise ValueError(f"draft vocab_ids must be non-empty ids in [0, {lm_head.vocab_size})")
        if ids.unique().numel() != ids.numel():
            raise ValueError("draft vocab_ids must not repeat an id")
        self.register_buffer("vocab_ids", ids.to(lm_head.weight.device), persistent=False)
        self.register_buffer("weight", self._rows(), persistent=False)

    @torch.no_grad()
    def _rows(self) -> torch.Tensor:
        """The target head's rows `vocab_ids` [Vd, H]. Vocab-parallel: each rank holds the rows of its
        shard and zeros elsewhere, and a sum over ranks puts every row together on every rank (exact:
        each row has one non-zero contribution)."""
        head = self._target[0]
        w, g, ids = head.weight.detach(), head.tp, self.vocab_ids
        assert ids is not None
        if g.size == 1:
            return w[ids].clone()
        start, per = vocab_shard(head.vocab_size, g)
        mine = (ids >= start) & (ids < start + per)
        out = w[torch.where(mine, ids - start, 0)] * mine.unsqueeze(-1).to(w.dtype)
        return g.all_reduce(out.contiguous())

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-gather the rows after the target head's weights changed (loading, tests that edit weights)."""
        if self.vocab_ids is not None:
            self.weight = self._rows()

    @property
    def size(self) -> int:
        """Vd: the number of logit columns `forward` produces."""
        return self.target_vocab_size if self.vocab_ids is None else int(self.vocab_ids.numel())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return self._target[0](x)
        return linear(x, self.weight)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor, norm: nn.Module, comm: Comm) -> torch.Tensor:
        """The final norm and the head over the logit rows of `hidden` [T, H] (every rank holds every
        row): the target head's vocab-parallel path, or the replicated reduced head computed on every
        rank alike (no gather: the rows and the head are the same everywhere)."""
        if self.weight is None:
            return self._target[0].logits(hidden, rows, norm, comm)
        return linear(norm(hidden[rows]), self.weight)

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices (any shape) → target token ids."""
        return idx if self.vocab_ids is None else self.vocab_ids[idx]

    def scatter_probs(self, q: torch.Tensor) -> torch.Tensor:
        """[..., Vd] draft probabilities → [..., V] over the target vocabulary (0 outside the draft's)."""
        if self.vocab_ids is None:
            return q
        out = q.new_zeros(*q.shape[:-1], self.target_vocab_size)
        return out.index_copy_(-1, self.vocab_ids, q)


class MTPLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, embed: VocabParallelEmbedding, lm_head: ParallelLMHead,
                 rope: RotaryEmbedding, layout: str = "all_reduce", replicate: bool = False,
                 head: DraftHead | None = None, blocks: int = 1, aux: int = 0):
        super().__init__()
        if blocks < 1 or aux < 0:
            raise ValueError(f"a draft layer needs blocks >= 1 and aux >= 0 (got {blocks}, {aux})")
        h = arch.hidden_size
        self.hidden_size = h
        self.tp: TPGroup = embed.tp  # the group the shared embedding and head communicate over
        self.replicate = replicate
        self.layout = "all_reduce" if replicate else layout
        self.enorm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, arch.rms_norm_eps, dtype)
        # eh_proj (and aux_proj) are replicated on every tensor-parallel rank: they are small (2H×H, A·H×H)
        # and their output feeds the block's column-parallel projections whole.
        self.eh_proj = nn.Linear(2 * h, h, bias=False, dtype=dtype)
        self.eh_proj.weight.requires_grad_(False)
        self.aux = aux
        if aux:
            self.anorm = ModuleListOf(RMSNorm(h, arch.rms_norm_eps, dtype) for _ in range(aux))
            self.aux_proj = nn.Linear(aux * h, h, bias=False, dtype=dtype)
            self.aux_proj.weight.requires_grad_(False)
        tp = LOCAL if replicate else self.tp
        self.blocks = ModuleListOf(DecoderLayer(arch, i, rope, dtype, tp) for i in range(blocks))
        self.norm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self._nw: torch.Tensor | None = None  # the input norms' weights stacked (fuse_kernel)
        self._nw_key: tuple[tuple[int, int], ...] = ()
        # Shared with the target, held by reference (not registered), so weights exist once.
        self._shared = (embed, lm_head)
        # The draft head, shared by every layer of the stack (registered: it moves with .to()).
        self.head = head if head is not None else DraftHead(lm_head)

    @property
    def block(self) -> DecoderLayer:
        """The first (usually only) decoder block."""
        return self.blocks[0]

    @property
    def num_kv_layers(self) -> int:
        return len(self.blocks)

    @property
    def hidden_in_size(self) -> int:
        """Width of the input hidden states: H, or H·(1+A) for a layer fed fused target features."""
        return self.hidden_size * (1 + self.aux)

    @property
    def tp_size(self) -> int:
        return self.tp.size

    def comm(self, batch: ForwardBatch) -> Comm:
        return comm_for(self.tp, self.layout, batch) if self.tp.size > 1 else Comm(LOCAL)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        embed, _ = self._shared
        if batch.hidden_in is None:
            raise ValueError("a draft layer needs input hidden states")
        c = self.comm(batch)
        if c.scattered:  # this rank's token rows of both inputs; the block gathers what it needs
            e, hin = c.scatter_tokens(embed(batch.input_ids, reduce=False)), c.shard_tokens(batch.hidden_in)
        else:
            e, hin = embed(batch.input_ids), batch.hidden_in
        x = self.fuse(e, hin)
        h, res = None, None
        for b in self.blocks:
            h, res = b(batch.positions, x if h is None else h, res, batch, c)
        assert h is not None and res is not None
        s = h + res  # the last block's output stream, before this layer's final norm
        return c.gather_tokens(s) if c.scattered else s

    def fuse(self, e: torch.Tensor, hin: torch.Tensor) -> torch.Tensor:
        """The first block's input from the token embedding rows `e` [T, H] and the input hidden [T, H·(1+A)]."""
        if hin.shape[-1] != self.hidden_in_size:
            raise ValueError(f"draft layer expects input hidden states of width {self.hidden_in_size}, got {hin.shape[-1]}")
        if e.dim() == 2 and fused_layers_on(e) and not self.eh_proj.weight.requires_grad:
            return self.fuse_kernel(e, hin)
        return self.fuse_ref(e, hin)

    def fuse_kernel(self, e: torch.Tensor, hin: torch.Tensor) -> torch.Tensor:
        """`fuse_ref` in two or three launches (serving on CUDA): every input norm at once into one
        [T, H·(2+A)] buffer, then eh_proj and, accumulated onto it, aux_proj (instead of 2+A norms, two
        concatenations, two GEMMs and an add)."""
        from mleagle.engine.kernels.norm import group_rmsnorm

        h = self.hidden_size
        x = group_rmsnorm(e, hin, self._norm_weights(), self.enorm.eps)
        y = F.linear(x[:, : 2 * h], self.eh_proj.weight)
        return torch.addmm(y, x[:, 2 * h :], self.aux_proj.weight.t()) if self.aux else y

    def _norm_weights(self) -> torch.Tensor:
        """The input norms' weights stacked [2+A, H], made again whenever one of them changes (moved,
        reloaded or written in place)."""
        ws = [self.enorm.weight, self.hnorm.weight, *((n.weight for n in self.anorm) if self.aux else ())]
        key = tuple((w.data_ptr(), w._version) for w in ws)  # _version: torch's in-place write counter
        if self._nw_key != key:
            self._nw, self._nw_key = torch.stack([w.detach() for w in ws]), key
        assert self._nw is not None
        return self._nw

    def fuse_ref(self, e: torch.Tensor, hin: torch.Tensor) -> torch.Tensor:
        h = self.hidden_size
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hin[..., :h])], dim=-1))
        if self.aux:
            a = [n(hin[..., h * (i + 1) : h * (i + 2)]) for i, n in enumerate(self.anorm)]
            x = x + self.aux_proj(torch.cat(a, dim=-1))
        return x

    def logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """[R, Vd] logits of the batch's logit rows (the runner's path; `compute_logits` for given rows)."""
        return self.head.logits(hidden, batch.logit_rows, self.norm, self.comm(batch))

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[R, Vd] logits over the draft vocabulary (Vd = V without a reduced vocabulary)."""
        return self.head(self.norm(h))


class DraftStack(nn.Module):
    def __init__(self, arch: ModelArch, num_layers: int, chain: bool, dtype: torch.dtype,
                 embed: VocabParallelEmbedding, lm_head: ParallelLMHead, rope: RotaryEmbedding,
                 layout: str = "all_reduce", replicate: bool = False, vocab_ids: torch.Tensor | None = None,
                 blocks: int = 1, aux_layers: tuple[int, ...] = ()):
        super().__init__()
        aux_layers = tuple(int(i) for i in aux_layers)
        if aux_layers and not chain:
            raise ValueError("fused target features (aux_layers) need a chain draft: only layer 0 reads the target")
        bad = [i for i in aux_layers if not 0 <= i < arch.num_hidden_layers - 1]
        if bad or len(set(aux_layers)) != len(aux_layers):
            raise ValueError(f"aux_layers {list(aux_layers)} must be distinct target layers in "
                             f"0..{arch.num_hidden_layers - 2} (the last layer's stream is always read)")
        self.arch, self.chain = arch, chain
        self.aux_layers = aux_layers
        self.tied: dict[int, int] = {}  # layer → the layer whose blocks it runs (`tie_blocks`)
        self.head = DraftHead(lm_head, vocab_ids)
        self.layers = ModuleListOf(MTPLayer(arch, dtype, embed, lm_head, rope, layout, replicate, self.head, blocks,
                                             len(aux_layers) if k == 0 else 0)
                                    for k in range(num_layers))

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        return self.head.vocab_ids

    @property
    def blocks_per_layer(self) -> int:
        return self.layers[0].num_kv_layers

    def set_vocab(self, vocab_ids: torch.Tensor | None) -> None:
        """Give every layer a new shared head over `vocab_ids` (None: the target's whole vocabulary)."""
        self.head = DraftHead(self.head._target[0], vocab_ids)
        for m in self.layers:
            m.head = self.head

    def tie_blocks(self, tied: dict[int, int]) -> None:
        """Layer k runs layer tied[k]'s decoder blocks (the same modules: one set of weights, trained at
        every depth that runs it), keeping its own input projection and norms. Deeper steps then cost no
        storage but those few weights; each step still has its own runner and KV pool. Serving stacks
        load the blocks into each layer instead (`load_draft` copies them), which computes the same."""
        check_ties(tied, len(self.layers))
        for k, j in tied.items():
            self.layers[k].blocks = self.layers[j].blocks
        self.tied = dict(tied)

    def __len__(self) -> int:
        return len(self.layers)


def check_ties(tied: dict[int, int], layers: int) -> None:
    """A tie k → j needs 0 <= j < k < layers and j untied (one owner per set of blocks)."""
    for k, j in tied.items():
        if not 0 <= j < k < layers or j in tied:
            raise ValueError(f"tied blocks {k}->{j}: a layer may run the blocks of an earlier, untied layer "
                             f"(0 <= j < k < {layers})")
