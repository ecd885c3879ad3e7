"""Logprob metadata: one row per forward (mode, bs, W, logit rows, per-rank token and logprob counts).

This is the "one rule for row counts" invariant made visible: a row whose counts disagree with the
logit rows (agree=False) is highlighted in red, and the summary above the table counts mismatches per
runner and mode, so a branch that writes [bs] where the forward makes bs·W rows is seen immediately.
Under tensor parallelism the summary names the ranks and the layout, and shows per runner and mode the
tokens and logprob rows each rank held in its latest forward (in the token-scattered layout each rank
holds its padded share; in the all-reduce layout every rank holds them all).
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable, Static

from mleagle.engine.contract.event_bus import runner_order
from mleagle.engine.contract.events import LogprobMetaEvent
from mleagle.tui.model import Dashboard
from mleagle.tui.panels import Cell, Panel, append_rows

BAD = "bold white on dark_red"


def lpm_row(e: LogprobMetaEvent) -> tuple:
    s = "" if e.agree else BAD
    cells = ("-" if e.step is None else str(e.step), e.runner, e.mode, str(e.bs), str(e.width), str(e.logit_rows),
             "-" if e.expected_rows is None else str(e.expected_rows), str(e.global_num_tokens),
             str(e.global_num_tokens_for_logprob), "yes" if e.agree else "NO")
    return tuple(Text(c, style=s or ("green" if c == "yes" else "")) for c in cells)


def per_rank(counts: list[int]) -> str:
    return " ".join(str(c) for c in counts) if counts else "-"


class LogprobsPanel(Panel):
    MAX_ROWS = 300
    DEFAULT_CSS = """
    LogprobsPanel #lpm-summary { height: auto; margin: 0 1 1 1; }
    """

    def compose(self) -> ComposeResult:
        yield Static("no logprob metadata yet", id="lpm-summary")
        t: DataTable[Cell] = DataTable(id="lpm-table", zebra_stripes=True, cursor_type="row")
        t.add_columns("step", "runner", "mode", "bs", "W", "logit rows", "expected", "tokens/rank",
                      "logprob tokens/rank", "agree")
        self.shown = 0
        yield t

    def update_view(self, m: Dashboard) -> None:
        if not m.lpm_count:
            return
        s = Text.assemble(("forwards ", "bold"), str(m.lpm_count), ("   mismatches ", "bold"),
                          (str(m.lpm_mismatch), BAD if m.lpm_mismatch else "green"))
        tp = max((e.tp_size for e in m.lpm_last.values()), default=1)
        if tp > 1:
            layouts = sorted({e.layout or "?" for e in m.lpm_last.values()})
            s.append("   tensor parallel ", style="bold")
            s.append(f"{tp} ranks, {'/'.join(layouts)}")
        for runner, mode in sorted(m.lpm_by, key=lambda k: (runner_order(k[0]), k[1])):
            bad = m.lpm_bad_by[(runner, mode)]
            s.append(f"\n  {runner:<8} {mode:<14} {m.lpm_by[(runner, mode)]:>6} forwards  ")
            s.append(f"{bad} mismatched" if bad else "all agree", style=BAD if bad else "green")
            last = m.lpm_last.get((runner, mode))
            if tp > 1 and last is not None:
                s.append(f"   per rank (r0..r{last.tp_size - 1}): tokens {per_rank(last.global_num_tokens)}"
                         f"  logprob rows {per_rank(last.global_num_tokens_for_logprob)}"
                         f"  of {last.logit_rows}")
        self.query_one("#lpm-summary", Static).update(s)
        t = self.query_one("#lpm-table", DataTable)
        self.shown = append_rows(t, list(m.lpm), m.lpm_count, self.shown, self.MAX_ROWS, lpm_row)
