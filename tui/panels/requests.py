"""Requests: one row per request (state, prompt and output tokens, accept length, finish reason), and a
drill-down screen (enter on a row) listing every emitted token with its text, logprob, probability,
the speculative depth that produced it and the top alternatives. A daemon publishes tokens only when
its operator opts in (`--events-include-text`); otherwise the drill-down says so.
"""

from __future__ import annotations

import math

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label

from mleagle.tui.model import Dashboard, RequestView
from mleagle.tui.panels import Cell, Panel, fmt_f

STATE_STYLE = {"queued": "yellow", "running": "bold cyan", "finished": "green", "aborted": "red",
               "preempted": "magenta"}
COLS = ("rid", "state", "prompt", "output", "accept len", "finish", "tokens")


def req_row(r: RequestView) -> tuple:
    return (Text(r.rid), Text(r.state, style=STATE_STYLE.get(r.state, "")), str(r.prompt_tokens),
            str(r.output_tokens), fmt_f(r.accept_len), r.finish_reason or (r.error or ""), str(len(r.tokens)))


class RequestsPanel(Panel):
    def compose(self) -> ComposeResult:
        t: DataTable[Cell] = DataTable(id="requests-table", zebra_stripes=True, cursor_type="row")
        for c in COLS:
            t.add_column(c, key=c)
        yield t

    def on_mount(self) -> None:
        self.drawn: dict[str, int] = {}  # rid -> RequestView.ver last drawn

    def update_view(self, m: Dashboard) -> None:
        t = self.query_one("#requests-table", DataTable)
        for rid, r in m.requests.items():
            ver = self.drawn.get(rid)
            if ver == r.ver:
                continue
            cells = req_row(r)
            if ver is None:
                t.add_row(*cells, key=rid)
            else:
                for c, v in zip(COLS, cells):
                    t.update_cell(rid, c, v)
            self.drawn[rid] = r.ver
        for k in set(self.drawn) - set(m.requests):  # evicted from the bounded history
            t.remove_row(k)
            del self.drawn[k]

    def on_data_table_row_selected(self, ev: DataTable.RowSelected) -> None:
        rid = ev.row_key.value
        r = self.app.model.requests.get(rid) if rid else None  # type: ignore[attr-defined]
        if r is not None:
            self.app.push_screen(RequestScreen(r))


def _piece(s: str | None) -> str:
    return "" if s is None else repr(s)[1:-1]  # show spaces and newlines explicitly


class RequestScreen(ModalScreen[None]):
    """Drill-down of one request: its tokens with logprobs and top alternatives."""

    BINDINGS = [Binding("escape", "dismiss", "back"), Binding("q", "dismiss", "back", show=False)]
    DEFAULT_CSS = """
    RequestScreen { align: center middle; }
    RequestScreen > Vertical { width: 90%; height: 90%; border: thick $accent; background: $surface; }
    RequestScreen Label { margin: 0 1; }
    """

    def __init__(self, r: RequestView) -> None:
        super().__init__()
        self.r = r

    def compose(self) -> ComposeResult:
        r = self.r
        text = "".join(t.text or "" for t in r.tokens)
        with Vertical():
            yield Label(Text.assemble(("request ", "bold"), r.rid, "  ", (r.state, STATE_STYLE.get(r.state, "")),
                                      f"   prompt {r.prompt_tokens}  output {r.output_tokens}"
                                      f"  accept len {fmt_f(r.accept_len)}  finish {r.finish_reason or '-'}"
                                      "   (escape to go back)"))
            if not r.tokens and r.output_tokens:
                text = ("(this server publishes token counts only; its operator can start it with "
                        "--events-include-text to show tokens and logprobs here)")
            yield Label(Text(text[-300:] if len(text) > 300 else text, style="italic"), id="req-text")
            t: DataTable[Cell] = DataTable(id="tokens-table", zebra_stripes=True, cursor_type="row")
            t.add_columns("#", "token", "id", "logprob", "prob", "depth", "top alternatives")
            for i, tok in enumerate(r.tokens):
                alts = "  ".join(f"{_piece(a.text) or a.token_id} {a.logprob:.2f}" for a in tok.top
                                 if a.token_id != tok.token_id)
                lp = tok.logprob
                t.add_row(str(i), Text(_piece(tok.text), style="bold"), str(tok.token_id),
                          "-" if lp is None else f"{lp:.3f}", "-" if lp is None else f"{math.exp(lp):.3f}",
                          "-" if tok.depth is None else ("bonus" if tok.depth == 0 else f"draft {tok.depth}"),
                          Text(alts))
            yield t
