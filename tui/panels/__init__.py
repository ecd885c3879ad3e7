"""One module per TUI panel; each panel is a container with `update_view(model)` called on redraw.

Panels read the `Dashboard` view model and never touch sources or sockets: the app owns the data flow,
the panels only render. Shared rendering helpers (text bars, number formats) live here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

from rich.text import Text
from textual.containers import Vertical
from textual.widgets import DataTable

from mleagle.tui.model import Dashboard

# What the panels' tables hold: plain or styled text.
Cell: TypeAlias = str | Text


class Panel(Vertical):
    """Base of every panel: `update_view` is called by the app when the model changed."""

    DEFAULT_CSS = """
    Panel { height: 1fr; }
    Panel DataTable { height: 1fr; }
    """

    def update_view(self, m: Dashboard) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


def bar(frac: float, width: int = 30) -> Text:
    """A horizontal bar, green below 70 %, yellow below 90 %, red above (pool pressure)."""
    frac = min(max(frac, 0.0), 1.0)
    full = round(frac * width)
    style = "green" if frac < 0.7 else "yellow" if frac < 0.9 else "bold red"
    t = Text("█" * full, style=style)
    t.append("░" * (width - full), style="grey37")
    return t


def fmt_s(x: float | None) -> str:
    """Seconds as a short human figure (µs/ms/s)."""
    if x is None:
        return "-"
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    if x < 1:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def fmt_f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def append_rows(table: DataTable, items: list, count: int, shown: int, max_rows: int,
                row: Callable[[Any], tuple]) -> int:
    """Append to a DataTable the items of a bounded history that it has not shown yet.

    `items` is the history (oldest first), `count` how many items were ever appended to it, `shown`
    how many of those the table already has. Rows get stable keys (their index in the stream), the
    oldest rows are removed past `max_rows`, and the cursor follows the newest row only when it was
    already on the last row (so an operator reading older rows is not yanked away). Returns the new
    `shown`.
    """
    new = count - shown
    if new <= 0:
        return shown
    follow = table.row_count == 0 or table.cursor_row >= table.row_count - 1
    start = max(0, len(items) - new)
    for i, it in enumerate(items[start:], start=count - (len(items) - start)):
        table.add_row(*row(it), key=str(i))
    while table.row_count > max_rows:
        table.remove_row(next(iter(table.rows)))
    if follow:  # after the next layout, so the scroll target exists even if the tab was just shown
        table.call_after_refresh(lambda: table.move_cursor(row=table.row_count - 1, animate=False))
    return count
