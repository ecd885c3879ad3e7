"""`mleagle-tui`: a live terminal view of an mleagle server's state events, with record and replay.

The app owns one event source (a live WebSocket to the daemon's `/v1/events`, or a recording replayed
in time), runs it in an async worker on the app's loop so the UI never blocks, folds every event into
the `Dashboard` view model, and redraws the visible panel on a short timer only when the model changed
(Textual coalesces, and a fast stream does not cost one redraw per event). Eight tabs (keys 1-8):
Overview, Batches, Pools, Graphs, Logprobs, Acceptance, Requests, Policy; enter on a request opens its tokens
with logprobs. `p` pauses (a replay stops; a live view freezes while events keep being received and
recorded), `+`/`-` change the replay speed, `.` steps one event in a paused replay, `?` shows help,
`q` quits. Imports only the torch-free event schema and tracker, so it runs on a laptop without torch.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Header, Static, TabbedContent, TabPane

from mleagle.engine.contract.events import Event, RecordingWriter
from mleagle.tui.model import Dashboard
from mleagle.tui.panels import Panel
from mleagle.tui.panels.acceptance import AcceptancePanel
from mleagle.tui.panels.batches import BatchesPanel
from mleagle.tui.panels.graphs import GraphsPanel
from mleagle.tui.panels.logprobs import LogprobsPanel
from mleagle.tui.panels.overview import OverviewPanel
from mleagle.tui.panels.policy import PolicyPanel
from mleagle.tui.panels.pools import PoolsPanel
from mleagle.tui.panels.requests import RequestsPanel
from mleagle.tui.source import LiveSource, ReplaySource, Status

TABS: list[tuple[str, str, type[Panel]]] = [
    ("overview", "1 Overview", OverviewPanel),
    ("batches", "2 Batches", BatchesPanel),
    ("pools", "3 Pools", PoolsPanel),
    ("graphs", "4 Graphs", GraphsPanel),
    ("logprobs", "5 Logprobs", LogprobsPanel),
    ("acceptance", "6 Acceptance", AcceptancePanel),
    ("requests", "7 Requests", RequestsPanel),
    ("policy", "8 Policy", PolicyPanel),
]
SPEEDS = [0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0]

HELP = """\
[b]mleagle-tui[/b]: live view of an mleagle server's state events

[b]1-8[/b]        switch tab: Overview, Batches, Pools, Graphs, Logprobs, Acceptance, Requests, Policy
[b]tab[/b]        move focus (tables scroll with arrows / page up / page down)
[b]enter[/b]      on a request row: its tokens with logprobs and top alternatives
[b]p[/b]          pause / resume (a replay stops; a live view freezes, events still arrive and are recorded)
[b].[/b]          in a paused replay: step one event
[b]+ / -[/b]      replay speed up / down
[b]?[/b]          this help      [b]escape[/b] close a screen      [b]q[/b] quit

Status bar: source state (connected, reconnecting with backoff, replaying, paused, ended),
events received, malformed events ignored, events reported dropped upstream (engine, publisher, relay), and
gaps in the engine's event numbering seen since connecting (not shown when subscribed to some types).
Logprob rows whose per-rank counts disagree with the logit rows are shown in red.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape", "dismiss", "close"), Binding("question_mark", "dismiss", "close", show=False),
                Binding("q", "dismiss", "close", show=False)]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Vertical { width: 112; height: auto; border: thick $accent; background: $surface; padding: 1 2; }
    """

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(HELP)


class MleagleTui(App[None]):
    """The TUI app; `source` is a LiveSource or a ReplaySource, `record` a path to write events to."""

    TITLE = "mleagle-tui"
    CSS = """
    #status { height: 1; background: $boost; padding: 0 1; }
    TabbedContent { height: 1fr; }
    TabPane { padding: 0; }
    """
    BINDINGS = [
        *[Binding(str(i + 1), f"show_tab('{tid}')", label.split(" ", 1)[1], show=False) for i, (tid, label, _) in
          enumerate(TABS)],
        Binding("p", "toggle_pause", "pause/resume"),
        Binding("plus,equals_sign", "speed(1)", "faster"),
        Binding("minus", "speed(-1)", "slower"),
        Binding("full_stop", "step", "step", show=False),
        Binding("question_mark", "help", "help"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, source: LiveSource | ReplaySource, record: str | Path | None = None,
                 refresh_s: float = 0.2) -> None:
        super().__init__()
        self.source = source
        self.model = Dashboard()
        self.conn_status = source.status
        self.frozen = False  # live pause: keep receiving, stop redrawing
        self.refresh_s = refresh_s
        self.drawn = -1
        meta: dict[str, object] = {"types": source.types} if isinstance(source, LiveSource) and source.types else {}
        self.recorder = RecordingWriter(record, source=getattr(source, "url", ""), meta=meta) if record else None

    # --- layout ------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="◆")
        with TabbedContent(id="tabs", initial="overview"):
            for tid, label, cls in TABS:
                with TabPane(label, id=tid):
                    yield cls(id=f"panel-{tid}")
        yield Static("", id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = f"replay {self.source.path.name}" if isinstance(self.source, ReplaySource) else self.source.url
        self.run_source()
        self.set_interval(self.refresh_s, self.refresh_view)
        self.update_status()

    @work(exclusive=True, group="source", exit_on_error=False, description="event source")
    async def run_source(self) -> None:
        try:
            await self.source.run(self)
        except Exception as err:  # e.g. an unreadable recording: say so instead of dying silently
            self.sink_status(Status("error", f"{type(err).__name__}: {err}"))

    # --- sink (called by the source on the app's loop) ---------------------------------------------

    def sink_raw(self, text: str) -> None:
        e = self.model.apply_raw(text)
        if e is not None and self.recorder is not None:
            self.recorder.write(e)
        if e is None:
            self.update_status()

    def sink_event(self, e: Event) -> None:
        self.model.apply(e)
        if self.recorder is not None:
            self.recorder.write(e)

    def sink_status(self, s: Status) -> None:
        self.conn_status = s
        self.update_status()
        if s.state in ("paused", "ended"):
            self.refresh_view()  # so a paused/ended replay always shows its final state

    # --- drawing -----------------------------------------------------------------------------------

    def refresh_view(self, force: bool = False) -> None:
        """Redraw the visible panel (and the status bar) if the model changed since the last draw."""
        self.update_status()
        if self.frozen and not force:
            return
        if self.model.version == self.drawn and not force:
            return
        self.drawn = self.model.version
        try:
            active = self.query_one("#tabs", TabbedContent).active
            self.query_one(f"#panel-{active}", Panel).update_view(self.model)
        except Exception as err:  # a drawing bug must not kill a live session; show it instead
            self.model.last_error = f"draw: {type(err).__name__}: {err}"
        if self.recorder is not None:
            self.recorder.flush()

    def update_status(self) -> None:
        s, m = self.conn_status, self.model
        style = {"connected": "bold green", "replaying": "bold green", "connecting": "bold yellow",
                 "reconnecting": "bold red", "paused": "bold yellow", "ended": "bold cyan", "error": "bold red"}
        label = {"connected": "● connected", "replaying": "▶ replay", "connecting": "○ connecting",
                 "reconnecting": "✖ disconnected", "paused": "❚❚ paused", "ended": "■ replay ended",
                 "error": "✖ error"}[s.state]
        t = Text(label, style=style[s.state])
        if s.state == "error":
            t.append(f" {s.detail}", style="red")
        if s.state == "reconnecting":
            t.append(f" — reconnecting in {s.retry_in:.1f}s (attempt {s.attempt}): {s.detail}", style="red")
        if isinstance(self.source, ReplaySource):
            t.append(f"  {self.source.delivered}/{self.source.total}  speed {self.source.speed:g}x")
        t.append(f"  events {m.events}")
        t.append(f"  malformed {m.malformed}", style="bold red" if m.malformed else "")
        dropped = sum(m.dropped.values())
        t.append(f"  dropped {dropped}", style="bold yellow" if dropped else "")
        # sequence gaps are events lost anywhere upstream since we connected; with a type filter every
        # filtered-out event is a gap too, so they are only meaningful unfiltered
        if m.seq_gaps and not self.source.filtered:
            t.append(f"  gaps {m.seq_gaps}", style="bold yellow")
        if self.frozen:
            t.append("  VIEW FROZEN (p)", style="bold yellow")
        if self.recorder is not None:
            t.append(f"  rec {self.recorder.path.name} ({self.recorder.count})", style="magenta")
        try:
            self.query_one("#status", Static).update(t)
        except Exception:
            pass  # not mounted yet / shutting down

    # --- actions -----------------------------------------------------------------------------------

    def action_show_tab(self, tid: str) -> None:
        self.query_one("#tabs", TabbedContent).active = tid
        self._focus_panel(tid)
        self.refresh_view(force=True)

    def on_tabbed_content_tab_activated(self, ev: TabbedContent.TabActivated) -> None:
        if ev.pane.id:
            self._focus_panel(ev.pane.id)
        self.refresh_view(force=True)

    def _focus_panel(self, tid: str) -> None:
        # focus the panel's table so arrows and enter act on it right after switching tab
        tables = self.query_one(f"#panel-{tid}", Panel).query(DataTable)
        if tables:
            tables.first().focus()

    def action_toggle_pause(self) -> None:
        src = self.source
        if isinstance(src, ReplaySource):
            if src.done:
                return
            if src.paused:
                src.resume()
            else:
                src.pause()
            self.conn_status = Status("paused" if src.paused else "replaying", f"{src.delivered}/{src.total} events")
        else:
            self.frozen = not self.frozen
        self.refresh_view(force=True)

    def action_step(self) -> None:
        if isinstance(self.source, ReplaySource) and self.source.paused:
            self.source.step()

    def action_speed(self, d: int) -> None:
        src = self.source
        if not isinstance(src, ReplaySource):
            return
        if src.speed <= 0:
            src.speed = SPEEDS[-1] if d < 0 else 0  # from "as fast as possible" down to the fastest step
        else:
            i = min(range(len(SPEEDS)), key=lambda k: abs(SPEEDS[k] - src.speed))
            src.speed = SPEEDS[max(0, min(len(SPEEDS) - 1, i + d))]
        self.update_status()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def on_unmount(self) -> None:
        if self.recorder is not None:
            self.recorder.close()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="mleagle-tui", description="Live view of an mleagle server's state events.")
    ap.add_argument("--url", default=os.environ.get("MLEAGLE_URL", "http://127.0.0.1:8000"),
                    help="server base URL (the TUI connects to ws://…/v1/events)")
    ap.add_argument("--api-key", default=os.environ.get("MLEAGLE_API_KEY"),
                    help="sent as 'Authorization: Bearer KEY' (default: $MLEAGLE_API_KEY)")
    ap.add_argument("--types", default=None, help="comma-separated event types to subscribe to (default: all)")
    ap.add_argument("--record", metavar="FILE", help="write every received event to FILE (JSON Lines)")
    ap.add_argument("--replay", metavar="FILE", help="replay a recording instead of connecting")
    ap.add_argument("--speed", type=float, default=1.0, help="replay speed factor (0 = as fast as possible)")
    ap.add_argument("--paused", action="store_true", help="start a replay paused")
    ap.add_argument("--stop-at", type=int, default=None, metavar="N", help="pause a replay after N events")
    return ap.parse_args(argv)


def build_app(argv: Sequence[str] | None = None) -> MleagleTui:
    a = parse_args(argv)
    if a.replay:
        src: LiveSource | ReplaySource = ReplaySource(a.replay, speed=a.speed, paused=a.paused, stop_at=a.stop_at)
    else:
        types = [t.strip() for t in a.types.split(",") if t.strip()] if a.types else None
        src = LiveSource(a.url, api_key=a.api_key, types=types)
    return MleagleTui(src, record=a.record)


def main(argv: Sequence[str] | None = None) -> None:
    build_app(argv).run()


if __name__ == "__main__":
    main()
