"""The daemon–engine wire protocol: small pydantic messages sent as JSON over the engine channel (never
pickle; `channel.py` frames them on one Unix socket).

The daemon sends `DaemonMsg`s (add, abort, ping, shutdown) to the engine process and reads
`EngineMsg`s back (ready handshake, batched `RequestOutput` deltas, per-request errors, pongs with pool
usage and counters, fatal). Every message carries a `type` discriminator, so one `decode_*` call parses
any of them and anything else on the socket is rejected as a `ValueError`. The module is torch-free:
the daemon and tools import it without the engine. Bump `PROTOCOL_VERSION` on any incompatible change;
the daemon refuses an engine whose `Ready` says otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from mleagle.engine.contract.outputs import RequestOutput, StepOutput, TokenDelta, TokenOutput
from mleagle.engine.contract.sampling_params import SamplingParams

# 2: running deltas travel as `TokenDelta` arrays (`Outputs.tokens`); 3: `EventDetail`
PROTOCOL_VERSION = 3


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- daemon -> engine ---------------------------------------------------------------------------


class AddRequest(_Msg):
    type: Literal["add"] = "add"
    rid: str
    prompt_ids: list[int]
    params: SamplingParams


class AbortRequest(_Msg):
    type: Literal["abort"] = "abort"
    rid: str


class Ping(_Msg):
    """Health probe; the engine answers with a `Pong` carrying fresh pool usage and counters."""

    type: Literal["ping"] = "ping"
    seq: int


class Shutdown(_Msg):
    type: Literal["shutdown"] = "shutdown"


class EventDetail(_Msg):
    """Whether anyone watches the state events (a `/v1/events` subscriber): `full` publishes every
    step's events; otherwise the per-step ones (batches, pools, acceptance, the policy's decisions,
    logprob metadata) go out for one step every `server.events_sample_ms`, which keeps the
    daemon's snapshot current at a fraction of the cost. The engine starts without it."""

    type: Literal["event_detail"] = "event_detail"
    full: bool


DaemonMsg = Annotated[AddRequest | AbortRequest | Ping | Shutdown | EventDetail, Field(discriminator="type")]

# ---- engine -> daemon ---------------------------------------------------------------------------


class Ready(_Msg):
    """Sent once the engine is built. `tokenizer_dir` holds a `Tokenizer.save` copy the daemon loads
    without torch (None when the model has no tokenizer: the daemon then accepts token ids only)."""

    type: Literal["ready"] = "ready"
    protocol_version: int = PROTOCOL_VERSION
    model_name: str
    max_context_len: int
    tokenizer_dir: str | None = None
    spec_steps: int = 0
    vocab_size: int | None = None
    pid: int
    device: str | None = None  # "cuda", "cpu": the daemon spins its loop only beside a GPU engine
    world_size: int = 1
    # The most tokens one request may hold in the KV pool (prompt + new tokens): capacity minus the
    # positions a decode step writes ahead. None when unknown; the context limit applies either way.
    max_request_tokens: int | None = None


class Outputs(_Msg):
    """The deltas of one scheduler step, batched: one message per step, not per request. `Outputs.of`
    puts a delta that is new tokens only in `tokens` (a `TokenDelta` array) and any other in `outputs`
    (a whole `RequestOutput`). The daemon takes `tokens` first: were a request ever to have two deltas
    in one step, the one that says more (its last, finishing it) stays last."""

    type: Literal["outputs"] = "outputs"
    outputs: list[RequestOutput] = Field(default_factory=list)
    tokens: list[TokenDelta] = Field(default_factory=list)
    sent: float = 0.0  # time.monotonic() as the engine process sent it (0: not stamped)

    @classmethod
    def of(cls, deltas: Sequence[StepOutput]) -> Outputs:
        outputs: list[RequestOutput] = []
        tokens: list[TokenDelta] = []
        for o in deltas:
            if isinstance(o, TokenOutput):
                tokens.append(o.token_delta())
            elif (t := o.token_delta()) is None:
                outputs.append(o)
            else:
                tokens.append(t)
        return cls.model_construct(outputs=outputs, tokens=tokens)  # the engine's own values: no validation


class RequestError(_Msg):
    """A request the engine refused (`kind="input"`: the message is user-facing, HTTP 400) or failed
    (`kind="internal"`). The request is gone from the engine when this is sent."""

    type: Literal["error"] = "error"
    rid: str
    message: str
    kind: Literal["input", "internal"] = "input"
    param: str | None = None  # the SamplingParams field at fault, when the engine knows it


class Pong(_Msg):
    type: Literal["pong"] = "pong"
    seq: int
    num_requests: int = 0
    pool_usage: list[dict[str, Any]] = Field(default_factory=list)
    stats: dict[str, Any] = Field(default_factory=dict)
    max_rss_mb: float | None = None  # the engine process's peak resident memory


class Fatal(_Msg):
    """The engine cannot go on (failed to build, or its loop died); the process exits after sending."""

    type: Literal["fatal"] = "fatal"
    message: str


EngineMsg = Annotated[Ready | Outputs | RequestError | Pong | Fatal, Field(discriminator="type")]

_daemon_msg: TypeAdapter[Any] = TypeAdapter(DaemonMsg)
_engine_msg: TypeAdapter[Any] = TypeAdapter(EngineMsg)


def encode(msg: _Msg) -> bytes:
    return msg.model_dump_json().encode()


def _decode(adapter: TypeAdapter[Any], data: bytes) -> Any:
    try:
        return adapter.validate_json(data)
    except ValidationError as e:
        raise ValueError(f"bad protocol message: {e.errors(include_url=False)[:3]}") from None


def decode_daemon_msg(data: bytes) -> AddRequest | AbortRequest | Ping | Shutdown | EventDetail:
    return _decode(_daemon_msg, data)


def decode_engine_msg(data: bytes) -> Ready | Outputs | RequestError | Pong | Fatal:
    return _decode(_engine_msg, data)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user's counts: signalling it is merely refused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def peak_rss_mb() -> float:
    """This process's own peak RSS (VmHWM). Not getrusage's ru_maxrss: Linux carries that over an
    exec from the forking parent, so a server started from a big process would report the parent's."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
