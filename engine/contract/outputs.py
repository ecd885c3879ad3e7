"""What the engine hands back per request and step: token deltas, logprobs, finish and spec stats.

Torch-free pydantic models, so the same values cross the daemon–engine socket as JSON unchanged.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

# "constraint_unsatisfiable": a structured-output request whose grammar allows no next token (see
# mleagle.engine.constrain); a grammar that completes ends with "stop" at its stop token.
FinishReason = Literal["stop", "length", "abort", "error", "constraint_unsatisfiable"]


class TokenLogprob(BaseModel):
    """Logprob of one emitted (or prompt) token and its top-N alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)


class SpecStats(BaseModel):
    """Speculative decoding statistics of one request (or of the engine, summed)."""

    num_verify: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_depth: list[int] = Field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    @property
    def accept_len(self) -> float:
        """Mean tokens emitted per verify forward: accepted drafts + the bonus token."""
        return (self.num_accepted_tokens + self.num_verify) / self.num_verify if self.num_verify else 0.0

    def summary(self) -> dict[str, object]:
        return {
            "accept_len": round(self.accept_len, 4),
            "accepted_per_depth": list(self.accepted_per_depth),
            "num_verify": self.num_verify,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "draft_time_s": round(self.draft_time_s, 6),
            "verify_time_s": round(self.verify_time_s, 6),
        }


# A delta that is new tokens and nothing else (a running request without logprobs: most deltas), as
# `(rid, token_ids, num_prompt_tokens, num_output_tokens, num_cached_tokens)`: a JSON array on the wire,
# which the daemon's event loop parses for about half what the `RequestOutput` object costs.
TokenDelta = tuple[str, list[int], int, int, int]


class RequestOutput(BaseModel):
    """One step's delta for one request. `token_ids`/`logprobs` are the tokens new since the last delta."""

    rid: str
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # Prompt tokens whose KV came from the prefix cache (OpenAI's usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0
    spec: SpecStats | None = None
    # On a request's first delta with tokens: when the engine added it, first scheduled it and applied
    # its first tokens, in time.monotonic() seconds (one clock for every process of a host); the daemon
    # appends when the step's message was sent and received, and splits its TTFT by them.
    timing: list[float] | None = None

    def token_delta(self) -> TokenDelta | None:
        """This delta as a `TokenDelta` when it says nothing but its new tokens (so nothing is lost)."""
        if self.finished or self.logprobs is not None or self.prompt_logprobs is not None or self.error is not None \
                or self.spec is not None or self.finish_reason is not None or self.matched_stop is not None \
                or self.timing is not None:
            return None
        return self.rid, self.token_ids, self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens


class TokenOutput:
    """A delta that is new tokens and nothing else, read like the `RequestOutput` it stands for (its
    other fields are class attributes here, unset). The scheduler makes one for a running request's step
    whenever nothing else is to say (most deltas: a `RequestOutput` costs its validator, about 2 us a
    request a step), the engine's message carries it as a `TokenDelta`, and the daemon's engine client
    rebuilds it from that."""

    __slots__ = ("num_cached_tokens", "num_output_tokens", "num_prompt_tokens", "rid", "token_ids")
    finished = False
    logprobs = prompt_logprobs = finish_reason = matched_stop = error = spec = timing = None

    def __init__(self, rid: str, token_ids: list[int], num_prompt_tokens: int, num_output_tokens: int,
                 num_cached_tokens: int) -> None:
        self.rid, self.token_ids, self.num_prompt_tokens = rid, token_ids, num_prompt_tokens
        self.num_output_tokens, self.num_cached_tokens = num_output_tokens, num_cached_tokens

    def token_delta(self) -> TokenDelta:
        return self.rid, self.token_ids, self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens

    def __repr__(self) -> str:
        return f"TokenOutput(rid={self.rid!r}, token_ids={self.token_ids!r}, num_output_tokens={self.num_output_tokens})"


# What the engine hands back per request and step: a whole `RequestOutput`, or new tokens only.
StepOutput = RequestOutput | TokenOutput
