"""Policy: how many draft steps S' the speculation policy runs per decode iteration, and why.

The summary is the latest decision (its depth, reason, predicted and measured gain, the requests whose
draft layers caught up first); the strip shows the depths of the latest iterations, newest on the
right, one digit each. The table has per depth the iterations the engine ran since it started (from
the status event's totals; before the first status, those this TUI saw), their share, and the mean
predicted and measured gain over the decisions seen at that depth: a depth whose measured gain stays
under its predicted one is costed too cheaply. Gains are tokens/s over depth 0's (1.00x: equal; "-":
none, as in a fixed mode or while the policy measures). Below the totals, "served check" lists the
batch-size buckets where drafting cost more under traffic than the warm-up timed, with the discount
served rates put on drafting there. Sparklines: the predicted and the measured gain per iteration (0
where there was none). A target-only engine sends no policy events.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Label, Sparkline, Static

from mleagle.tui.model import Dashboard
from mleagle.tui.panels import Panel, bar, fmt_f, fmt_s

DEPTH_STYLE = ["grey62", "cyan", "green", "yellow", "magenta", "red"]  # by depth; deeper ones reuse the last
STRIP = 100  # depths in the strip: what fits on one line of a 120-column terminal


def depth_style(d: int) -> str:
    return DEPTH_STYLE[min(d, len(DEPTH_STYLE) - 1)]


def gain(x: float | None) -> str:
    return "-" if not x else f"{x:.2f}x"


class PolicyPanel(Panel):
    DEFAULT_CSS = """
    PolicyPanel Static { height: auto; margin: 0 1 1 1; }
    PolicyPanel Label { margin: 0 1; color: $text-muted; }
    PolicyPanel Sparkline { height: 2; margin: 0 1 1 1; }
    """

    def compose(self) -> ComposeResult:
        yield Static("no speculation-policy events yet (a target-only engine sends none)", id="pol-summary")
        yield Static("", id="pol-strip")
        yield Static("", id="pol-table")
        yield Label("predicted gain per iteration", id="lbl-pol-pred")
        yield Sparkline([], id="pol-pred", summary_function=max)
        yield Label("measured gain per iteration", id="lbl-pol-meas")
        yield Sparkline([], id="pol-meas", summary_function=max)

    def update_view(self, m: Dashboard) -> None:
        last = m.tracker.last_spec_policy
        if last is None:
            return
        tot = m.engine.spec_policy if m.engine is not None else None
        s = last.S
        self.query_one("#pol-summary", Static).update(Text.assemble(
            ("mode ", "bold"), last.mode or (tot.mode if tot else "-"), ("   S ", "bold"), str(s),
            ("   S' ", "bold"), (str(last.depth), f"bold {depth_style(last.depth)}"),
            ("   reason ", "bold"), last.reason or "-",
            ("   predicted ", "bold"), gain(last.predicted_gain), ("   measured ", "bold"), gain(last.measured_gain),
            ("   caught up ", "bold"), f"{last.catch_up} requests", ("   step ", "bold"), str(last.step),
            ("   bs ", "bold"), str(last.bs)))
        recent = list(m.policy)[-STRIP:]
        strip = Text("last depths  ", style="bold")
        for e in recent:
            strip.append(str(e.depth) if e.depth < 10 else "+", style=depth_style(e.depth))
        self.query_one("#pol-strip", Static).update(strip)
        # Since the engine started (its totals) when a status has arrived; else what this TUI saw.
        iters = list(tot.iterations_by_depth) if tot and tot.iterations_by_depth else \
            [m.policy_by_depth.get(d, 0) for d in range(s + 1)]
        n = sum(iters) or 1
        t = Table(box=None, padding=(0, 1), header_style="bold", title="iterations by depth"
                  + (" (engine totals)" if tot else " (seen here)"), title_justify="left", title_style="bold")
        for c in ("S'", "iterations", "share", "", "predicted", "measured"):
            t.add_column(c, justify="left" if c == "" else "right")
        for d, k in enumerate(iters):
            t.add_row(Text(str(d), style=depth_style(d)), str(k), f"{100 * k / n:.1f}%", bar_share(k / n),
                      gain(m.mean_gain("predicted", d)), gain(m.mean_gain("measured", d)))
        r = Table(box=None, padding=(0, 1), header_style="bold", title="reasons (seen here)", title_justify="left",
                  title_style="bold")
        r.add_column("reason")
        r.add_column("count", justify="right")
        for why, k in m.policy_reasons.most_common(6):
            r.add_row(why or "-", str(k))
        g = Table.grid(padding=(0, 4))
        g.add_row(t, r)
        if tot is not None:
            g.add_row(Text.assemble(
                ("drafts accepted ", "bold"), str(tot.tokens_gained), ("   switches ", "bold"), str(tot.switches),
                ("   explored ", "bold"), str(tot.explore_iterations),
                ("\ncatch-ups ", "bold"), f"{tot.catch_ups} ({tot.catch_up_positions} positions, "
                                          f"{fmt_s(tot.catch_up_s)})",
                ("   choices ", "bold"), f"{tot.choose_calls} ({fmt_s(tot.choose_mean_s)} each)",
                *((("\nserved check ", "bold"), served(tot.served_discount)) if tot.served_discount else ())), "")
        self.query_one("#pol-table", Static).update(g)
        self.query_one("#pol-pred", Sparkline).data = [e.predicted_gain for e in m.policy]
        self.query_one("#pol-meas", Sparkline).data = [e.measured_gain for e in m.policy]
        self.query_one("#lbl-pol-pred", Label).update(
            f"predicted gain per iteration  (last {fmt_f(last.predicted_gain)})")
        self.query_one("#lbl-pol-meas", Label).update(
            f"measured gain per iteration  (last {fmt_f(last.measured_gain)})")


def served(discounts: dict[str, float]) -> str:
    """The buckets where drafting cost more served than at warm-up, each with the discount served rates
    put on drafting there: "bs<=32 0.86x  bs<=64 1.00x"."""
    def name(b: int) -> str:  # a negative bucket is constrained batches'
        return f"bs<={abs(b)}" + (" constrained" if b < 0 else "")

    return "  ".join(f"{name(b)} {v:.2f}x" for b, v in sorted(((int(k), v) for k, v in discounts.items()),
                                                               key=lambda kv: (kv[0] < 0, abs(kv[0]))))


def bar_share(f: float) -> Text:
    """A share of iterations: a plain bar, no good or bad colour (a depth is neither)."""
    t = bar(f, 24)
    t.stylize("cyan", 0, round(f * 24))
    return t
