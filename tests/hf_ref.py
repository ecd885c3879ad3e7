"""Shared reference helpers for the engine tests: HF transformers' Llama built from the engine's own
weights, and a way to read the engine's logits through its own worker and runner.

`hf_model(engine)` builds `transformers.LlamaForCausalLM(LlamaConfig(...))` from the arch the loader
reports and `load_state_dict`s the same dequantised tensors the engine loaded (loaded again through
`mleagle.engine.model_loader.load_model`, so the two models share nothing at runtime).
`EngineProbe` drives the engine's worker/runner directly: it allocates a request slot with the
engine's memory manager, builds EXTEND batches with `worker.prefill_batch` (all logit rows) and DECODE
DECODE batches from host lists (`build_batch`), runs them on `engine.target.forward`, and frees everything after.
No engine math is replaced: these are the same batches and forwards the scheduler uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mleagle.engine.contract.sampling_params import SamplingParams
from mleagle.engine.core.engine import Engine
from mleagle.engine.core.request import Req
from mleagle.engine.entrypoints.bench import hf_build
from mleagle.engine.executor.forward_batch import ForwardMode, build_batch


def hf_model(engine: Engine, dtype: torch.dtype = torch.float32):
    """HF Llama with the engine's weights (same loader, same dequantised tensors), in eval mode."""
    torch.manual_seed(0)
    return hf_build(engine, dtype)


@torch.inference_mode()
def hf_logits(model, ids: Sequence[int]) -> torch.Tensor:
    """[len(ids), V] float32 logits of one full HF forward."""
    return model(torch.tensor([list(ids)])).logits[0].float()


@torch.inference_mode()
def hf_greedy(model, ids: Sequence[int], n: int) -> list[int]:
    """n greedy tokens from HF generate with no EOS stop (every step is a plain argmax)."""
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                          bos_token_id=None)
    out = model.generate(torch.tensor([list(ids)]), generation_config=gc, use_cache=True)
    return out[0, len(ids):].tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest per-row relative L2 error of a against the reference b."""
    a, b = a.float().reshape(-1, a.shape[-1]), b.float().reshape(-1, b.shape[-1])
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


class EngineProbe:
    """Logits from the engine's own worker and runner for one request, chunk by chunk or token by token."""

    def __init__(self, engine: Engine, prompt: Sequence[int], room: int = 128, rid: str = "probe"):
        self.e = engine
        self.req = Req(rid, list(prompt), SamplingParams(temperature=0, prompt_logprobs=0), seed=0)
        if not engine.mem.ensure(self.req, len(prompt) + room):
            raise RuntimeError("probe: KV pool too small")

    def prefill(self, chunk: int = 0) -> torch.Tensor:
        """Every prompt row's logits [n, V], prefilled in chunks of `chunk` tokens (0 = whole)."""
        r, w = self.req, self.e.worker
        rows = []
        while r.prefilling:
            c = r.fill_len - r.kv_len if chunk <= 0 else min(chunk, r.fill_len - r.kv_len)
            batch = w.prefill_batch([r], [c])
            assert batch.all_logit_rows
            rows.append(self.e.target.forward(batch).logits)
            r.kv_len += c
        return torch.cat(rows)

    def decode(self, token: int) -> torch.Tensor:
        """Feed one token through a DECODE batch; its [V] logits."""
        r = self.req
        r.output_ids.append(token)
        if not self.e.mem.ensure(r, r.kv_len + 1):
            raise RuntimeError("probe: KV pool too small")
        b = build_batch(ForwardMode.DECODE, input_ids=[token], req_pool_indices=[r.req_pool_idx], prefix_lens=[r.kv_len],
                        extend_lens=[1], req_to_token=self.e.worker.r2t, device=self.e.device, rids=(r.rid,))
        out = self.e.target.forward(self.e.target.bind(b)).logits
        r.kv_len += 1
        return out[0]

    def close(self) -> None:
        self.e.mem.release(self.req)
