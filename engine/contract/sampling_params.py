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

Structured output: `structured_outputs` (vLLM's shape: exactly one of `json` (a JSON schema, as an
object or its text), `json_object`, `regex`, `choice`, `grammar` (EBNF)) constrains every generated token
to the grammar, which the engine compiles with xgrammar (`mleagle.engine.constrain`); this module only
checks the shape, so the daemon stays free of the grammar engine. `logit_bias` adds a bias in
[-100, 100] to chosen token ids' logits (OpenAI's shape; at most `MAX_LOGIT_BIAS` entries).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

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
MAX_LOGIT_BIAS = 300  # entries per request, as OpenAI's reference limits it
MAX_CONSTRAINT_CHARS = 65536  # a schema, regex or grammar larger than this is refused before compiling
MAX_CHOICES = 256
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputs(BaseModel):
    """One output constraint (vLLM's `StructuredOutputsParams`): exactly one field is set. `json` is
    a JSON schema (a dict or its JSON text); `json_object` any JSON object; `regex` a regular
    expression the whole output matches; `choice` one of the strings; `grammar` an EBNF grammar
    (llama.cpp/GBNF style, root rule `root`). Whether a schema, regex or grammar is valid is known
    only once compiled (the engine refuses it then, naming the field)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        set_ = [k for k in CONSTRAINT_KINDS if self._value(k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(CONSTRAINT_KINDS)}"
                             + (f" (got {', '.join(set_)})" if set_ else ""))
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES or any(c == "" for c in self.choice):
                raise ValueError(f"choice needs 1 to {MAX_CHOICES} non-empty strings")
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"{self.kind} is longer than {MAX_CONSTRAINT_CHARS} characters")
        return self

    def _value(self, kind: str) -> Any:
        return self.json_ if kind == "json" else getattr(self, kind)

    @property
    def kind(self) -> str:
        return next(k for k in CONSTRAINT_KINDS if self._value(k) not in (None, False))

    @property
    def text(self) -> str:
        """The constraint as one string (the compile cache's key with `kind`): a schema's JSON text
        keeps its key order, which is the order xgrammar generates properties in."""
        k = self.kind
        v = self._value(k)
        if k == "json_object":
            return ""
        if k == "choice":
            return json.dumps(v, ensure_ascii=False)
        if k == "json" and not isinstance(v, str):
            return json.dumps(v, ensure_ascii=False)
        return str(v)


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
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[int, float] | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, v: object) -> object:
        # JSON object keys are strings ("50256": -100, OpenAI's shape): token ids in decimal.
        if isinstance(v, dict):
            out: dict[object, object] = {}
            for k, x in v.items():
                if isinstance(k, str):
                    if not k.isascii() or not k.isdigit() or len(k) > 10:
                        raise ValueError(f"logit_bias keys must be token ids, not {k[:20]!r}")
                    k = int(k)
                out[k] = float(x) if isinstance(x, int) and not isinstance(x, bool) else x
            return out
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is None:
            return None
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(v)} entries; at most {MAX_LOGIT_BIAS}")
        for k, x in v.items():
            if not 0 <= k <= INT32_MAX:
                raise ValueError(f"logit_bias key {k} is not a token id")
            if not -100.0 <= x <= 100.0 or x != x:
                raise ValueError(f"logit_bias values must be in [-100, 100] (token {k}: {x})")
        return v or None

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
    def constrained(self) -> bool:
        """The request's tokens go through the constrained path (a grammar, a logit bias, or both)."""
        return self.structured_outputs is not None or bool(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
