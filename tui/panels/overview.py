"""Overview: what the engine is, how fast it goes, how full it is, and recent trends as sparklines.

Throughput and running/waiting come from the latest engine status (running/waiting also follow each
batch event, so they move at the step rate); mean acceptance length is over all iterations seen.
Sparklines: generated tokens/s per status interval, mean accept length per iteration, target batch size
and target step time per step.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Label, Sparkline, Static

from mleagle.engine.contract.event_bus import runner_order
from mleagle.tui.model import Dashboard
from mleagle.tui.panels import Cell, Panel, fmt_f


class OverviewPanel(Panel):
    DEFAULT_CSS = """
    OverviewPanel #ov-info { height: auto; margin: 0 1 1 1; }
    OverviewPanel Label { margin: 0 1; color: $text-muted; }
    OverviewPanel Sparkline { height: 3; margin: 0 1 1 1; }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="ov-info")
        yield Label("generated tokens/s", id="lbl-tps")
        yield Sparkline([], id="spark-tps", summary_function=max)
        yield Label("mean accept length per iteration", id="lbl-acc")
        yield Sparkline([], id="spark-acc", summary_function=max)
        yield Label("target batch size per step", id="lbl-bs")
        yield Sparkline([], id="spark-bs", summary_function=max)
        yield Label("target step time (ms)", id="lbl-ms")
        yield Sparkline([], id="spark-ms", summary_function=max)

    def update_view(self, m: Dashboard) -> None:
        e = m.engine
        g = Table.grid(padding=(0, 3))
        g.add_column(style="bold cyan")
        g.add_column()
        g.add_column(style="bold cyan")
        g.add_column()
        acc = m.mean_accept_len
        last_acc = m.spark_accept[-1] if m.spark_accept else None
        pools = [m.tracker.pools[k] for k in sorted(m.tracker.pools, key=runner_order)]
        kv = " ".join(f"{p.runner} {100 * p.kv_used / max(p.kv_total, 1):.0f}%" for p in pools) or "-"
        rows: list[tuple[Cell, Cell, Cell, Cell]] = [
            ("model", e.model if e else "-", "draft", (e.draft or "-") if e else "-"),
            ("spec steps S", str(m.spec_steps), "device / dtype", f"{e.device} / {e.dtype}" if e else "-"),
            ("uptime", f"{e.uptime_s:.1f} s" if e else "-", "tp size", str(e.tp_size) if e else "-"),
            ("running", str(m.num_running), "waiting", str(m.num_waiting)),
            ("gen tok/s", fmt_f(e.gen_tokens_per_s, 1) if e else "-",
             "prompt tok/s", fmt_f(e.prompt_tokens_per_s, 1) if e else "-"),
            ("gen tokens", str(e.gen_tokens_total) if e else "-",
             "finished reqs", str(e.requests_finished_total) if e else "-"),
            ("accept len (all)", fmt_f(acc), "accept len (last)", fmt_f(last_acc)),
            ("KV used", kv, "logprob mismatches",
             Text(str(m.lpm_mismatch), style="bold red" if m.lpm_mismatch else "green")),
        ]
        for r in rows:
            g.add_row(*r)
        self.query_one("#ov-info", Static).update(g)
        self.query_one("#spark-tps", Sparkline).data = list(m.spark_tps)
        self.query_one("#spark-acc", Sparkline).data = list(m.spark_accept)
        self.query_one("#spark-bs", Sparkline).data = list(m.spark_bs)
        self.query_one("#spark-ms", Sparkline).data = list(m.spark_step_ms)
        self.query_one("#lbl-tps", Label).update(
            f"generated tokens/s  (last {m.spark_tps[-1]:.1f}, max {max(m.spark_tps):.1f})" if m.spark_tps
            else "generated tokens/s")
        self.query_one("#lbl-acc", Label).update(
            f"mean accept length per iteration  (last {m.spark_accept[-1]:.2f}, max {max(m.spark_accept):.2f})"
            if m.spark_accept else "mean accept length per iteration")
        self.query_one("#lbl-bs", Label).update(
            f"target batch size per step  (last {m.spark_bs[-1]:.0f})" if m.spark_bs else "target batch size per step")
        self.query_one("#lbl-ms", Label).update(
            f"target step time (ms)  (last {m.spark_step_ms[-1]:.1f})" if m.spark_step_ms else "target step time (ms)")
