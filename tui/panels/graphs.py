"""Graphs: per graph runner its captured buckets, replays per bucket and eager fallbacks by reason.

The cumulative counters come from graph events; the "seen in batches" columns count the batch events
this TUI received (graph replay vs eager, and why), which also covers runners with no graph state.
On CPU every runner is eager with reason "cpu" and has no buckets.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Static

from mleagle.engine.contract.event_bus import runner_order
from mleagle.tui.model import Dashboard
from mleagle.tui.panels import Panel


class GraphsPanel(Panel):
    DEFAULT_CSS = """
    GraphsPanel Static { height: auto; margin: 0 1 1 1; }
    """

    def compose(self) -> ComposeResult:
        yield Static("no graph events yet", id="graphs-table")
        yield Static("", id="graphs-batches")

    def update_view(self, m: Dashboard) -> None:
        gs = [m.tracker.graphs[k] for k in sorted(m.tracker.graphs, key=runner_order)]
        if gs:
            t = Table(box=None, padding=(0, 1), header_style="bold", title="graph runners (cumulative)",
                      title_justify="left", title_style="bold")
            for c in ("runner", "graphs", "mode", "buckets", "replays per bucket", "replays", "eager fallbacks",
                      "hit rate"):
                t.add_column(c, style="bold cyan" if c == "runner" else None)
            for g in gs:
                rep = sum(g.replays.values())
                eag = sum(g.eager.values())
                t.add_row(
                    g.runner,
                    Text("captured", style="green") if g.enabled else Text("off", style="yellow"),
                    g.mode or "-",
                    ",".join(map(str, g.buckets)) or "-",
                    " ".join(f"{b}:{n}" for b, n in sorted(g.replays.items())) or "-",
                    str(rep),
                    " ".join(f"{r}:{n}" for r, n in sorted(g.eager.items())) or "-",
                    f"{100 * rep / (rep + eag):.0f}%" if rep + eag else "-",
                )
            self.query_one("#graphs-table", Static).update(t)
        runners = sorted({r for r, _ in m.eager_reasons} | set(m.graph_hits), key=runner_order)
        if runners:
            t = Table(box=None, padding=(0, 1), header_style="bold", title="seen in batch events",
                      title_justify="left", title_style="bold")
            for c in ("runner", "replay", "eager", "eager reasons"):
                t.add_column(c, style="bold cyan" if c == "runner" else None)
            for r in runners:
                reasons = {k[1]: n for k, n in m.eager_reasons.items() if k[0] == r}
                t.add_row(r, str(m.graph_hits[r]), str(sum(reasons.values())),
                          " ".join(f"{k}:{n}" for k, n in sorted(reasons.items())) or "-")
            self.query_one("#graphs-batches", Static).update(t)
