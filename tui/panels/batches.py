"""Batches: a live table of scheduler steps, one row per batch event (newest at the bottom).

Shows mode, runner, raw and padded batch size, tokens, graph replay or eager with the reason, step time
and the requests in the batch. Padded ≠ raw means a graph bucket was padded; eager rows say why.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable

from mleagle.engine.contract.events import BatchEvent
from mleagle.tui.model import Dashboard
from mleagle.tui.panels import Cell, Panel, append_rows

MODE_STYLE = {"EXTEND": "magenta", "DECODE": "cyan", "TARGET_VERIFY": "bold green", "DRAFT_EXTEND": "blue",
              "MIXED": "yellow", "IDLE": "grey50"}


def batch_row(e: BatchEvent) -> tuple:
    rids = ",".join(e.rids)
    return (
        str(e.step), e.runner, Text(e.mode, style=MODE_STYLE.get(e.mode, "")), str(e.bs),
        Text(str(e.padded_bs), style="yellow" if e.padded_bs != e.bs else ""), str(e.num_tokens),
        Text(e.graph, style="green" if e.graph == "replay" else "grey70"), e.eager_reason or "",
        f"{e.duration_s * 1e3:.2f}", Text(rids if len(rids) <= 40 else rids[:39] + "…"),
    )


class BatchesPanel(Panel):
    MAX_ROWS = 300

    def compose(self) -> ComposeResult:
        t: DataTable[Cell] = DataTable(id="batches-table", zebra_stripes=True, cursor_type="row")
        t.add_columns("step", "runner", "mode", "bs", "padded", "tokens", "graph", "eager reason", "ms", "requests")
        self.shown = 0
        yield t

    def update_view(self, m: Dashboard) -> None:
        t = self.query_one("#batches-table", DataTable)
        self.shown = append_rows(t, list(m.batches), m.batch_count, self.shown, self.MAX_ROWS, batch_row)
