"""Child processes that must not outlive their parent: the engine process (child of the daemon) and
local tensor-parallel ranks (children of rank 0). A leaf both import (whether a process is alive is
`mleagle.engine.contract.protocol.pid_alive`, which the daemon shares)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys


def die_with_parent(parent: int | None) -> None:
    """Linux: get SIGTERM when the parent dies, so a killed parent never leaves an orphan. The parent
    may have died before prctl ran (we would already be re-parented): then exit right away."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if parent is not None and os.getppid() != parent:
        sys.exit(0)
