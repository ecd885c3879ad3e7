"""Counter-based randomness: every draw is a function of (request seed, output position, stream).

A request's samples therefore do not depend on which batch it runs in, on the order of requests,
or on whether it was decoded one token at a time or verified speculatively: the same (seed,
position) gives the same noise. Streams separate the uses (the token draw, a rejection-sampling
uniform, a draft's own draw) so they are independent.
"""

from __future__ import annotations

import torch

STREAM_TOKEN, STREAM_ACCEPT, STREAM_DRAFT, STREAM_RESIDUAL = 0, 1, 2, 3
_M = (1 << 64) - 1


def mix(*xs: int) -> int:
    """SplitMix64 over the inputs: a well-spread 63-bit seed for torch.Generator."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & _M)) & _M
        h = (h + 0x9E3779B97F4A7C15) & _M
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
        h = z ^ (z >> 31)
    return h & ((1 << 63) - 1)


def generator(seed: int, pos: int, stream: int = STREAM_TOKEN, it: int = 0) -> torch.Generator:
    """`it` separates repeated draws for the same position (speculative iterations re-draft it)."""
    g = torch.Generator()
    g.manual_seed(mix(seed, pos, stream, it))
    return g


def exponential(seed: int, pos: int, n: int, stream: int = STREAM_TOKEN, it: int = 0) -> torch.Tensor:
    """n iid Exp(1) draws; argmax(p / E) samples from p (the exponential race)."""
    return torch.empty(n).exponential_(generator=generator(seed, pos, stream, it))


def uniform(seed: int, pos: int, stream: int, it: int = 0) -> float:
    return float(torch.rand(1, generator=generator(seed, pos, stream, it)))
