"""Counter-based randomness on the device: every draw is a pure function of (seed, position, stream, iteration).

A request's samples therefore do not depend on which batch it runs in, on the order of requests, on
the device, or on whether it was decoded one token at a time or verified speculatively: the same
(seed, position) gives the same noise. Streams separate the uses (the token draw, a rejection-sampling
uniform, a draft's own draw, the residual draw) so they are independent; the iteration separates
re-drafts of one position. The generator is SplitMix64's finaliser over int64 tensors (torch's int64
multiply wraps; shifts are made logical with a mask), so a whole batch's noise is a handful of
elementwise kernels with no host round trip and no generator state to carry or to capture in a graph.
"""

from __future__ import annotations

import torch

STREAM_TOKEN, STREAM_ACCEPT, STREAM_DRAFT, STREAM_RESIDUAL = 0, 1, 2, 3
_M = (1 << 64) - 1


def _i64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    x &= _M
    return x - (1 << 64) if x >= 1 << 63 else x


GOLDEN = _i64(0x9E3779B97F4A7C15)
M1 = _i64(0xBF58476D1CE4E5B9)
M2 = _i64(0x94D049BB133111EB)
STREAM_SALT = _i64(0xD1B54A32D192ED03)
ITER_SALT = _i64(0x8CB92BA72F3D8DD7)


def mix(*xs: int) -> int:
    """SplitMix64 over Python ints (host side: default per-request seeds from the engine seed)."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & _M)) & _M
        h = (h + 0x9E3779B97F4A7C15) & _M
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
        h = z ^ (z >> 31)
    return h & ((1 << 63) - 1)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _fmix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * M1
    z = (z ^ _srl(z, 27)) * M2
    return z ^ _srl(z, 31)


def keys(seed: torch.Tensor, pos: torch.Tensor, stream: int | torch.Tensor, it: torch.Tensor | int = 0) -> torch.Tensor:
    """One int64 key per row from its (seed, position, stream, iteration); all arguments broadcast."""
    h = _fmix(seed + GOLDEN)
    h = _fmix(h ^ (pos + GOLDEN))
    h = _fmix(h ^ (stream * STREAM_SALT + GOLDEN) if isinstance(stream, torch.Tensor) else h ^ _i64(stream * STREAM_SALT + GOLDEN))
    it_t = it if isinstance(it, torch.Tensor) else torch.full_like(h, it)
    return _fmix(h ^ (it_t * ITER_SALT + GOLDEN))


_IDX: dict[tuple[str, int], torch.Tensor] = {}


def _index(n: int, device: torch.device) -> torch.Tensor:
    k = (str(device), n)
    t = _IDX.get(k)
    if t is None:
        t = _IDX[k] = (torch.arange(1, n + 1, dtype=torch.int64, device=device) * GOLDEN)
    return t


def uniform(key: torch.Tensor, n: int) -> torch.Tensor:
    """[R] keys → [R, n] float32 uniforms in (0, 1), 24 bits each (never exactly 0 or 1)."""
    z = _fmix(key.view(-1, 1) + _index(n, key.device).view(1, -1))
    return (_srl(z, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def exponential(key: torch.Tensor, n: int) -> torch.Tensor:
    """[R] keys → [R, n] iid Exp(1) draws: argmax(p / E) samples from p (the exponential race)."""
    return -torch.log(uniform(key, n))
