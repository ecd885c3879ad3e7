"""The engine: models, KV pools, batches, attention backends, runners, scheduler, speculative worker.

The folders are the architecture. `contract/` is the torch-free contract the daemon and the TUI import
(configuration, sampling parameters, outputs, state events and their bus, the daemon-engine protocol,
tokenizer and detokenizer); `core/` holds request life and scheduling (`Engine`, `Scheduler`, `Req`);
`executor/` turns a schedule into forwards (batch views and the row-count rule, runners and step
bindings, the target-only worker); `spec/` the draft stack and the speculative worker; `models/`,
`layers/`, `attention/`, `memory/`, `sampling/` and `model_loader/` the pieces a forward is made of;
`service/` the engine process and its telemetry; `entrypoints/` the `generate` and `bench` commands.

Importing `mleagle.engine` stays light (no torch): `Engine` and `SamplingParams` are resolved on first
use, so `from mleagle.engine import Engine` works and the daemon still imports only `contract/`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from mleagle.engine.core.engine import Engine

        return Engine
    if name == "SamplingParams":
        from mleagle.engine.contract.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'mleagle.engine' has no attribute {name!r}")
