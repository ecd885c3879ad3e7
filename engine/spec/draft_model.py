"""The MTP draft stack: S layers, each a decoder block fed by the hidden state and the next token.

Layer k at position p combines `hnorm(h_p)` and `enorm(embed(t_{p+k+1}))` through `eh_proj`, runs
one decoder block against its own KV pool (its block is layer 0 of that pool), and predicts
t_{p+k+2} through its own final norm and the target's shared LM head. In chain mode h is layer k-1's
output (the target's hidden for layer 0); in non-chain mode every layer takes the target's hidden.
Each layer is its own module so that each draft runner holds exactly one layer's weights.
"""

from __future__ import annotations

import torch
from torch import nn

from mleagle.engine.contract.config import ModelArch
from mleagle.engine.executor.forward_batch import ForwardBatch
from mleagle.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from mleagle.engine.layers.norm import RMSNorm
from mleagle.engine.layers.rope import RotaryEmbedding
from mleagle.engine.models.llama import DecoderLayer


class MTPLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, embed: VocabParallelEmbedding, lm_head: ParallelLMHead,
                 rope: RotaryEmbedding):
        super().__init__()
        h = arch.hidden_size
        self.enorm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, arch.rms_norm_eps, dtype)
        # eh_proj is replicated on every tensor-parallel rank: it is small (2H×H) and its output feeds
        # the block's column-parallel projections whole.
        self.eh_proj = nn.Linear(2 * h, h, bias=False, dtype=dtype)
        self.eh_proj.weight.requires_grad_(False)
        self.block = DecoderLayer(arch, 0, rope, dtype)
        self.norm = RMSNorm(h, arch.rms_norm_eps, dtype)
        # Shared with the target, held by reference (not registered), so weights exist once.
        self._shared = (embed, lm_head)

    num_kv_layers = 1

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        embed, _ = self._shared
        if batch.hidden_in is None:
            raise ValueError("a draft layer needs input hidden states")
        x = self.eh_proj(torch.cat([self.enorm(embed(batch.input_ids)), self.hnorm(batch.hidden_in)], dim=-1))
        h, res = self.block(batch.positions, x, None, batch)
        return h + res  # the block's output stream, before this layer's final norm

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._shared[1](self.norm(h))


class DraftStack(nn.Module):
    def __init__(self, arch: ModelArch, num_layers: int, chain: bool, dtype: torch.dtype,
                 embed: VocabParallelEmbedding, lm_head: ParallelLMHead, rope: RotaryEmbedding):
        super().__init__()
        self.arch, self.chain = arch, chain
        self.layers = nn.ModuleList(MTPLayer(arch, dtype, embed, lm_head, rope) for _ in range(num_layers))

    def __len__(self) -> int:
        return len(self.layers)
