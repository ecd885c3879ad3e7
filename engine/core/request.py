"""A request's life in the engine: its tokens, KV holdings, sampling state, logprobs and finish.

`fill_ids` (prompt + output) are the request's tokens; `kv_len` counts those whose KV is in the pools,
the first `cached_len` of them in pages the prefix cache lent it (computed by an earlier request).
While `kv_len < prefill_len` the request is prefilling (possibly in chunks, or again after a
preemption, over prompt + output but the last token); after that it decodes, feeding its last token. `emitted` marks how much of the output has been handed
out as deltas, so a preempted and resumed request never repeats or loses a token.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from mleagle.engine.contract.outputs import FinishReason, SpecStats, TokenLogprob
from mleagle.engine.contract.sampling_params import SamplingParams

_ARRIVALS = itertools.count()


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SpecCounts:
    """A request's speculation counts, added to at every iteration it takes part in: plain slots (a
    pydantic model's attribute set costs about six times as much, per request per step). `stats()` is
    the `SpecStats` its last delta carries."""

    __slots__ = ("accepted_per_depth", "draft_time_s", "num_accepted_tokens", "num_draft_tokens", "num_verify",
                 "verify_time_s")

    def __init__(self, steps: int) -> None:
        self.num_verify = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.verify_time_s = self.draft_time_s = 0.0
        self.accepted_per_depth = [0] * steps

    def stats(self) -> SpecStats:
        """The counts as `SpecStats` (the slots are its fields, by name; the list copied)."""
        return SpecStats(**{k: list(v) if isinstance(v := getattr(self, k), list) else v for k in self.__slots__})


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    req_pool_idx: int | None = None
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    prefix_node: Any = None  # the prefix-cache node this request's cached prefix ends at (locked)
    cached_len: int = 0  # leading tokens whose KV pages belong to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens served from the cache at first admission (usage report)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    emitted: int = 0
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    abort_requested: bool = False
    num_preemptions: int = 0
    # Creation order (LIFO preemption picks the newest): a counter, not a clock, so every
    # tensor-parallel rank (which creates the same requests in the same order) picks the same victim.
    arrival: int = field(default_factory=lambda: next(_ARRIVALS))
    # When the engine took the request, first scheduled it and applied its first token (time.monotonic,
    # the clock every process of one host shares): the first delta carries them (`RequestOutput.timing`).
    added_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    queued_step: int = 0  # the scheduler's step count when it joined the waiting queue (`prefill_wait`)
    spec: SpecCounts | None = None  # its speculation counts (a speculative engine's); `stats()` on its end
    stop_state: Any = None  # the stop-string matcher's per-request state
    draft_state: Any = None  # the speculative worker's per-request state (prefill hidden states)
    constraint: Any = None  # structured output / logit bias state (mleagle.engine.constrain.runtime)
    state_slot: int | None = None  # the slot whose device state rows were filled for this request
    epoch: int = 0  # bumped when the request leaves the running set: results launched before are dropped

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def fill_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_len(self) -> int:
        """Tokens whose KV prefill computes: all of fill_ids but the last output token, which is the
        next decode step's input (a resumed request continues exactly where it was preempted)."""
        return self.fill_len - 1 if self.output_ids else self.fill_len

    @property
    def prefilling(self) -> bool:
        n = len(self.prompt_ids) + len(self.output_ids)  # `prefill_len`, inline: asked of every request every step
        return self.kv_len < (n - 1 if self.output_ids else n)

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED
