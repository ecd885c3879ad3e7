"""`mleagle serve`: the command line of the daemon (`serve_main(argv) -> exit code`).

`--config NAME|PATH` picks a bundled config (`smollm2-135m`, the default) or a TOML file; every other
flag overrides one field of it, and the result is validated by the same pydantic models, so a bad flag
value fails with the field's name before anything starts. `--model` swaps the `[model]` section for
another bundled config, TOML, GGUF file or HF directory. `--api-key` may also come from
`MLEAGLE_API_KEY` (keeps it out of `ps`), `--host` and `--port` from `MLEAGLE_HOST` and `MLEAGLE_PORT`.
The daemon itself never imports torch: the engine runs in its own process
(`mleagle.engine.service.process`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from pydantic import ValidationError

from mleagle.engine.contract.cli_flags import add_device_args, add_tp_args, depth_list
from mleagle.engine.contract.config import MleagleConfig, load_config

# flag -> (section, field)
OVERRIDES: dict[str, tuple[str, str]] = {
    "host": ("server", "host"),
    "port": ("server", "port"),
    "api_key": ("server", "api_key"),
    "served_model_name": ("server", "served_model_name"),
    "max_queued_requests": ("server", "max_queued_requests"),
    "max_body_bytes": ("server", "max_body_bytes"),
    "shutdown_timeout": ("server", "shutdown_timeout_s"),
    "restart_engine": ("server", "restart_engine"),
    "idle_timeout": ("server", "idle_timeout_s"),
    "body_timeout": ("server", "body_timeout_s"),
    "write_timeout": ("server", "write_timeout_s"),
    "stream_buffer_tokens": ("server", "stream_buffer_tokens"),
    "engine_ping_interval": ("server", "engine_ping_interval_s"),
    "engine_ping_timeout": ("server", "engine_ping_timeout_s"),
    "events_include_text": ("server", "events_include_text"),
    "state_events": ("server", "state_events"),
    "events_sample_ms": ("server", "events_sample_ms"),
    "spin_ms": ("server", "spin_ms"),
    "warm_up": ("server", "warm_up"),
    "device": ("engine", "device"),
    "dtype": ("engine", "dtype"),
    "draft": ("engine", "draft"),
    "spec_steps": ("engine", "spec_steps"),
    "spec_policy": ("engine", "spec_policy"),
    "spec_depths": ("engine", "spec_depths"),
    "attention_backend": ("engine", "attention_backend"),
    "max_total_tokens": ("engine", "max_total_tokens"),
    "kv_memory_mb": ("engine", "kv_memory_mb"),
    "max_running_requests": ("engine", "max_running_requests"),
    "max_context_len": ("engine", "max_context_len"),
    "chunked_prefill_size": ("engine", "chunked_prefill_size"),
    "prefill_graph_max_tokens": ("engine", "prefill_graph_max_tokens"),
    "prefill_wait_steps": ("engine", "prefill_wait_steps"),
    "fuse_mixed_steps": ("engine", "fuse_mixed_steps"),
    "prefill_side_stream": ("engine", "prefill_side_stream"),
    "threads": ("engine", "threads"),
    "seed": ("engine", "seed"),
    "enable_prefix_cache": ("engine", "enable_prefix_cache"),
    "tp": ("engine", "tp_size"),
    "tp_layout": ("engine", "tp_layout"),
    "draft_tp": ("engine", "draft_tp"),
    "nnodes": ("engine", "nnodes"),
    "master_addr": ("engine", "master_addr"),
    "master_port": ("engine", "master_port"),
    "tp_secret_file": ("engine", "tp_secret_file"),
    "tp_timeout": ("engine", "tp_timeout_s"),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mleagle serve", description="Serve a model over an OpenAI-compatible HTTP API.")
    ap.add_argument("--config", default=None, help="bundled config name or TOML path (default: smollm2-135m)")
    ap.add_argument("--model", default=None, help="replace the config's model: config name, TOML, GGUF or HF dir")
    # Host and port may come from the environment (as the Docker image sets them, so that its
    # HEALTHCHECK reads the same port); a flag wins over the environment, which wins over the config.
    ap.add_argument("--host", default=os.environ.get("MLEAGLE_HOST") or None,
                    help="bind address (default 127.0.0.1, or $MLEAGLE_HOST; 0.0.0.0 to listen everywhere)")
    ap.add_argument("--port", type=int, default=os.environ.get("MLEAGLE_PORT") or None,
                    help="port (default 8000, or $MLEAGLE_PORT; 0 picks a free one)")
    ap.add_argument("--api-key", default=os.environ.get("MLEAGLE_API_KEY"), help="require 'Authorization: Bearer KEY'")
    ap.add_argument("--served-model-name", default=None)
    add_device_args(ap)
    ap.add_argument("--draft", default=None, help="draft stack: PATH, random:S[:seed] or none")
    ap.add_argument("--spec-steps", type=int, default=None)
    ap.add_argument("--spec-policy", choices=["auto", "always", "off", "cycle"], default=None,
                    help="draft steps per iteration: auto (0..S, whatever pays; default), always (S), off (0)")
    ap.add_argument("--spec-depths", type=depth_list, default=None,
                    help="comma list of the depths auto chooses between (default 0,S; e.g. 0,3,5)")
    ap.add_argument("--attention-backend", choices=["auto", "torch", "triton", "flashinfer"], default=None,
                    help="auto: triton on CUDA, torch on the CPU")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens (per runner)")
    ap.add_argument("--kv-memory-mb", type=float, default=None)
    ap.add_argument("--max-running-requests", type=int, default=None)
    ap.add_argument("--max-context-len", type=int, default=None)
    ap.add_argument("--chunked-prefill-size", type=int, default=None)
    ap.add_argument("--prefill-graph-max-tokens", type=int, default=None,
                    help="CUDA graphs for prefills of up to this many tokens (default 2048; 0: prefill eagerly)")
    ap.add_argument("--prefill-wait-steps", type=int, default=None,
                    help="steps an arrival may wait for others to share its prefill while requests decode "
                         "(default 0: off)")
    ap.add_argument("--no-fuse-mixed-steps", dest="fuse_mixed_steps", action="store_const", const=False,
                    default=None, help="target-only: run a mixed step's prefill and the decoding rows' next tokens as "
                                       "two forwards (default: one, where it fits a prefill graph)")
    ap.add_argument("--no-prefill-side-stream", dest="prefill_side_stream", action="store_const", const=False,
                    default=None, help="target-only CUDA with --no-fuse-mixed-steps: run each prefill behind the decode "
                                       "iteration in flight (default: on a stream of its own beside it)")
    ap.add_argument("--disable-prefix-cache", dest="enable_prefix_cache", action="store_const", const=False,
                    default=None, help="recompute every prompt (no prefix KV reuse)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    add_tp_args(ap)
    ap.add_argument("--max-queued-requests", type=int, default=None, help="beyond running + this many: 429")
    ap.add_argument("--max-body-bytes", type=int, default=None)
    ap.add_argument("--shutdown-timeout", type=float, default=None, help="seconds a SIGTERM drain waits")
    ap.add_argument("--restart-engine", action=argparse.BooleanOptionalAction, default=None,
                    help="restart a dead engine (default) or exit non-zero (--no-restart-engine)")
    ap.add_argument("--idle-timeout", type=float, default=None,
                    help="seconds a connection may take to send a request head (after opening or a response)")
    ap.add_argument("--body-timeout", type=float, default=None, help="seconds to receive a request body (else 408)")
    ap.add_argument("--write-timeout", type=float, default=None,
                    help="seconds a client may leave one write unread before it is disconnected")
    ap.add_argument("--stream-buffer-tokens", type=int, default=None,
                    help="generated tokens held for a client that is not reading, before its request is stopped")
    ap.add_argument("--engine-ping-interval", type=float, default=None, help="seconds between engine pings")
    ap.add_argument("--engine-ping-timeout", type=float, default=None,
                    help="seconds of engine silence before it is declared frozen and restarted (0: never)")
    ap.add_argument("--events-include-text", action="store_true", default=None,
                    help="put token ids, text and logprobs of every request in /v1/events (off: counts only)")
    ap.add_argument("--spin-ms", type=float, default=None,
                    help="with a GPU engine: how long the engine and the daemon keep polling after their last "
                         "work before they sleep (default 5; 0: sleep at once)")
    ap.add_argument("--state-events", action=argparse.BooleanOptionalAction, default=None,
                    help="publish the engine's state events on /v1/events for mleagle-tui (default; "
                         "--no-state-events spares the engine's loop their host time per step)")
    ap.add_argument("--events-sample-ms", type=float, default=None,
                    help="while no /v1/events client subscribes, the engine reports one step per this many ms "
                         "(default 100; 0: every step)")
    ap.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                    help="run a few short requests of its own before reporting ready, so the first user request "
                         "meets no first-use cost (default; --no-warm-up starts a second or so sooner)")
    ap.add_argument("--access-log", action="store_true")
    ap.add_argument("--log-level", default="INFO")
    return ap


def make_config(args: argparse.Namespace) -> MleagleConfig:
    cfg = load_config(args.config)
    data: dict[str, Any] = cfg.model_dump(exclude_unset=False)
    if args.model:
        data["model"] = load_config(args.model).model.model_dump()
    for flag, (section, key) in OVERRIDES.items():
        v = getattr(args, flag, None)
        if v is not None:
            data[section][key] = v
    return MleagleConfig.model_validate(data)


def serve_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = make_config(args)
    except (ValueError, ValidationError, OSError) as e:
        print(f"mleagle serve: bad configuration: {e}", file=sys.stderr)
        return 2
    from mleagle.daemon.lifecycle import serve

    return serve(cfg, access_log=args.access_log)


if __name__ == "__main__":
    sys.exit(serve_main())
