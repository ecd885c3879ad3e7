"""Per-request sampling parameters, validated with pydantic; torch-free so the daemon shares them.

Conventions (documented once here): `temperature == 0` means greedy; `top_k <= 0` disables top-k;
`top_p == 1` and `min_p == 0` disable those filters; `logprobs=N` returns the logprob of each
generated token plus the top-N alternatives (N=0: only the chosen token); logprobs are those of the
model's raw distribution (log-softmax of the logits, before temperature, penalties and filters), as
vLLM reports them by default. `seed` makes a request's samples reproducible whatever batch it runs in.

Validation is where the sampler's arithmetic is made safe, for every sampler that reads these values:
types are strict (a number is a JSON number, never a string or a bool; floats are finite), every
value has a range in which the float32 arithmetic of penalties and temperature cannot overflow, and a
temperature below `GREEDY_TEMPERATURE` becomes 0 (greedy) here. Dividing logits by 1e-38 overflows
to infinity and the softmax turns into NaNs (which used to sample token 0); below 1e-5 a sampled
distribution is indistinguishable from greedy anyway (vLLM draws the same line). Integers stay within
int32 (ids, counts) or int64 (seed), so they fit the sampler's tensors.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_LOGPROBS = 20
GREEDY_TEMPERATURE = 1e-5  # a temperature below this is greedy
MAX_TEMPERATURE = 100.0
# Repetition penalty divides (or multiplies) logits: within [0.01, 10] logits grow at most 100x,
# and then at most another 1e5x from the smallest sampled temperature, far from float32's limit.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
INT32_MAX = 2**31 - 1

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, strict=True)

    max_new_tokens: int = Field(128, ge=1, le=INT32_MAX)
    min_new_tokens: int = Field(0, ge=0, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    skip_special_tokens: bool = True

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: object) -> object:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        if len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @field_validator("temperature")
    @classmethod
    def _tiny_is_greedy(cls, v: float) -> float:
        return 0.0 if v < GREEDY_TEMPERATURE else v

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError("min_new_tokens must not exceed max_new_tokens")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
