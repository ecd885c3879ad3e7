"""Shared pieces of the headless TUI tests: screen text, waiting on a condition, paused snapshots."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import pytest
import textual.constants
from rich.console import Console
from textual.pilot import Pilot

from mleagle.tui.app import MleagleTui
from mleagle.tui.source import ReplaySource

SIZE = (120, 36)


@pytest.fixture(autouse=True)
def no_animations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tab underline animations make every key press wait; they add nothing to what is tested."""
    monkeypatch.setattr(textual.constants, "TEXTUAL_ANIMATIONS", "none")


def screen_text(app: MleagleTui) -> str:
    """The current screen as plain text (what the SVG shows, without styles)."""
    c = Console(width=app.size.width, height=app.size.height, file=io.StringIO(), record=True, force_terminal=True)
    c.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return c.export_text()


async def until(pilot: Pilot, cond: Callable[[], bool], timeout: float = 10.0, step: float = 0.02) -> None:
    t = 0.0
    while not cond():
        assert t < timeout, "condition not reached in time"
        await pilot.pause(step)
        t += step


def replay_app(path: Path, stop: int) -> MleagleTui:
    return MleagleTui(ReplaySource(path, speed=0, stop_at=stop))


def paused_at(stop: int, *keys: str) -> Callable[[Pilot], object]:
    """A snapshot's `run_before`: wait until the replay pauses at event `stop`, then press `keys`."""
    async def run(pilot: Pilot) -> None:
        app = pilot.app
        assert isinstance(app, MleagleTui)
        await until(pilot, lambda: app.source.paused and app.source.delivered == stop)
        for k in keys:
            await pilot.press(k)
            await pilot.pause()
        app.refresh_view(force=True)
        await pilot.pause()
        # A tab switch animates its underline: on a loaded machine two pauses can end mid-animation,
        # and the snapshot then differs from the reference in the tab bar.
        await pilot.wait_for_scheduled_animations()
        await pilot.pause()

    return run
