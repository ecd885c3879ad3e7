"""Token bitmasks on the device: xgrammar's packed int32 rows (bit j of word i allows token 32·i + j)
turned into a boolean mask and applied to logits.

One small function, device-agnostic torch (the CPU path and CUDA alike), so it can sit inside a step
without a kernel of its own. The host fills an int32 buffer; `DeviceMask` keeps one static device
buffer per runtime for it (grown when a larger batch comes, never per step) and one shift table, so a
step allocates only the unpacked mask and the masked logits.
"""

from __future__ import annotations

import torch


class DeviceMask:
    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.words = (vocab + 31) // 32
        self.device = device
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)
        self._buf = torch.empty(0, self.words, dtype=torch.int32, device=device)

    def allowed(self, host: torch.Tensor) -> torch.Tensor:
        """[rows, words] int32 on the host → [rows, vocab] bool on the device (True: allowed)."""
        rows = host.shape[0]
        if self._buf.shape[0] < rows:
            self._buf = torch.empty(max(rows, 2 * self._buf.shape[0]), self.words, dtype=torch.int32, device=self.device)
        dev = self._buf[:rows]
        dev.copy_(host)  # blocking: the host buffer is refilled by the next call
        return self.expand(dev)

    def expand(self, dev: torch.Tensor) -> torch.Tensor:
        """[rows, words] int32 already on the device → [rows, vocab] bool (device ops only: a captured
        graph runs this on its static mask buffer)."""
        bits = (dev.unsqueeze(-1) >> self._shifts) & 1
        return bits.view(dev.shape[0], -1)[:, : self.vocab].bool()


def apply_bitmask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits with every token not allowed at -inf (a new tensor: callers keep the raw logits for
    logprobs, which report the model's own distribution)."""
    return logits.masked_fill(~allowed, float("-inf"))
