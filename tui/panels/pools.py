"""Pools: one bar per runner (target, then draft0..draft{S-1}) for KV slots and request slots.

Each draft layer has its own pool, so a mis-bound forward shows up here as one layer's pool moving
while another's should. A pool that is not back to free while nothing runs is flagged (the
"nothing leaks" invariant, visible live). The KV bar shows slots held by requests (solid) and
slots only the prefix cache holds (shaded: evictable, so free for the taking); the columns give
the cache's tokens per runner (the same slots in every runner) and, below the table, its hit rate.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Static

from mleagle.engine.contract.event_bus import runner_order
from mleagle.tui.model import Dashboard
from mleagle.tui.panels import Panel, bar


def kv_bar(used: float, evictable: float, width: int = 24) -> Text:
    """`bar` for the slots requests hold, then the cache's evictable slots shaded after them."""
    t = bar(used, width)
    full = round(min(max(used, 0.0), 1.0) * width)
    ev = min(round(max(evictable, 0.0) * width), width - full)
    if ev:
        t = t[:full]
        t.append("▒" * ev, style="blue")
        t.append("░" * (width - full - ev), style="grey37")
    return t


class PoolsPanel(Panel):
    DEFAULT_CSS = """
    PoolsPanel #pools-table { height: auto; margin: 0 1; }
    """

    def compose(self) -> ComposeResult:
        yield Static("no pool events yet", id="pools-table")

    def update_view(self, m: Dashboard) -> None:
        pools = [m.tracker.pools[k] for k in sorted(m.tracker.pools, key=runner_order)]
        if not pools:
            return
        t = Table(expand=False, box=None, padding=(0, 1), header_style="bold")
        t.add_column("runner", style="bold cyan")
        t.add_column("KV slots", no_wrap=True)
        t.add_column("used/total", justify="right")
        t.add_column("%", justify="right")
        t.add_column("cached", justify="right")
        t.add_column("evictable", justify="right")
        t.add_column("request slots", no_wrap=True)
        t.add_column("used/total", justify="right")
        t.add_column("page", justify="right")
        t.add_column("step", justify="right")
        t.add_column("")
        idle = m.num_running == 0 and m.num_waiting == 0 and m.events > 0
        for p in pools:
            kf = p.kv_used / p.kv_total if p.kv_total else 0.0
            rf = p.req_used / p.req_total if p.req_total else 0.0
            leak = idle and (p.kv_used or p.req_used)
            ef = p.kv_evictable / p.kv_total if p.kv_total else 0.0
            t.add_row(p.runner, kv_bar(kf, ef, 24), f"{p.kv_used}/{p.kv_total}", f"{100 * kf:.1f}",
                      str(p.kv_cached), str(p.kv_evictable), bar(rf, 12),
                      f"{p.req_used}/{p.req_total}", str(p.page_size), "-" if p.step is None else str(p.step),
                      Text("not free while idle", style="bold red") if leak
                      else Text("free", style="green") if not (p.kv_used or p.req_used) else Text(""))
        e = m.engine
        q = e.prefix_cache_queries_total if e is not None else None
        h = e.prefix_cache_hits_total if e is not None else None
        if q is None or h is None:
            line = Text("prefix cache: off or not reported", style="grey50")
        else:
            line = Text(f"prefix cache: {h}/{q} prompt tokens hit ({100 * h / q if q else 0.0:.1f} %)")
        self.query_one("#pools-table", Static).update(Group(t, Text(""), line))
