"""The MTP draft stack: S layers, each a decoder block fed by the hidden state and the next token.

Layer k at position p combines `hnorm(h_p)` and `enorm(embed(t_{p+k+1}))` through `eh_proj`, runs
one decoder block against its own KV pool (its block is layer 0 of that pool), and predicts
t_{p+k+2} through its own final norm and the target's shared LM head. In chain mode h is layer k-1's
output (the target's hidden for layer 0); in non-chain mode every layer takes the target's hidden.
Each layer is its own module so that each draft runner holds exactly one layer's weights.

Under tensor parallelism the block is sharded like the target's layers (same layout: all-reduce, or
token-scattered with its own reduce-scatters and gathers), or replicated whole on every rank
(`replicate`, for heads that do not divide): then only the shared embedding and head communicate and
the draft runs in the all-reduce layout. `eh_proj` is replicated either way.
"""

from __future__ import annotations

import torch
from torch import nn

from mleagle.engine.contract.config import ModelArch
from mleagle.engine.distributed import LOCAL, Comm, TPGroup, comm_for
from mleagle.engine.executor.forward_batch import ForwardBatch
from mleagle.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from mleagle.engine.layers.norm import RMSNorm
from mleagle.engine.layers.rope import RotaryEmbedding
from mleagle.engine.models.llama import DecoderLayer


class MTPLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, embed: VocabParallelEmbedding, lm_head: ParallelLMHead,
                 rope: RotaryEmbedding, layout: str = "all_reduce", replicate: bool = False):
        super().__init__()
        h = arch.hidden_size
        self.tp: TPGroup = embed.tp  # the group the shared embedding and head communicate over
        self.replicate = replicate
        self.layout = "all_reduce" if replicate else layout
        self.enorm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, arch.rms_norm_eps, dtype)
        # eh_proj is replicated on every tensor-parallel rank: it is small (2H×H) and its output feeds
        # the block's column-parallel projections whole.
        self.eh_proj = nn.Linear(2 * h, h, bias=False, dtype=dtype)
        self.eh_proj.weight.requires_grad_(False)
        self.block = DecoderLayer(arch, 0, rope, dtype, LOCAL if replicate else self.tp)
        self.norm = RMSNorm(h, arch.rms_norm_eps, dtype)
        # Shared with the target, held by reference (not registered), so weights exist once.
        self._shared = (embed, lm_head)

    num_kv_layers = 1

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
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hin)], dim=-1))
        h, res = self.block(batch.positions, x, None, batch, c)
        s = h + res  # the block's output stream, before this layer's final norm
        return c.gather_tokens(s) if c.scattered else s

    def logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self._shared[1].logits(hidden, batch.logit_rows, self.norm, self.comm(batch))

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._shared[1](self.norm(h))


class DraftStack(nn.Module):
    def __init__(self, arch: ModelArch, num_layers: int, chain: bool, dtype: torch.dtype,
                 embed: VocabParallelEmbedding, lm_head: ParallelLMHead, rope: RotaryEmbedding,
                 layout: str = "all_reduce", replicate: bool = False):
        super().__init__()
        self.arch, self.chain = arch, chain
        self.layers = nn.ModuleList(MTPLayer(arch, dtype, embed, lm_head, rope, layout, replicate)
                                    for _ in range(num_layers))

    def __len__(self) -> int:
        return len(self.layers)
