"""Command-line flags shared by `mleagle serve` (the daemon) and the engine's own commands (`generate`,
`bench`, `train-draft`): torch-free, so the daemon's CLI can use them. The device and dtype flags take
exactly the values `EngineConfig` takes ("auto" included: the choices are read from the config's
fields), and the tensor-parallel flags map one to one onto `EngineConfig` fields (`tp_overrides`),
validated there like a config file's values."""

from __future__ import annotations

import argparse
from typing import Any, get_args

from mleagle.engine.contract.config import EngineConfig

DEVICES: tuple[str, ...] = get_args(EngineConfig.model_fields["device"].annotation)
DTYPES: tuple[str, ...] = get_args(EngineConfig.model_fields["dtype"].annotation)


def add_device_args(ap: argparse.ArgumentParser | Any, device: str | None = None, dtype: str | None = None) -> None:
    """--device and --dtype with the config's choices ("auto": CUDA when present, bfloat16 there,
    float32 on the CPU); None defaults leave the config's value."""
    ap.add_argument("--device", choices=DEVICES, default=device,
                    help="auto (CUDA when present), cpu or cuda" + (f" (default {device})" if device else " (default: the config's)"))
    ap.add_argument("--dtype", choices=DTYPES, default=dtype,
                    help="auto (bfloat16 on CUDA, float32 on the CPU) or a dtype"
                         + (f" (default {dtype})" if dtype else " (default: the config's)"))


def depth_list(s: str) -> list[int]:
    """--spec-depths: a comma list of draft depths ("0,3,5")."""
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of depths, not {s!r}") from None


def resolve_device(device: str, dtype: str) -> tuple[str, str]:
    """("auto" resolved) device and dtype, as the engine resolves them."""
    e = EngineConfig(device=device, dtype=dtype)  # type: ignore[arg-type]
    dev = e.resolved_device()
    return dev, e.resolved_dtype(dev)


def add_tp_args(ap: argparse.ArgumentParser) -> None:
    """Tensor-parallel flags, the same on serve, generate and bench."""
    g = ap.add_argument_group("tensor parallelism")
    g.add_argument("--tp", type=int, default=None, help="tensor-parallel size: rank processes (one per GPU)")
    g.add_argument("--tp-layout", choices=["all_reduce", "scattered"], default=None,
                   help="all_reduce (default) or scattered (token-scattered residual: reduce-scatter + all-gather)")
    g.add_argument("--draft-tp", choices=["shard", "replicate"], default=None,
                   help="draft layers sharded like the target (default) or whole on every rank")
    g.add_argument("--nnodes", type=int, default=None,
                   help="nodes (this one runs rank 0; the others run `mleagle engine-ranks --node-rank K`)")
    g.add_argument("--master-addr", default=None, help="rendezvous address (default $MASTER_ADDR, else 127.0.0.1)")
    g.add_argument("--master-port", type=int, default=None, help="rendezvous port (default $MASTER_PORT, else free)")
    g.add_argument("--tp-secret-file", default=None,
                   help="multi-node: a file only you can read (mode 0600) holding the secret that signs the rendezvous "
                        "store's values; the same file on every node (one node needs none)")
    g.add_argument("--tp-timeout", type=float, default=None, help="seconds before a silent rank takes the engine down")


def tp_overrides(a: argparse.Namespace) -> dict[str, Any]:
    """The tensor-parallel flags given on the command line, as `EngineConfig` overrides."""
    keys = {"tp_size": a.tp, "tp_layout": a.tp_layout, "draft_tp": a.draft_tp, "nnodes": a.nnodes,
            "master_addr": a.master_addr, "master_port": a.master_port, "tp_timeout_s": a.tp_timeout,
            "tp_secret_file": a.tp_secret_file}
    return {k: v for k, v in keys.items() if v is not None}
