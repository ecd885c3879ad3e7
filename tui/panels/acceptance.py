"""Acceptance: per draft depth how often the draft was accepted, the accept-length histogram, times.

Depth j's rate is accepted drafts at depth j over proposals at depth j (one per request per iteration);
in chain mode it can only fall with depth, and an oracle draft must show 100 % at every depth, so a
drop at depth ≥ 1 points at a mis-bound draft layer. Times are per iteration means.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Label, Sparkline, Static

from mleagle.tui.model import Dashboard
from mleagle.tui.panels import Panel, bar, fmt_f, fmt_s


class AcceptancePanel(Panel):
    DEFAULT_CSS = """
    AcceptancePanel Static { height: auto; margin: 0 1 1 1; }
    AcceptancePanel Label { margin: 0 1; color: $text-muted; }
    AcceptancePanel Sparkline { height: 3; margin: 0 1; }
    """

    def compose(self) -> ComposeResult:
        yield Static("no acceptance events yet", id="acc-summary")
        yield Static("", id="acc-depth")
        yield Static("", id="acc-hist")
        yield Label("mean accept length per iteration")
        yield Sparkline([], id="acc-spark", summary_function=max)

    def update_view(self, m: Dashboard) -> None:
        if not m.iterations:
            return
        n = m.iterations
        layer = "  ".join(f"d{j} {fmt_s(t / n)}" for j, t in enumerate(m.layer_time)) or "-"
        self.query_one("#acc-summary", Static).update(Text.assemble(
            ("S ", "bold"), str(m.S), ("   iterations ", "bold"), str(n),
            ("   mean accept len ", "bold"), fmt_f(m.mean_accept_len),
            ("   verify ", "bold"), fmt_s(m.verify_time / n), ("   draft ", "bold"), fmt_s(m.draft_time / n),
            ("   per layer ", "bold"), layer))
        t = Table(box=None, padding=(0, 1), header_style="bold", title="acceptance by depth",
                  title_justify="left", title_style="bold")
        for c in ("depth", "runner", "accepted", "proposed", "rate", ""):
            t.add_column(c, justify="right" if c in ("accepted", "proposed", "rate") else "left")
        for j in range(m.S):
            a, p = m.acc_per_depth[j], m.proposed_per_depth[j]
            f = a / p if p else 0.0
            t.add_row(str(j + 1), f"draft{j}", str(a), str(p), f"{100 * f:.1f}%", bar_rate(f))
        self.query_one("#acc-depth", Static).update(t)
        h = Table(box=None, padding=(0, 1), header_style="bold", title="accept length histogram (per request)",
                  title_justify="left", title_style="bold")
        h.add_column("len", justify="right")
        h.add_column("count", justify="right")
        h.add_column("share", justify="right")
        h.add_column("")
        tot = sum(m.accept_hist.values()) or 1
        top = max(m.accept_hist.values(), default=1)
        for k in range(1, m.S + 2):
            cnt = m.accept_hist.get(k, 0)
            h.add_row(str(k), str(cnt), f"{100 * cnt / tot:.1f}%", Text("▇" * round(30 * cnt / top), style="cyan"))
        self.query_one("#acc-hist", Static).update(h)
        self.query_one("#acc-spark", Sparkline).data = list(m.spark_accept)


def bar_rate(f: float) -> Text:
    """Acceptance bars read the other way round from pool bars: high is good."""
    t = bar(f, 30)
    t.stylize("green" if f >= 0.7 else "yellow" if f >= 0.4 else "red", 0, round(f * 30))
    return t
