"""Command-line flags shared by `mleagle serve` (the daemon) and the engine's own commands (`generate`,
`bench`): torch-free, so the daemon's CLI can use them. The tensor-parallel flags map one to one onto
`EngineConfig` fields (`tp_overrides`), validated there like a config file's values."""

from __future__ import annotations

import argparse
from typing import Any


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
