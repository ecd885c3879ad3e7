"""Request models of the OpenAI-compatible API (completions, chat) and of the native `/generate`.

Pydantic validates every body (types and ranges, as the OpenAI reference states them) and
`to_sampling_params` maps a request onto the engine's `SamplingParams`. Unknown fields are ignored,
as OpenAI clients send fields this server has no use for (`user`, `metadata`, ...); fields whose
meaning it cannot honour (`echo`, `best_of`, `suffix`, `tool_choice: "auto"`, non-text message parts)
are refused with a 400 rather than silently dropped. vLLM-style extras are accepted: `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`, and
`spec_stats` (per-request speculative statistics in the response). Structured output
(`response_format`, `structured_outputs`, `guided_*`, forced tool calls) is chosen in
`daemon/structured.py`; `logit_bias` is OpenAI's (token-id string keys, -100..100, at most 300).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from mleagle.daemon.errors import APIError
from mleagle.daemon.structured import Constraint, select
from mleagle.engine.contract.sampling_params import (
    INT32_MAX,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SamplingParams,
    TokenId,
)

MAX_N = 16
# A JSON number and nothing else: OpenAI's schema types these as numbers, so "0.5" and true are
# refused like a string in an integer field; NaN and infinities are refused too.
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema is enforced whatever `strict` says (the grammar is
    always strict: no properties beyond the schema's)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: StrictStr = Field("response", max_length=64)
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: StrictStr
    json_schema: JsonSchemaFormat | None = None


class _Common(BaseModel):
    """Sampling fields shared by completions and chat (OpenAI ranges; vLLM extras)."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    temperature: Number | None = Field(None, ge=0.0, le=2.0)
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: Number | None = Field(None, ge=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63 - MAX_N)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Number | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    min_tokens: StrictInt = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: StrictBool = False
    stop_token_ids: list[Annotated[TokenId, Field(strict=True)]] | None = None
    skip_special_tokens: StrictBool = True
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None
    spec_stats: StrictBool = False
    # Structured output (daemon/structured.py picks the one a request asks for).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for k, x in v.items():
            if not (k.isascii() and k.isdigit() and len(k) <= 10 and int(k) <= INT32_MAX):
                raise ValueError(f"keys must be token ids (decimal strings), not {k[:20]!r}")
            if not -100 <= x <= 100:
                raise ValueError(f"values must be in [-100, 100] (token {k}: {x})")
        return v

    def constraint(self) -> Constraint:
        return select(self)

    def _refuse_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any) -> Any:
        # OpenAI's completions default is 16 whether max_tokens is absent or null; null must not mean
        # "the rest of the context" here (chat differs: there an absent max_tokens means exactly that).
        return 16 if v is None else v
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def check(self) -> None:
        self._refuse_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported")
        if self.best_of not in (None, self.n):
            raise APIError(400, "best_of other than n is not supported", param="best_of", code="unsupported")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
        p = self.prompt
        if (isinstance(p, str) and p == "") or (isinstance(p, list) and (not p or any(x in ("", []) for x in p))):
            raise APIError(400, "prompt must not be empty", param="prompt")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"message content part of type {part.type!r} is not supported", param="messages")
            out.append(part.text)
        return "".join(out)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool = True

    def check(self) -> None:
        self._refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")

    def messages_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in self.messages]


class GenerateRequest(BaseModel):
    """Native endpoint (SGLang-like): text or token ids in, engine `SamplingParams` as they are."""

    model_config = ConfigDict(extra="forbid")
    text: StrictStr | None = None
    input_ids: list[StrictInt] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: StrictBool = False
    spec_stats: StrictBool = False
    rid: StrictStr | None = Field(None, max_length=128)

    def check(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise APIError(400, "give exactly one of text and input_ids", param="text")
        if self.text == "" or self.input_ids == []:
            raise APIError(400, "the prompt must not be empty", param="text")


def to_sampling_params(req: CompletionRequest | ChatRequest, max_new: int, index: int,
                       constraint: Constraint | None = None) -> SamplingParams:
    """The engine's parameters for choice `index` of `req`; seeds differ per choice so n>1 differs."""
    if isinstance(req, ChatRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    stop = req.stop if isinstance(req.stop, list) else ([req.stop] if req.stop else [])
    kw: dict[str, Any] = {
        "max_new_tokens": max_new,
        "min_new_tokens": min(req.min_tokens, max_new),
        "stop": stop,
        "stop_token_ids": req.stop_token_ids or [],
        "ignore_eos": req.ignore_eos,
        "logprobs": logprobs,
        "skip_special_tokens": req.skip_special_tokens,
    }
    for f in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = getattr(req, f)
        if v is not None:
            kw[f] = v
    if req.seed is not None:
        kw["seed"] = req.seed + index
    if req.logit_bias:
        kw["logit_bias"] = {int(k): float(v) for k, v in req.logit_bias.items()}
    if constraint is not None and constraint.so is not None:
        kw["structured_outputs"] = constraint.so
    return SamplingParams(**kw)
